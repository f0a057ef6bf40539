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
- dualpipev (DualPipeV, "cut-in-half" of DualPipe; Sea AI Lab, 2025): zbv's V layout with
  DualPipe's eight phases: in the steady state each rank pairs a forward of one chunk with a
  backward of its other chunk (F&B), which DeepSeek-V3 overlaps so that one's all-to-all hides
  behind the other's compute.
- dualpipe (DeepSeek-V3 technical report, 2024): bidirectional. The model has p stages and every
  rank holds two of them, i and p-1-i, so every stage lives on two ranks (parameters twice);
  half the micro-batches enter at rank 0 and run down, the other half enter at rank p-1 and run
  up through the second copies. Same eight phases as dualpipev, on p/2 "half ranks".
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import virtual_stages  # what --virtual-stages 0 means: configuration

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "dualpipe")  # synchronous; PipeDream: pipedream.py


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
    # 2 for DualPipe: chunks d*S .. d*S + S-1 are direction d's copies of the model's S stages, and
    # micro-batch i goes through direction i // (m/2)'s. 1: one path, chunk c is stage c.
    directions: int = 1

    @property
    def n_chunks(self) -> int:
        return self.pp * self.virtual

    @property
    def stages(self) -> int:
        """Chunks on one micro-batch's path: the model's stages (n_chunks, or half with DualPipe)."""
        return self.n_chunks // self.directions

    def stage_of(self, chunk: int) -> int:
        """Which slice of the model a chunk runs: its layers, embeddings on 0, loss on the last."""
        return chunk % self.stages

    def microbatches_through(self, chunk: int) -> range:
        per = self.microbatches // self.directions
        d = chunk // self.stages
        return range(d * per, (d + 1) * per)

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


def dual_phases(ranks: int, r: int, n: int) -> list[tuple[str, int]]:
    """DualPipe's eight phases for rank r of `ranks` (DualPipeV: the p ranks; DualPipe: the p/2
    half ranks, r = min(i, p-1-i)), n micro-batches per phase, as (kind, phase) pairs. Phase 0 is
    the chunk whose micro-batches this rank meets first. "Bz" is a backward whose weight gradient
    is queued (zero bubble) and run by a later "W" (oldest first); a plain "B" is the full backward,
    its W right behind it. Rank r's first forward on phase 1 waits for the micro-batch to come
    back, so rank r warms up with 2(ranks-1-r) forwards of phase 0 first."""
    out: list[tuple[str, int]] = []
    late = ranks - 1 - r  # ranks behind this one
    out += [("F", 0)] * (2 * late)  # 1: fill the pipe
    out += [("F", 0), ("F", 1)] * (r + 1)  # 2: the first micro-batches turn
    out += [("Bz", 1), ("W", None), ("F", 1)] * late  # 3: first backwards, W's fill the gaps
    out += [("F", 0), ("B", 1), ("F", 1), ("B", 0)] * (n - 2 * ranks + r + 1)  # 4: F&B pairs
    out += [("B", 1), ("F", 1), ("B", 0)] * late  # 5: forwards run out
    mid = (r + 1) // 2
    for i in range(r + 1):  # 6: the backwards drain; from the middle on they queue their W's
        out += [("Bz" if i > mid or (i == mid and r % 2) else "B", 1), ("Bz" if i >= mid else "B", 0)]
    out += [("W", None), ("Bz", 0)] * late  # 7
    out += [("W", None)] * (r + 1)  # 8: the queued W's close the step
    return out


def _ops_from_phases(phases, chunk_of: dict[int, int], micro_of: dict[int, int]) -> list[Op]:
    """(kind, phase) -> Ops: the k-th forward (backward) of a phase is its k-th micro-batch
    (micro_of[phase] + k); W's come from a queue of the weight gradients Bz left behind."""
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    queue: list[Op] = []
    ops: list[Op] = []
    for kind, phase in phases:
        if kind == "W":
            ops.append(queue.pop(0))
            continue
        k = "F" if kind == "F" else "B"
        i = micro_of[phase] + count[(k, phase)]
        count[(k, phase)] += 1
        ops.append(Op(k, i, chunk_of[phase]))
        if kind == "B":
            ops.append(Op("W", i, chunk_of[phase]))
        elif kind == "Bz":
            queue.append(Op("W", i, chunk_of[phase]))
    assert not queue, "every queued weight gradient is run by a W"
    return ops


