"""Context parallelism: every sequence split over the cp ranks, attention computed across them.

Tensor and sequence parallel split a layer; long sequences need more: activations grow with s, and
attention's scores with s^2. Context parallel gives each of C ranks s/C tokens of every sequence
for the *whole* model. Everything but attention is per token and needs nothing from other ranks;
attention needs every earlier token's keys and values. Two ways to get them:

- ring (Liu et al., 2023, "Ring Attention with Blockwise Transformers"): the K/V blocks travel
  around the cp ring, one hop per step, the next block's transfer posted before the current block's
  attention is computed (overlap). Partial results are merged with the online softmax (Milakov &
  Gimelshein, 2018; FlashAttention): per query row, a running log-sum-exp `lse` and output `o`;
  a new block with (o_t, lse_t) gives lse' = log(e^lse + e^lse_t), o' = o e^(lse-lse') +
  o_t e^(lse_t-lse'). Backward goes around the ring again: each block carries its dK, dV
  accumulators with it and arrives home with every rank's contribution.
- zigzag: with a causal mask and contiguous chunks, rank C-1 attends to everything and rank 0 to
  its own chunk only. Cutting the sequence into 2C chunks and giving rank r chunks r and 2C-1-r
  evens the work: every rank computes 2C+1 of the 4C chunk tiles (Brandon et al., 2023, "Striped
  Attention"; the zigzag of Megatron-LM and Llama 3).
- ulysses (Jacobs et al., 2023, "DeepSpeed Ulysses"): an all-to-all turns [b, a, s/C, d]
  (sequence-sharded, all heads) into [b, a/C, s, d] (head-sharded, whole sequence), attention runs
  as on one device, and a second all-to-all turns the result back. Needs heads divisible by C.

Seams used: the embedding's `positions` (which positions this rank's tokens are at) and the
attention core (replaced; it has no parameters, so names do not change). Gradients are summed over
the loss axis dp x cp by the gradient strategy: each rank's loss is the mean over its own tokens.
"""
from __future__ import annotations

import math

import torch

from ..comm import Comm
from ..meters import RingHop, hidden_fraction  # noqa: F401 (lesson 06: context.hidden_fraction)
from ..model import AttentionCore


# ---------------------------------------------------------------------------------------------
# layout: which tokens each rank holds
# ---------------------------------------------------------------------------------------------
def chunks_of(layout: str, c: int, rank: int) -> list[int]:
    """Which chunks of the sequence rank `rank` holds, in order, the sequence being cut into
    n_chunks(layout, C) equal chunks: "contiguous" (ring, ulysses) C chunks, rank r holds chunk r;
    "zigzag" 2C chunks, rank r holds chunks r and 2C-1-r."""
    return [rank, 2 * c - 1 - rank] if layout == "zigzag" else [rank]


def n_chunks(layout: str, c: int) -> int:
    return 2 * c if layout == "zigzag" else c


def positions_of(layout: str, seq: int, c: int, rank: int) -> torch.Tensor:
    """Token positions of this rank's part of the sequence: [s/C] int64."""
    size = seq // n_chunks(layout, c)
    return torch.cat([torch.arange(k * size, (k + 1) * size) for k in chunks_of(layout, c, rank)])


def split_sequence(batch, layout: str, c: int, rank: int):
    """(inputs, targets) [b, s] -> this rank's [b, s/C] columns."""
    x, y = batch
    pos = positions_of(layout, x.shape[1], c, rank)
    return x[:, pos], y[:, pos]


# ---------------------------------------------------------------------------------------------
# one tile: a query chunk against a key/value chunk
# ---------------------------------------------------------------------------------------------
def _tile_kind(q_chunk: int, k_chunk: int) -> str:
    """"skip": fully masked (every key after every query); "full": fully visible (no mask to
    build: every key before every query); "causal": the diagonal tile, the only one that needs
    the causal mask."""
    return "skip" if k_chunk > q_chunk else "full" if k_chunk < q_chunk else "causal"


