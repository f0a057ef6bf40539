"""Pipeline schedules as data: for every rank, the ops it runs, in order.

A schedule is a plain list per rank of ops `F` (forward), `B` (backward) and `W` (weight gradients)
on (micro-batch, chunk). One runner executes any schedule (parallel/pipeline.py), so a schedule can
be printed, drawn and simulated before it is run. The model is cut into `pp * v` chunks in model
order; `owner[chunk]` is the rank that holds it.

Dependencies are the same for every schedule and follow from the model alone:
  F(m, c) needs F(m, c-1)          (the activation from the previous chunk)
  B(m, c) needs F(m, c), B(m, c+1) (its own forward, the gradient from the next chunk)
  W(m, c) needs B(m, c)            (the output gradient B left behind)
A schedule only chooses the order of each rank's ops; `simulate` replays that order with given op
durations, every rank a device of its own, and finds when each op can start.

The schedules, in the order the lesson meets them:
- naive: one micro-batch in the pipe at a time; every rank idles (p-1)/p of the time.
- gpipe (Huang et al., 2019): all forwards, then all backwards. Bubble (p-1)/(m+p-1), but every
  stage holds the activations of all m micro-batches at once.
- 1f1b (PipeDream-Flush, Narayanan et al., 2021): p-1-r warm-up forwards on rank r, then one
  forward, one backward: same bubble, at most p-r micro-batches in flight on rank r.
- interleaved (Narayanan et al., 2021): v chunks per rank (rank r holds chunks r, r+p, ...), each
  1/v as long: bubble (p-1)/(v*m + p-1), for more point-to-point traffic.
- zb, ZB-H1 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"): the backward is split into B
  (gradient for the input, on the critical path) and W (gradient for the weights, which nothing
  downstream waits for). Postponed W's fill the cool-down bubbles: the bubble drops to
  (p-1)(F+B-W) of time with 1F1B's memory.
- zbv: the model cut into 2p chunks laid out in a V over the ranks, B/W split, ops ordered by a
  greedy scheduler; the bubble shrinks further at the same memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import virtual_stages  # what --virtual-stages 0 means: configuration

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb", "zbv")  # synchronous; PipeDream: pipedream.py


@dataclass(frozen=True)
class Op:
    kind: str  # "F" forward, "B" backward (input grads only when the schedule has W ops), "W"
    microbatch: int
    chunk: int  # 0 .. pp*v - 1, in model order

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual: int  # chunks per rank (v)
    owner: list[int]  # chunk -> rank
    ops: list[list[Op]]  # rank -> its ops, in order

    @property
    def n_chunks(self) -> int:
        return self.pp * self.virtual

    @property
    def split_backward(self) -> bool:
        return any(op.kind == "W" for ops in self.ops for op in ops)

    def chunks_of(self, rank: int) -> list[int]:
        return [c for c in range(self.n_chunks) if self.owner[c] == rank]


# ---------------------------------------------------------------------------------------------
# the schedules
# ---------------------------------------------------------------------------------------------
def naive(pp: int, m: int) -> list[list[Op]]:
    """Each rank: F0 B0 F1 B1 ... The next micro-batch enters only when the last one is done."""
    return [[Op(k, i, r) for i in range(m) for k in "FB"] for r in range(pp)]


def gpipe(pp: int, m: int) -> list[list[Op]]:
    """Each rank: all m forwards, then all m backwards (the flush)."""
    return [[Op("F", i, r) for i in range(m)] + [Op("B", i, r) for i in range(m)]
            for r in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[list[Op]]:
    """Rank r: warm-up with p-1-r forwards, then alternate one forward and one backward (steady
    state), then the remaining backwards (cool-down)."""
    out = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        ops = [Op("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [Op("F", warmup + i, r), Op("B", i, r)]
        ops += [Op("B", i, r) for i in range(m - warmup, m)]
        out.append(ops)
    return out


def interleaved(pp: int, m: int, v: int) -> list[list[Op]]:
    """Megatron's interleaved 1F1B. Rank r holds chunks r, r+p, ..., r+(v-1)p. Micro-batches go
    through a rank's chunks in groups of p: forward k runs local chunk (k // p) % v on micro-batch
    (k // (p v)) p + k % p; backwards walk the local chunks in reverse. Warm-up grows to
    2(p-1-r) + (v-1)p forwards so that the first backward finds its gradient ready. Needs m % p == 0."""
    def micro(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    out = []
    for r in range(pp):
        def forward(k: int) -> Op:
            return Op("F", micro(k), ((k // pp) % v) * pp + r)

        def backward(k: int) -> Op:
            return Op("B", micro(k), (v - 1 - (k // pp) % v) * pp + r)

        total = m * v
        warmup = min(2 * (pp - 1 - r) + (v - 1) * pp, total)
        ops = [forward(k) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [forward(warmup + i), backward(i)]
        ops += [backward(k) for k in range(total - warmup, total)]
        out.append(ops)
    return out


def zero_bubble_h1(pp: int, m: int) -> list[list[Op]]:
    """ZB-H1: 1F1B's order of F and B, with W(i) queued behind B(i). Rank r runs its first W only
    once r micro-batches' W's have piled up, so the last ranks keep W's in hand for the cool-down,
    where 1F1B waits; at most p micro-batches are ever in flight (1F1B's peak)."""
    out = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        ops = [Op("F", i, r) for i in range(warmup)]
        queued: list[int] = []
        for i in range(m - warmup):
            ops += [Op("F", warmup + i, r), Op("B", i, r)]
            queued.append(i)
            if i >= r:
                ops.append(Op("W", queued.pop(0), r))
        for i in range(m - warmup, m):
            queued.append(i)
            ops += [Op("B", i, r), Op("W", queued.pop(0), r)]
        ops += [Op("W", i, r) for i in queued]
        out.append(ops)
    return out


def zero_bubble_v(pp: int, m: int) -> list[list[Op]]:
    """A V-shaped zero-bubble schedule (after ZB-V, Qi et al., 2024): 2p chunks placed in a V
    (rank r holds chunk r on the way down and chunk 2p-1-r on the way back up, so rank 0 holds
    both ends and the turn costs no transfer). Each rank's order comes from a greedy list scheduler
    run with equal op costs: when a rank is free it runs a ready B (the critical path) first, else a
    ready F while it holds fewer than 2p chunk activations (1F1B's memory: p micro-batches of
    half-size chunks), else a W (nothing waits for it: it fills what would be idle)."""
    owner = v_shape_owner(pp)
    n = len(owner)
    pending = [{Op(k, i, c) for c in range(n) if owner[c] == r for i in range(m) for k in "FBW"}
               for r in range(pp)]
    done: dict[Op, float] = {}
    free, held = [0.0] * pp, [0] * pp
    out: list[list[Op]] = [[] for _ in range(pp)]

    def priority(op: Op, r: int):
        rank = {"B": 0, "F": 1 if held[r] < 2 * pp else 3, "W": 2}[op.kind]
        return rank, op.microbatch, -op.chunk if op.kind != "W" else op.chunk

    while any(pending):
        choices = []
        for r in range(pp):
            ready = [(max([free[r]] + [done[d] for d in dependencies(op, n)]), op)
                     for op in pending[r] if all(d in done for d in dependencies(op, n))]
            if ready:
                t = min(t for t, _ in ready)
                op = min((op for tt, op in ready if tt <= t), key=lambda o: priority(o, r))
                choices.append((t, r, op))
        t, r, op = min(choices, key=lambda x: (x[0], x[1]))
        done[op] = free[r] = t + 1.0
        out[r].append(op)
        pending[r].discard(op)
        held[r] += (op.kind == "F") - (op.kind == "W")
    return out


def v_shape_owner(pp: int) -> list[int]:
    return [c if c < pp else 2 * pp - 1 - c for c in range(2 * pp)]


def chunk_owner(name: str, pp: int, v: int) -> list[int]:
    """Which rank holds each chunk: round-robin (chunk c on rank c % p), or a V for zbv."""
    if name == "zbv":
        return v_shape_owner(pp)
    return [c % pp for c in range(pp * v)]


# The first stage also holds the embeddings and the last the final LayerNorm, LM head and loss.
# On the toy GPT they weigh about a fifth of a block (measured per op, sends excluded, one block
# per chunk: the last stage's F +18%, the first stage's B +12%). The bubble formulas assume equal
# stages, and GPipe pays the slowest stage once per micro-batch in each phase: one block per chunk
# adds ~4 points to its bubble at p = 4, m = 8. Four blocks per chunk: F +8%, B +3%, ~1.5 points.
BLOCKS_PER_CHUNK = 4


def pipeline_layers(pp: int, chunks_per_rank: int = 1) -> int:
    """Layers for a pipeline run that does not choose: BLOCKS_PER_CHUNK blocks in every chunk."""
    return pp * chunks_per_rank * BLOCKS_PER_CHUNK


def build_schedule(name: str, pp: int, m: int, v: int = 0) -> Schedule:
    v = virtual_stages(name, v)
    if name == "interleaved":
        ops = interleaved(pp, m, v)
    elif name == "zbv":
        if v != 2:
            raise ValueError("zbv places exactly 2 chunks per rank (a V); leave --virtual-stages at 0 or 2")
        ops = zero_bubble_v(pp, m)
    elif v != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank; virtual stages are for "
                         f"'interleaved'")
    else:  # PipeDream runs 1F1B's order, updating after every backward (parallel/pipedream.py)
        ops = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble_h1,
               "pipedream": one_f_one_b, "pipedream-nostash": one_f_one_b}[name](pp, m)
    schedule = Schedule(name, pp, m, v, chunk_owner(name, pp, v), ops)
    check(schedule)
    return schedule