def dualpipe_v(pp: int, m: int) -> list[list[Op]]:
    """DualPipeV: zbv's V (rank r: chunk r on the way down, phase 0; chunk 2p-1-r on the way up,
    phase 1), DualPipe's phases with all p ranks. Needs m >= 2p."""
    return [_ops_from_phases(dual_phases(pp, r, m), {0: r, 1: 2 * pp - 1 - r}, {0: 0, 1: 0})
            for r in range(pp)]


def dualpipe(pp: int, m: int) -> list[list[Op]]:
    """DualPipe: stage s of the downward copy (chunk s) on rank s, stage s of the upward copy
    (chunk p + s) on rank p-1-s. Micro-batches 0 .. m/2-1 go down, m/2 .. m-1 up. Rank i plays
    half rank min(i, p-1-i) of dualpipe_v's phases on m/2 micro-batches; its phase 0 is the
    direction that enters nearest to it (down on the first half of the ranks, up on the second).
    Needs p even, m even and m/2 >= p."""
    half = m // 2
    out = []
    for i in range(pp):
        down, up = i, pp + (pp - 1 - i)  # the chunks rank i holds: stage i down, stage p-1-i up
        first, second = ((down, 0), (up, half)) if i < pp // 2 else ((up, half), (down, 0))
        out.append(_ops_from_phases(dual_phases(pp // 2, min(i, pp - 1 - i), half),
                                    {0: first[0], 1: second[0]}, {0: first[1], 1: second[1]}))
    return out


def overlapped_pairs(s: Schedule) -> dict[tuple[int, int], int]:
    """DualPipe's F&B pairs: {(rank, index of the F): ops in the unit}. A forward followed by a
    backward of the rank's other chunk (and that backward's W when it is a full one, right behind):
    two micro-batches in different phases, whose compute and communication DeepSeek-V3 overlaps
    (one's all-to-all runs while the other computes). Empty for the other schedules."""
    if s.name not in ("dualpipe", "dualpipev"):
        return {}
    out = {}
    for r, ops in enumerate(s.ops):
        i = 0
        while i + 1 < len(ops):
            f, b = ops[i], ops[i + 1]
            if f.kind == "F" and b.kind == "B" and b.chunk != f.chunk:
                w = i + 2 < len(ops) and ops[i + 2] == Op("W", b.microbatch, b.chunk)
                out[(r, i)] = 3 if w else 2
                i += out[(r, i)]
            else:
                i += 1
    return out


def v_shape_owner(pp: int) -> list[int]:
    return [c if c < pp else 2 * pp - 1 - c for c in range(2 * pp)]


def dual_owner(pp: int) -> list[int]:
    """DualPipe: chunk s (stage s, downward copy) on rank s, chunk p+s (its upward copy) on p-1-s."""
    return list(range(pp)) + [pp - 1 - s for s in range(pp)]


def chunk_owner(name: str, pp: int, v: int) -> list[int]:
    """Which rank holds each chunk: round-robin (chunk c on rank c % p), a V for zbv and dualpipev,
    both directions' copies for dualpipe."""
    if name in ("zbv", "dualpipev"):
        return v_shape_owner(pp)
    if name == "dualpipe":
        return dual_owner(pp)
    return [c % pp for c in range(pp * v)]


def directions(name: str) -> int:
    """2 for DualPipe (micro-batches enter from both ends), else 1."""
    return 2 if name == "dualpipe" else 1


# The first stage also holds the embeddings and the last the final LayerNorm, LM head and loss.
# On the toy GPT they weigh about a fifth of a block (measured per op, sends excluded, one block
# per chunk: the last stage's F +18%, the first stage's B +12%). The bubble formulas assume equal
# stages, and GPipe pays the slowest stage once per micro-batch in each phase: one block per chunk
# adds ~4 points to its bubble at p = 4, m = 8. Four blocks per chunk: F +8%, B +3%, ~1.5 points.
BLOCKS_PER_CHUNK = 4
# A pipeline run that does not choose its steps runs this many: steps 1-4 are timed (step 0 warms
# caches up and the last step runs under the memory meter, every op slower), 32 samples of every
# op kind on every stage at 8 micro-batches (course/trace.py measures the bubble from them).
PIPELINE_STEPS = 6


def pipeline_layers(pp: int, chunks_per_rank: int = 1) -> int:
    """Layers for a pipeline run that does not choose: BLOCKS_PER_CHUNK blocks in every chunk."""
    return pp * chunks_per_rank * BLOCKS_PER_CHUNK


def build_schedule(name: str, pp: int, m: int, v: int = 0) -> Schedule:
    v = virtual_stages(name, v)
    if name == "interleaved":
        ops = interleaved(pp, m, v)
    elif name in ("zbv", "dualpipev", "dualpipe"):
        if v != 2:
            raise ValueError(f"{name} places exactly 2 chunks per rank; leave --virtual-stages at 0 or 2")
        if name != "zbv" and (m < 2 * pp or (name == "dualpipe" and (pp % 2 or m % 2))):
            raise ValueError(f"{name} needs at least 2 x pp micro-batches"
                             + (", an even pp and an even m" if name == "dualpipe" else ""))
        ops = {"zbv": zero_bubble_v, "dualpipev": dualpipe_v, "dualpipe": dualpipe}[name](pp, m)
    elif v != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank; virtual stages are for "
                         f"'interleaved'")
    else:  # PipeDream runs 1F1B's order, updating after every backward (parallel/pipedream.py)
        ops = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble_h1,
               "pipedream": one_f_one_b, "pipedream-nostash": one_f_one_b}[name](pp, m)
    schedule = Schedule(name, pp, m, v, chunk_owner(name, pp, v), ops, directions(name))
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
def dependencies(op: Op, stages: int) -> list[Op]:
    """`stages`: chunks on a micro-batch's path (Schedule.stages; n_chunks but for DualPipe)."""
    m, c = op.microbatch, op.chunk
    if op.kind == "F":
        return [Op("F", m, c - 1)] if c % stages > 0 else []
    if op.kind == "B":
        return [Op("F", m, c)] + ([Op("B", m, c + 1)] if c % stages < stages - 1 else [])
    return [Op("B", m, c)]