def _scores(q, k, causal: bool):  # q [b, a, c, d], k [b, a, c, d] -> [b, a, c, c]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if not causal:
        return s
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return s.masked_fill(~mask, float("-inf"))


# Fused tiles. Written out, a tile is four passes over a [c, c] score matrix in memory (scores,
# mask, exp, @ V; backward: five). Torch's CPU flash-attention kernel does the same arithmetic in
# blocks that stay in cache, builds no mask (a causal tile skips its upper blocks) and returns the
# tile's log-sum-exp, which is all the ring's merge needs: it is the op torch's own ring template
# (torch.distributed.tensor.experimental) calls on CPU, measured 4-30x faster than the written-out
# forward on this toy (`bench cp` prints the split). Other devices take the written-out tile,
# which is also the definition of what the fused call returns.
_FUSED = {"cpu": (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)}


def _attend_tile(q, k, v, causal: bool):
    """One tile: q's rows over these keys only: (o_t [b, a, c, d], normalised over these keys;
    lse_t [b, a, c], the log of their softmax sum)."""
    if q.device.type in _FUSED:
        return _FUSED[q.device.type][0](q, k, v, is_causal=causal)[:2]
    s = _scores(q, k, causal)
    lse_t = torch.logsumexp(s, dim=-1)
    return (s - lse_t.unsqueeze(-1)).exp() @ v, lse_t


def _tile_grads(grad_out, q, k, v, out, lse, causal: bool):
    """One tile's (dq, dk, dv) from the *merged* out and lse of q's rows: p = e^(s - lse) is then
    this tile's share of the whole row's softmax, so the tiles' gradients add up to the whole
    attention's (FlashAttention's backward)."""
    if q.device.type in _FUSED:
        return _FUSED[q.device.type][1](grad_out, q, k, v, out, lse, 0.0, causal)
    scale = 1 / math.sqrt(q.shape[-1])
    p = (_scores(q, k, causal) - lse.unsqueeze(-1)).exp()  # [b, a, c, c]
    delta = (grad_out * out).sum(-1, keepdim=True)  # [b, a, c, 1]
    ds = p * (grad_out @ v.transpose(-2, -1) - delta)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ grad_out


def _release(*buffers: torch.Tensor) -> None:
    """Give a finished message buffer's bytes back now. Gloo's worker thread can hold a reference
    to a buffer for a while after the op completed; the bytes would then be freed at a moment
    that depends on thread timing, and so would what the memory meter reads (seen: 64 KiB more,
    once in 12 runs). Only for buffers nothing reads again."""
    for b in buffers:
        b.untyped_storage().resize_(0)


def _merge(out, lse, o_t, lse_t):
    """The online softmax: fold a tile's normalised output o_t (log-sum-exp lse_t) into (out, lse)."""
    new = torch.logaddexp(lse, lse_t)  # [b, a, c]
    out = out * (lse - new).exp().unsqueeze(-1) + o_t * (lse_t - new).exp().unsqueeze(-1)
    return out, new


# ---------------------------------------------------------------------------------------------
# ring attention
# ---------------------------------------------------------------------------------------------
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, core):  # q, k, v: [b, a, n, d], n = s/C, this rank's tokens
        out, lse = core.ring_forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.core = core
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.core.ring_backward(q, k, v, out, lse, grad_out.contiguous()), None)