def for_config(cfg) -> Schedule:
    """The schedule a RunConfig (or its dict) asks for: by name, or written out op by op in
    cfg.extra["ops"] (one list per rank of [kind, micro-batch] pairs, one chunk per rank), which is
    how an exercise runs a learner's own order on real ranks."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))
    ops = (get("extra") or {}).get("ops")
    if ops:
        return from_ops([[Op(k, int(i), r) for k, i in rank_ops] for r, rank_ops in enumerate(ops)],
                        get("microbatches"), get("schedule"))
    return build_schedule(get("schedule"), get("pp"), get("microbatches"), get("virtual_stages"))


def from_ops(ops: list[list[Op]], m: int, name: str = "custom") -> Schedule:
    """A schedule written by hand (one chunk per rank): checked like the built-in ones."""
    schedule = Schedule(name, len(ops), m, 1, list(range(len(ops))), ops)
    check(schedule)
    return schedule


# ---------------------------------------------------------------------------------------------
# checking and simulating
# ---------------------------------------------------------------------------------------------
def dependencies(op: Op, n_chunks: int) -> list[Op]:
    m, c = op.microbatch, op.chunk
    if op.kind == "F":
        return [Op("F", m, c - 1)] if c > 0 else []
    if op.kind == "B":
        return [Op("F", m, c)] + ([Op("B", m, c + 1)] if c < n_chunks - 1 else [])
    return [Op("B", m, c)]


def check(s: Schedule) -> None:
    """Every rank runs each of its ops exactly once, and the order can complete (no deadlock)."""
    kinds = "FBW" if s.split_backward else "FB"
    for r, ops in enumerate(s.ops):
        want = sorted((k, i, c) for c in s.chunks_of(r) for i in range(s.microbatches) for k in kinds)
        have = sorted((op.kind, op.microbatch, op.chunk) for op in ops)
        if have != want:
            missing = sorted(set(want) - set(have))[:3]
            extra = [x for x in have if have.count(x) > 1 or x not in want][:3]
            raise ValueError(f"rank {r}: the schedule must run each of F, B{', W' if 'W' in kinds else ''} "
                             f"once per micro-batch and chunk it holds; missing {missing}, "
                             f"extra or repeated {extra}")
    simulate(s, lambda rank, op: 1.0)


def simulate(s: Schedule, duration) -> list[dict]:
    """Every rank a device of its own: each op starts when its rank is free and its inputs exist
    (transfers taken as instantaneous). `duration(rank, op)` gives seconds. Returns one record per
    op: {rank, kind, microbatch, chunk, start, end}. Raises ValueError on a deadlock."""
    end: dict[Op, float] = {}
    clock = [0.0] * s.pp
    position = [0] * s.pp
    timed = []
    remaining = sum(len(ops) for ops in s.ops)
    while remaining:
        progressed = False
        for r, ops in enumerate(s.ops):
            while position[r] < len(ops):
                op = ops[position[r]]
                deps = dependencies(op, s.n_chunks)
                if any(d not in end for d in deps):
                    break
                start = max([clock[r]] + [end[d] for d in deps])
                end[op] = clock[r] = start + duration(r, op)
                timed.append({"rank": r, "kind": op.kind, "microbatch": op.microbatch,
                              "chunk": op.chunk, "start": start, "end": end[op]})
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(ops[position[r]]) for r, ops in enumerate(s.ops) if position[r] < len(ops)}
            raise ValueError(f"the schedule deadlocks: each rank waits on another ({stuck} wait for "
                             f"inputs that are never produced first)")
    return timed


def idle_fractions(timed: list[dict], pp: int) -> list[float]:
    """Per rank: the share of the pipeline's span (first op start to last op end, the same for all
    ranks: a flush waits for the slowest) in which the rank computed nothing."""
    t0 = min(t["start"] for t in timed)
    span = max(t["end"] for t in timed) - t0
    busy = [0.0] * pp
    for t in timed:
        busy[t["rank"]] += t["end"] - t["start"]
    return [1 - b / span if span > 0 else 0.0 for b in busy]


def in_flight(s: Schedule) -> list[int]:
    """Most micro-batches (x chunks) whose activations a rank holds at once: from a forward until
    the op that frees them (W when the backward is split, else B)."""
    free = "W" if s.split_backward else "B"
    peaks = []
    for ops in s.ops:
        held = peak = 0
        for op in ops:
            held += op.kind == "F"
            peak = max(peak, held)
            held -= op.kind == free
        peaks.append(peak)
    return peaks


def format_schedule(s: Schedule) -> str:
    """The schedule as text, one line per rank: `rank 0 | F0 F1 B0 ...` (chunk after a dot when v > 1)."""
    lines = []
    for r, ops in enumerate(s.ops):
        cells = [f"{op}.{op.chunk}" if s.virtual > 1 else str(op) for op in ops]
        lines.append(f"rank {r} | " + " ".join(cells))
    return "\n".join(lines)
