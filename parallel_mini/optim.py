"""Adam and SGD written out, so every byte of optimizer state is visible.

Same arithmetic as `torch.optim.Adam` (Kingma & Ba, 2015, with torch's bias-correction order), but
the step counts are Python ints rather than a 0-d tensor per parameter: optimizer memory is then
exactly 8 bytes per fp32 parameter (two moments), the number the memory lesson derives.
The optimizer steps whatever tensors it is given: full parameters for DP, a shard for ZeRO.

Why eps defaults to 1e-5 (torch's default is 1e-8): Adam divides by |g| + eps, so an update moves by
up to lr/eps per unit change of its gradient. Two mathematically equal strategies sum gradients in
different orders, and fp32 rounding leaves ~1e-10 of noise on near-zero gradients. Measured on the
tiny GPT after 3 steps (dp=2..4, ZeRO-1 and plain DP vs the single-process run): eps = 1e-8 gives
parameter differences up to ~3e-5, 1e-6 up to ~1e-5, 1e-5 up to ~2e-6. The reference and every
strategy use the same eps, so the comparison is exact in intent; 1e-5 only keeps the optimizer from
amplifying rounding noise past the 1e-5 equality bar.
"""
from __future__ import annotations

import math

import torch


def adam_update(p, g, m, v, t: int, lr: float, betas, eps: float) -> None:
    """Adam's step t on p in place, with its moments m and v (elementwise: a slice of p stepped
    with the same slices of g, m, v gives the same bits as the whole; offload_disk.py relies on it)."""
    b1, b2 = betas
    bias1, bias2 = 1 - b1 ** t, 1 - b2 ** t
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g.conj(), value=1 - b2)
    denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bias1)


class Adam:
    def __init__(self, params, lr=3e-3, betas=(0.9, 0.999), eps=1e-5):
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.param_steps: dict[int, int] = {}  # Python ints, not tensors: no state bytes
        self.state: dict[int, dict[str, torch.Tensor]] = {}  # index -> {exp_avg, exp_avg_sq}

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            if p.grad is None:  # no gradient this step: leave the parameter and its moments alone
                continue
            # torch counts steps per parameter: one that sat out a step keeps its bias correction
            t = self.param_steps[i] = self.param_steps.get(i, 0) + 1
            st = self.state.get(i)
            if st is None:
                st = self.state[i] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            adam_update(p, p.grad, st["exp_avg"], st["exp_avg_sq"], t, self.lr, self.betas, self.eps)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for st in self.state.values() for t in st.values()]


class SGD:
    def __init__(self, params, lr=3e-3):
        self.params, self.lr = list(params), lr
        self.state: dict = {}  # plain SGD keeps no state: 0 bytes per parameter

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return []


class MasterWeights:
    """Mixed precision (Micikevicius et al., 2018): compute in bf16, update in fp32.

    The model's parameters and gradients are bf16 (2 + 2 bytes each); the optimizer keeps an fp32
    master copy of every parameter (4 bytes) and steps it, then rounds the result back into the bf16
    parameter. Small updates would vanish if added to bf16 weights directly (8 bits of mantissa):
    the master copy is what keeps them. With Adam: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter."""

    def __init__(self, params, name: str, lr: float):
        self.params = list(params)
        self.masters = [p.detach().float().clone() for p in self.params]
        self.inner = make_optimizer(name, self.masters, lr)

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            if hasattr(p, "main_grad"):  # an fp32 accumulation buffer: use it as is
                m.grad = p.main_grad
            else:
                m.grad = None if p.grad is None else p.grad.float()  # transient fp32 copy
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
            m.grad = None

    def zero_grad(self):
        for p in self.params:
            if hasattr(p, "main_grad"):  # buffers persist, zeroed (the 20-byte variant)
                p.main_grad.zero_()
                if p.grad is not None:
                    p.grad.zero_()
            else:
                p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return self.masters + self.inner.state_tensors()


PARAM_DTYPE = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16}


def make_optimizer(name: str, params, lr: float, precision: str = "fp32"):
    if precision == "bf16-mixed":
        return MasterWeights(params, name, lr)
    return {"adam": Adam, "sgd": SGD}[name](params, lr=lr)