class RingAttentionCore(torch.nn.Module):
    """Causal attention over the whole sequence from this rank's queries, K/V going round the ring."""

    def __init__(self, comm: Comm, axis: str, layout: str):
        super().__init__()
        self.comm, self.axis, self.layout = comm, axis, layout
        self.c, self.rank = comm.size(axis), comm.rank(axis)
        self.tiles: list[dict] = []  # the last forward's tile map (ring step, q chunk, k chunk)
        self.hops: list[dict] = []  # the last forward's hops: posted, computed, arrived (seconds)

    def forward(self, q, k, v):  # [b, a, n, d] x 3 -> [b, a, n, d]
        return _RingAttention.apply(q, k, v, self)

    def _neighbours(self):
        return (self.rank + 1) % self.c, (self.rank - 1) % self.c

    def _receive(self, like: torch.Tensor, t: int, what: str):
        """Post hop t's receive (from the previous rank, into a new buffer shaped as `like`).
        Posted one hop early, while the step before still computes: gloo sends a message only
        into a receive the receiver has announced (a rendezvous, see Comm.sendrecv), so a receive
        announced late costs the sender a round trip on the ring's critical path."""
        buf = torch.empty_like(like)
        return buf, self.comm.irecv(buf, self._neighbours()[1], self.axis, layer="ring",
                                    ring_step=t, carries=what, block=(self.rank - t - 1) % self.c)

    def _send(self, send: torch.Tensor, t: int, what: str, receiving, log: list | None = None):
        """Post hop t's send of what we hold to the next rank; its receive (`receiving`) was
        posted before. Returns the hop (wait on it; `log`: its times, meters.RingHop)."""
        hop = RingHop(log, ring_step=t)
        hop.handles = (self.comm.isend(send, self._neighbours()[0], self.axis, layer="ring",
                                       ring_step=t, carries=what, block=(self.rank - t) % self.c),
                       receiving)
        return hop

    def _tiles(self, t: int, src: int) -> list[dict]:
        """The tile map of ring step t (block `src`): every query chunk of this rank against every
        key chunk of src's, each "computed" or skipped (fully masked)."""
        mine, theirs = chunks_of(self.layout, self.c, self.rank), chunks_of(self.layout, self.c, src)
        return [{"ring_step": t, "from": src, "q_chunk": qc, "k_chunk": kc,
                 "computed": _tile_kind(qc, kc) != "skip"} for qc in mine for kc in theirs]

    def _rectangle(self, src: int, size: int):
        """The tokens this rank computes with block `src`, as one rectangle: (query slice, key
        slice, causal), None when every tile is skipped. Why one: a step's computed tiles always
        form one rectangle of whole chunks (contiguous: its one tile; zigzag: both query chunks
        against the earlier key chunk, or the later query chunk against both), and on the
        diagonal step (its own block) one causal call covers all of them, because this rank's
        chunks lie in increasing order, so the causal mask of the local positions is the global
        one. One fused call per step instead of one per tile: fewer, larger kernel calls and one
        merge (torch's ring template does the same)."""
        if src == self.rank:
            return slice(None), slice(None), True
        mine, theirs = chunks_of(self.layout, self.c, self.rank), chunks_of(self.layout, self.c, src)
        pairs = [(i, j) for i, qc in enumerate(mine) for j, kc in enumerate(theirs)
                 if _tile_kind(qc, kc) == "full"]
        if not pairs:
            return None
        rows, cols = sorted({i for i, _ in pairs}), sorted({j for _, j in pairs})
        assert len(pairs) == len(rows) * len(cols), "a step's tiles are one rectangle"
        return (slice(rows[0] * size, (rows[-1] + 1) * size),
                slice(cols[0] * size, (cols[-1] + 1) * size), False)

    @torch.no_grad()
    def ring_forward(self, q, k, v):
        size = q.shape[2] // len(chunks_of(self.layout, self.c, self.rank))  # tokens per chunk
        out = lse = None
        kv, tiles, hops = torch.stack([k, v]), [], []  # [2, b, a, n, d]: one message per hop
        receiving = self._receive(kv, 0, "kv") if self.c > 1 else None
        for t in range(self.c):
            src = (self.rank - t) % self.c
            if t < self.c - 1:  # the next block is on its way while this one is computed
                nxt, got = receiving
                if t + 1 < self.c - 1:
                    receiving = self._receive(kv, t + 1, "kv")  # one hop early (see _receive)
                hop = self._send(kv, t, "kv", got, hops)
            tiles += self._tiles(t, src)
            rect = self._rectangle(src, size)
            if rect is not None:
                rows, cols, causal = rect
                o_t, lse_t = _attend_tile(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                          causal=causal)
                if out is None:  # step 0, the diagonal: every query row, nothing to merge yet
                    # in [b, a, n, d] memory order, as the written-out tile returns it (the fused
                    # kernel's is [b, n, a, d] seen transposed): the merges then write contiguous
                    # rows, and what the layers after keep for backward (theory's activation
                    # count) stays that of the written-out ring
                    out, lse = o_t.contiguous(), lse_t
                else:
                    out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows],
                                                              o_t, lse_t)
            if t < self.c - 1:
                hop.wait()  # what it waits past the compute above is exposed transfer time
                _release(kv)  # sent, and computed on: done with it
                kv = nxt
        _release(kv)  # the last block received
        self.tiles, self.hops = tiles, hops
        return out, lse

    @torch.no_grad()
    def ring_backward(self, q, k, v, out, lse, grad_out):
        """FlashAttention's backward, a rectangle per step; dK, dV travel with their block and
        come home."""
        size = q.shape[2] // len(chunks_of(self.layout, self.c, self.rank))
        lse_of = {}  # query slice -> its lse, contiguous: the fused backward reads it flat
        dq = torch.zeros_like(q)
        # one message buffer [k, v, dk, dv]: the block travels with its gradients so far. Built
        # once; each hop sends the buffer it received (no copy per hop, as a cat would make)
        both = torch.empty(4, *k.shape, dtype=k.dtype, device=k.device)
        both[0], both[1], both[2:] = k, v, 0
        dkv = both[2:]
        for t in range(self.c):
            src = (self.rank - t) % self.c
            last = t == self.c - 1  # this hop's receive, posted before the compute (_receive)
            receiving = self._receive(dkv if last else both, t, "dkv" if last else "kv+dkv")
            rect = self._rectangle(src, size)
            if rect is not None:
                rows, cols, causal = rect
                key = (rows.start, rows.stop)
                if key not in lse_of:
                    lse_of[key] = lse[:, :, rows].contiguous()
                dq_t, dk_t, dv_t = _tile_grads(grad_out[:, :, rows], q[:, :, rows],
                                               both[0][:, :, cols], both[1][:, :, cols],
                                               out[:, :, rows], lse_of[key], causal=causal)
                dq[:, :, rows] += dq_t
                dkv[0][:, :, cols] += dk_t
                dkv[1][:, :, cols] += dv_t
            nxt, got = receiving
            if t < self.c - 1:  # block, and its gradients so far, to the next rank
                self._send(both, t, "kv+dkv", got).wait()
                both, dkv = nxt, nxt[2:]
            else:  # the last hop takes the gradients home to the block's owner
                self._send(dkv, t, "dkv", got).wait()
                dkv = nxt
        return dq, dkv[0], dkv[1]