def check(s: Schedule) -> None:
    """Every rank runs each of its ops exactly once, and the order can complete (no deadlock)."""
    kinds = "FBW" if s.split_backward else "FB"
    for r, ops in enumerate(s.ops):
        want = sorted((k, i, c) for c in s.chunks_of(r) for i in s.microbatches_through(c)
                      for k in kinds)
        have = sorted((op.kind, op.microbatch, op.chunk) for op in ops)
        if have != want:
            missing = sorted(set(want) - set(have))[:3]
            extra = [x for x in have if have.count(x) > 1 or x not in want][:3]
            raise ValueError(f"rank {r}: the schedule must run each of F, B{', W' if 'W' in kinds else ''} "
                             f"once per micro-batch and chunk it holds; missing {missing}, "
                             f"extra or repeated {extra}")
    simulate(s, lambda rank, op: 1.0)


def simulate(s: Schedule, duration, fused: bool = False) -> list[dict]:
    """Every rank a device of its own: each op starts when its rank is free and its inputs exist
    (transfers taken as instantaneous). `duration(rank, op)` gives seconds. Returns one record per
    op: {rank, kind, microbatch, chunk, start, end}. Raises ValueError on a deadlock.
    `fused`: DualPipe's F&B pairs (overlapped_pairs) run as one unit, started when the inputs of
    both are there, its ops back to back, their results out when the unit ends: as the
    DeepSeek-V3 report draws and counts them (its bubble formula is this replay's, equal costs)."""
    pairs = overlapped_pairs(s) if fused else {}
    end: dict[Op, float] = {}
    clock = [0.0] * s.pp
    position = [0] * s.pp
    timed = []
    remaining = sum(len(ops) for ops in s.ops)
    while remaining:
        progressed = False
        for r, ops in enumerate(s.ops):
            while position[r] < len(ops):
                unit = ops[position[r]:position[r] + pairs.get((r, position[r]), 1)]
                deps = [d for op in unit for d in dependencies(op, s.stages) if d not in unit]
                if any(d not in end for d in deps):
                    break
                start = max([clock[r]] + [end[d] for d in deps])
                for op in unit:
                    clock[r] = start + duration(r, op)
                    timed.append({"rank": r, "kind": op.kind, "microbatch": op.microbatch,
                                  "chunk": op.chunk, "start": start, "end": clock[r]})
                    start = clock[r]
                for op in unit:  # a pair's results leave together, when the unit ends
                    end[op] = clock[r]
                position[r] += len(unit)
                remaining -= len(unit)
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