# ---------------------------------------------------------------------------------------------
# Ulysses: all-to-all from sequence shards to head shards and back
# ---------------------------------------------------------------------------------------------
class _SeqToHeads(torch.autograd.Function):
    """[b, a, n, d] (n = s/C, all heads) -> [b, a/C, s, d]; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _seq_to_heads(x, comm, axis)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.comm, ctx.axis), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _heads_to_seq(x, comm, axis)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.comm, ctx.axis), None, None


def _seq_to_heads(x, comm, axis):
    c = comm.size(axis)
    b, a, n, d = x.shape
    send = x.view(b, c, a // c, n, d).transpose(0, 1).contiguous()  # [C (to rank), b, a/C, n, d]
    recv = torch.empty_like(send)  # [C (from rank), b, a/C, n, d]: rank j's tokens of my heads
    comm.all_to_all(recv, send, axis, layer="ulysses")
    out = torch.empty(b, a // c, c * n, d, dtype=x.dtype, device=x.device)
    out.view(b, a // c, c, n, d).copy_(recv.permute(1, 2, 0, 3, 4))  # sequence in rank order
    _release(send, recv)
    return out


def _heads_to_seq(x, comm, axis):
    c = comm.size(axis)
    b, ac, s, d = x.shape
    send = x.view(b, ac, c, s // c, d).permute(2, 0, 1, 3, 4).contiguous()  # [C, b, a/C, n, d]
    recv = torch.empty_like(send)  # [C (from rank), b, a/C, n, d]: my tokens, rank j's heads
    comm.all_to_all(recv, send, axis, layer="ulysses")
    out = torch.empty(b, c * ac, s // c, d, dtype=x.dtype, device=x.device)
    out.view(b, c, ac, s // c, d).copy_(recv.transpose(0, 1))  # heads in rank order
    _release(send, recv)
    return out


class UlyssesAttentionCore(torch.nn.Module):
    def __init__(self, comm: Comm, axis: str):
        super().__init__()
        self.comm, self.axis = comm, axis
        self.inner = AttentionCore()  # plain causal attention, on the whole sequence

    def forward(self, q, k, v):  # [b, a, s/C, d] x 3 -> [b, a, s/C, d]
        b, a, n, d = q.shape
        # one all-to-all for the three, each head's q, k, v side by side so a rank's share of the
        # heads carries all three: [b, a, 3, n, d] seen as [b, 3a, n, d]
        qkv = torch.stack([q, k, v], dim=2).view(b, 3 * a, n, d)
        qkv = _SeqToHeads.apply(qkv, self.comm, self.axis)  # [b, 3a/C, s, d]
        q, k, v = qkv.view(b, a // self.comm.size(self.axis), 3, -1, d).unbind(dim=2)
        return _HeadsToSeq.apply(self.inner(q, k, v).contiguous(), self.comm, self.axis)


# ---------------------------------------------------------------------------------------------
# applying it
# ---------------------------------------------------------------------------------------------
class ContextParallel:
    """What apply_context_parallel did, for the engine: split batches, report the tiles."""

    def __init__(self, comm: Comm, axis: str, impl: str, cores: list):
        self.comm, self.axis, self.impl, self.cores = comm, axis, impl, cores
        self.c, self.rank = comm.size(axis), comm.rank(axis)

    def split(self, batch):
        """[b, s] -> this rank's [b, s/C] tokens (every rank when C = 1)."""
        if self.c == 1:
            return batch
        return split_sequence(batch, "zigzag" if self.impl == "zigzag" else "contiguous",
                              self.c, self.rank)

    def report(self) -> dict:
        if self.c == 1:
            return {}
        out = {"impl": self.impl, "rank": self.rank}
        if self.impl != "ulysses":
            tiles = self.cores[0].tiles  # one layer's last forward: every layer computes the same
            out["tiles"] = tiles
            out["tiles_computed"] = sum(t["computed"] for t in tiles)
            out["tiles_skipped"] = sum(not t["computed"] for t in tiles)
            out["hops"] = self.cores[0].hops
        return {"context": out}


def apply_context_parallel(model, comm: Comm, impl: str = "ring", axis: str = "cp") -> ContextParallel:
    """Give the embedding this rank's positions and replace every attention core."""
    c = comm.size(axis)
    cores = []
    if c > 1:
        layout = "zigzag" if impl == "zigzag" else "contiguous"
        model.embed.positions = positions_of(layout, model.config.seq, c, comm.rank(axis))
        for block in model.blocks:
            core = (UlyssesAttentionCore(comm, axis) if impl == "ulysses"
                    else RingAttentionCore(comm, axis, layout))
            block.attn.core = core
            cores.append(core)
    return ContextParallel(comm, axis, impl, cores)
