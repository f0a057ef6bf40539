"""RunConfig: every knob of a run, validated before any process starts.

A bad value raises ConfigError (a ValueError) whose one-line message names the field and the fix.
The CLI prints that line and exits 2; the app shows it; nothing is launched.

`RunConfig.validate` computes from the values alone and returns: it writes nothing, reads no file
and imports nothing of this package (this module is at the bottom of the house, torch-free, so
that a bad flag is refused before torch is imported). What the machine and the disk allow (the
memory estimate, a checkpoint to resume, files to write) is runtime/preflight.py's, asked by whoever
launches the ranks (the CLI, runtime/launch.run). The model's shape is GPTConfig, which RunConfig extends.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    pass


MAX_LOCAL_RANKS = 16  # beyond this a laptop only thrashes; torchrun has no such limit
BIGGEST = 2 ** 31 - 1  # no whole-number flag goes beyond (torch's int32 sizes; 400 digits refused)


def under_torchrun() -> bool:
    """torchrun's environment (the launcher decides the world, not this machine's local cap)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def virtual_stages(schedule: str, v: int = 0) -> int:
    """Model chunks per pipeline rank: v if given, else 2 for interleaved, zbv and the DualPipes
    (dualpipe: two stages, each a copy), 1 otherwise."""
    if v:
        return v
    return 2 if schedule in ("interleaved", "zbv", "dualpipev", "dualpipe") else 1


CHOICES = {
    "dp_mode": ("naive", "bucketed"),
    "optimizer": ("adam", "sgd"),
    "precision": ("fp32", "bf16-mixed"),
    "schedule": ("naive", "gpipe", "1f1b", "interleaved", "zb", "zbv", "pipedream", "pipedream-nostash",
                 "dualpipev", "dualpipe"),
    "checkpointing": ("none", "full", "selective"),
    "cp_impl": ("ring", "zigzag", "ulysses"),
    "backend": ("auto", "gloo", "nccl"),
}
# FSDP's sharding strategies are ZeRO stages under other names (HYBRID_SHARD: ZeRO-3 inside
# groups of --dp-shard ranks, replicated across groups).
FSDP_STRATEGIES = {"NO_SHARD": 0, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3, "HYBRID_SHARD": 3}
# Finite, yet absurd: refused with the reason rather than trained to NaN. (flag: (most, why))
AT_MOST = {
    "lr": (10.0, "Adam moves each weight by about lr a step: the toy trains at 3e-3, and beyond 10 "
                 "every run diverges to NaN"),
    "aux_loss_weight": (100.0, "beyond it the balancing loss drowns the language-model loss it "
                               "steers; typical is 0.01"),
    "z_loss_weight": (100.0, "beyond it the router's z-loss drowns the language-model loss; "
                             "typical is 0.001"),
    "timeout_s": (7 * 24 * 3600.0, "a week"),
    "bucket_mb": (2.0 ** 20, "a terabyte: one bucket already holds the whole toy model"),
    "capacity_factor": (2.0 ** 20, "at E/k every token fits already"),
}


# What ranks that train apart (local SGD, federated averaging) cannot do: (the flag as given, when, why). {name}: the mode.
WITHOUT_BARRIER_REFUSED = [
    (lambda c: f"--tp {c.tp}", lambda c: c.tp > 1, "tensor-parallel ranks hold slices of one layer "
     "and meet in every forward, so they cannot train apart ({name} composes with --dp only)"),
    (lambda c: f"--pp {c.pp}", lambda c: c.pp > 1, "pipeline stages pass activations every "
     "micro-batch, so they cannot train apart ({name} composes with --dp only)"),
    (lambda c: f"--cp {c.cp}", lambda c: c.cp > 1, "context-parallel ranks hold parts of the same "
     "sequences and exchange K/V every layer ({name} composes with --dp only)"),
    (lambda c: f"--ep {c.ep}", lambda c: c.ep > 1, "expert parallel sends tokens to other ranks' "
     "experts every layer ({name} composes with --dp only)"),
    (lambda c: f"--zero {c.zero}", lambda c: c.zero > 0, "ZeRO leaves each rank 1/N of the "
     "optimizer states, so a rank cannot step alone ({name} composes with --dp only)"),
    (lambda c: f"--dp-mode {c.dp_mode}", lambda c: c.dp_mode != "bucketed",
     "a dp mode says how gradients are averaged, and {name} averages parameters; drop --dp-mode"),
    (lambda c: f"--precision {c.precision}", lambda c: c.precision != "fp32",
     "averaging bf16 replicas and their fp32 masters is not available yet; use fp32"),
    (lambda c: "--offload-disk", lambda c: bool(c.offload_disk), "the optimizer on disk is "
     "plain data parallel's and ZeRO's; {name} steps one in RAM: not available yet"),
    (lambda c: "--save" if c.save else "--resume", lambda c: bool(c.save or c.resume),
     "a checkpoint holds one model and between averages each rank has its own; not available yet"),
]


@dataclass
class GPTConfig:
    """The model's shape (model.py builds the GPT from it; RunConfig extends it)."""
    vocab: int = 128
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 4
    # mixture of experts (moe.py): 0 = a dense MLP in every block; --ep shards them (parallel/expert.py)
    experts: int = 0
    top_k: int = 1
    capacity_factor: float = 1.0
    moe_every: int = 1  # the MLP of every moe_every-th block (blocks moe_every-1, 2*moe_every-1...)
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001

    @classmethod
    def from_run(cls, cfg) -> "GPTConfig":
        """The model's part of a RunConfig (or of anything with its shape's fields)."""
        return GPTConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig)
                            if hasattr(cfg, f.name)})

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and (layer + 1) % self.moe_every == 0


@dataclass
class RunConfig(GPTConfig):
    """A run: the model (GPTConfig's fields: vocab, seq, d_model, heads, layers, experts, top_k,
    capacity_factor, moe_every, aux_loss_weight, z_loss_weight), its layout and its training."""
    # layout: the rank grid
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # data parallel
    dp_mode: str = "bucketed"
    bucket_mb: float = 0.25
    grad_accum: int = 1
    zero: int = 0
    dp_shard: int = 0  # ZeRO shard group size; 0 = all of dp. 0 < s < dp: HYBRID_SHARD
    fsdp: str = ""  # PyTorch FSDP's names for the same strategies (see FSDP_STRATEGIES)
    offload: bool = False  # ZeRO-Offload: optimizer states and master weights in host memory
    offload_disk: str = ""  # ZeRO-Infinity: a directory; each rank's optimizer states in a file there
    keep_offload: bool = False  # leave --offload-disk's files behind after the run (else removed)
    fp32_grad_accum: bool = False  # bf16-mixed: fp32 gradient buffers too (the 20-byte variant)
    no_prefetch: bool = False  # ZeRO-3: one unit gathered at a time (no next unit's all-gather early)
    sp: bool = False  # Megatron sequence parallel on top of tensor parallel
    cp_impl: str = "ring"  # context parallel: ring, zigzag (balanced ring) or ulysses (all-to-all)
    # without a barrier: local SGD (parallel/local_sgd.py), federated averaging (parallel/federated.py)
    sync_every: int = 0  # local SGD: each dp rank steps alone, parameters averaged every H steps; 0 = off
    sync_optimizer: bool = False  # local SGD: average the optimizer's states too
    federated: bool = False  # federated averaging: clients on the dp ranks; a step is a round
    clients: int = 4  # K clients, each with its own data (data.client_shard)
    clients_per_round: int = 0  # C clients the server samples each round; 0 = all K
    local_steps: int = 1  # E optimizer steps each sampled client takes per round
    rounds: int = 0  # R rounds (it sets --steps); 0 = --steps
    non_iid: float = 0.0  # A: 0 = every client the same topic mixture; larger, mostly its own
    # asynchronous SGD (parallel/async_ps.py): rank 0 a parameter server, ranks 1..dp-1 workers
    asynchronous: bool = False  # the flag --async (a Python keyword: the field has its long name)
    max_staleness: int = -1  # SSP's bound: a worker runs at most K steps ahead of the slowest; -1 none
    straggler: str = ""  # "RANK:FACTOR": that rank computes FACTOR times slower (a real sleep)
    # pipeline
    schedule: str = "1f1b"
    microbatches: int = 4  # per step and data-parallel rank, with --pp > 1
    virtual_stages: int = 0  # model chunks per pipeline rank; 0 = 2 for interleaved, else 1
    # training
    batch: int = 8
    steps: int = 3
    lr: float = 3e-3
    optimizer: str = "adam"
    precision: str = "fp32"
    checkpointing: str = "none"
    seed: int = 0
    # run
    reference: bool = False
    save: str = ""  # a directory: save a distributed checkpoint there after the last step
    resume: str = ""  # a --save directory (or its step_N): continue from it up to --steps
    save_every: int = 0  # with --save: a checkpoint every K steps too (0: after the last step only)
    keep: int = 3  # with --save: the newest N checkpoints kept in the directory, older ones pruned
    backend: str = "auto"
    timeout_s: float = 120.0
    extra: dict = field(default_factory=dict)  # free-form tags (e.g. which lesson asked)

    @property
    def world_size(self) -> int:
        """dp x tp x pp x cp: expert parallel is carved out of the dp x cp ranks (mesh.py)."""
        return self.dp * self.tp * self.pp * self.cp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown field(s) {unknown}: known fields are {sorted(names)}")
        return cls(**d).validate()

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes).validate()

    def __post_init__(self):
        # --rounds counts a federated run's steps: the config says it once, in `steps`
        if self.federated is True and type(self.rounds) is int and self.rounds > 0:
            self.steps = self.rounds
        # --fsdp names a ZeRO stage: the config says it once, in `zero` (validate checks both)
        if isinstance(self.fsdp, str) and self.fsdp in FSDP_STRATEGIES and self.zero == 0:
            self.zero = FSDP_STRATEGIES[self.fsdp]

    def validate(self) -> "RunConfig":
        """Returns self if every value and combination is one the library can run, else raises
        ConfigError (one line naming the flag and the fix). A pure function of the values (and
        of whether torchrun launched this process: the local cap on ranks)."""
        for name in ("dp", "tp", "pp", "cp", "ep", "layers", "d_model", "heads", "seq", "vocab",
                     "batch", "steps", "grad_accum", "microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{_flag(name)} {_show(v)}: must be a whole number >= 1")
        for name in ("experts", "top_k", "moe_every", "virtual_stages", "dp_shard", "zero", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"{_flag(name)} {_show(v)}: must be a whole number")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "seed" and isinstance(v, int) and not isinstance(v, bool) \
                    and abs(v) > BIGGEST:
                raise ConfigError(f"{_flag(f.name)} {_show(v)}: must be at most {BIGGEST:,} "
                                  f"(far beyond anything local ranks can hold)")
        if not 0 <= self.seed < 2 ** 32:
            raise ConfigError(f"--seed {self.seed}: must be between 0 and 2**32 - 1 (the data's "
                              f"generator is seeded with 1,000,003 x seed + step, a 64-bit number)")
        for name in ("bucket_mb", "lr", "timeout_s", "capacity_factor", "aux_loss_weight",
                     "z_loss_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{_flag(name)} {v!r}: must be a number")
            if not math.isfinite(v):
                raise ConfigError(f"{_flag(name)} {v!r}: must be a finite number (training with "
                                  f"it would run to NaN or never end)")
            most, why = AT_MOST[name]
            if v > most:
                raise ConfigError(f"{_flag(name)} {v:g}: must be at most {most:g} ({why})")
        for name in ("save", "resume", "fsdp", "offload_disk"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{_flag(name)} {getattr(self, name)!r}: must be a string")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{_flag(name)} {getattr(self, name)!r}: choose one of "
                                  f"{', '.join(allowed)}")
        if self.vocab < 2:
            raise ConfigError(f"--vocab {self.vocab}: must be at least 2 (with one token there is "
                              f"nothing to predict: the loss is 0 from the start)")
        if self.fsdp:
            if self.fsdp not in FSDP_STRATEGIES:
                raise ConfigError(f"--fsdp {self.fsdp!r}: choose one of {', '.join(FSDP_STRATEGIES)}")
            stage = FSDP_STRATEGIES[self.fsdp]
            if self.zero != stage:
                raise ConfigError(f"--fsdp {self.fsdp} is ZeRO-{stage}; it contradicts --zero "
                                  f"{self.zero}: give one of them")
            if (self.fsdp == "HYBRID_SHARD") != (0 < self.dp_shard < self.dp):
                raise ConfigError(f"--fsdp {self.fsdp}: HYBRID_SHARD (and only it) needs "
                                  f"--dp-shard S with S < --dp {self.dp} dividing it")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero {self.zero!r}: choose 0 (plain data parallel), 1, 2 or 3")
        if self.dp_shard < 0 or (self.dp_shard and self.dp % self.dp_shard):
            raise ConfigError(f"--dp-shard {self.dp_shard}: must divide --dp {self.dp} (shard "
                              f"groups of equal size), or be 0 to shard over all of dp")
        if 0 < self.dp_shard < self.dp and not self.zero:
            raise ConfigError(f"--dp-shard {self.dp_shard}: hybrid sharding needs --zero 1, 2 or 3 "
                              f"(with --zero 0 nothing is sharded)")
        if self.fp32_grad_accum and (self.precision != "bf16-mixed" or self.zero
                                     or self.dp_mode != "bucketed"):
            raise ConfigError("--fp32-grad-accum adds fp32 gradient buffers to bf16-mixed training "
                              "with plain data parallel: it needs --precision bf16-mixed, --zero 0 "
                              "and --dp-mode bucketed")
        if self.no_prefetch and self.zero != 3:
            raise ConfigError(f"--no-prefetch: only ZeRO-3 gathers parameters (prefetching the "
                              f"next unit's all-gather); it needs --zero 3 (got --zero {self.zero})")
        if self.offload and self.zero not in (1, 2):
            raise ConfigError(f"--offload: ZeRO-Offload steps the sharded optimizer on the host; "
                              f"it needs --zero 1 or 2 (got --zero {self.zero})")
        if self.offload_disk or self.keep_offload:
            self._validate_offload_disk()
        if self.zero and self.dp_mode == "naive":
            raise ConfigError("--dp-mode naive applies to --zero 0 only: ZeRO reduce-scatters its "
                              "gradients itself; drop --dp-mode or use --zero 0")
        self._validate_experts()
        self._validate_without_barrier()
        self._validate_async()
        if self.world_size > MAX_LOCAL_RANKS and not under_torchrun():  # torchrun: no local cap
            raise ConfigError(f"world size {self.world_size} (dp*tp*pp*cp): local runs take at "
                              f"most {MAX_LOCAL_RANKS} ranks on one machine; lower the degrees "
                              f"or launch with torchrun")
        if self.batch % (self.dp * self.grad_accum) and not self.federated:  # (B: per client)
            k = self.dp * self.grad_accum
            raise ConfigError(f"--batch {self.batch}: must be divisible by dp x grad-accum = {k} "
                              f"so every rank gets equal micro-batches; try --batch {k * max(1, self.batch // k)}")
        if self.pp > 1:
            self._validate_pipeline()
        if self.sp and self.tp == 1:
            raise ConfigError("--sp: sequence parallelism splits the sequence over the tensor-"
                              "parallel ranks; it needs --tp 2 or more")
        if self.sp and self.seq % self.tp:
            raise ConfigError(f"--seq {self.seq}: with --sp the sequence is split over --tp "
                              f"{self.tp} ranks; choose a multiple of {self.tp}")
        if self.tp > 1:
            for name, value in (("heads", self.heads), ("vocab", self.vocab)):
                if value % self.tp:
                    raise ConfigError(f"--{name} {value}: tensor parallel splits the {name} over "
                                      f"--tp {self.tp} ranks; choose a multiple of {self.tp}")
        if self.cp > 1:
            self._validate_context()
        if self.d_model % self.heads:
            raise ConfigError(f"--d-model {self.d_model}: must be divisible by --heads "
                              f"{self.heads} (each head gets d_model/heads dims)")
        if not self.bucket_mb > 0:
            raise ConfigError(f"--bucket-mb {self.bucket_mb!r}: must be > 0 (megabytes)")
        if not self.lr > 0:
            raise ConfigError(f"--lr {self.lr!r}: must be > 0")
        if not self.timeout_s >= 1:
            raise ConfigError(f"--timeout-s {self.timeout_s!r}: must be at least 1 second (the "
                              f"ranks alone take about a second to start)")
        self._validate_saves()
        if self.steps > 10_000 or self.layers * self.d_model ** 2 > 64 * 1024 ** 2:
            raise ConfigError("the model or run is far beyond toy scale for local ranks: keep "
                              "layers*d_model^2 <= 64M and --steps <= 10000 (theory covers big models)")
        return self

    def _validate_without_barrier(self) -> None:
        """Local SGD and federated averaging: the dp ranks train apart between averages, so only
        --dp composes with them."""
        for name, least in (("sync_every", 0), ("clients", 1), ("clients_per_round", 0),
                            ("local_steps", 1), ("rounds", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ConfigError(f"{_flag(name)} {_show(v)}: must be a whole number >= {least}"
                                  + (" (0: data parallel, gradients averaged every step)"
                                     if name == "sync_every" else ""))
        a = self.non_iid
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1000:
            raise ConfigError(f"--non-iid {a!r}: must be a number from 0 (every client the same "
                              f"mixture of topics) to 1000 (each client only its own topic)")
        if self.sync_optimizer and not self.sync_every:
            raise ConfigError("--sync-optimizer: only local SGD averages optimizer states; add "
                              "--sync-every H")
        if self.sync_every and self.federated:
            raise ConfigError("--sync-every with --federated: federated averaging sets its own "
                              "rhythm (--local-steps per round); choose one of them")
        if self.federated:
            self._validate_federated()
        if not (self.sync_every or self.federated):
            return
        mode, name = ((f"--sync-every {self.sync_every}", "local SGD") if self.sync_every
                      else ("--federated", "federated averaging"))
        for flag, refused, why in WITHOUT_BARRIER_REFUSED:
            if refused(self):
                raise ConfigError(f"{mode} with {flag(self)}: " + why.format(name=name))

    def _validate_federated(self) -> None:
        k, c = self.clients, self.clients_per_round
        if k > 256:
            raise ConfigError(f"--clients {k}: at most 256 (each holds a shard of a toy corpus)")
        if c > k:
            raise ConfigError(f"--clients-per-round {c}: the server samples from --clients {k}; "
                              f"choose at most {k} (0: all of them)")
        if self.dp > k:
            raise ConfigError(f"--dp {self.dp}: more ranks than --clients {k} (client k lives on "
                              f"rank k mod dp) would leave ranks without a client; choose dp <= {k}")
        if self.grad_accum != 1:
            raise ConfigError("--grad-accum with --federated: a client's local step is one batch "
                              "of --batch sequences; leave --grad-accum at 1")

    def _validate_saves(self) -> None:
        """--save-every / --keep (runtime/checkpoint.py); the directories themselves: runtime/preflight.py."""
        for name in ("save_every", "keep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "save_every" else 1):
                raise ConfigError(f"{_flag(name)} {_show(v)}: must be a whole number >= "
                                  + ("1 (a checkpoint every K steps)" if name == "save_every" else
                                     "1 (the newest checkpoint is the one --resume reads)"))
        if self.save_every and not self.save:
            raise ConfigError(f"--save-every {self.save_every}: needs --save DIR (the directory "
                              f"the checkpoints go to)")

    def _validate_offload_disk(self) -> None:
        """--offload-disk DIR: what it composes with (the directory itself is preflight's)."""
        if not self.offload_disk:
            raise ConfigError("--keep-offload keeps --offload-disk's files; give --offload-disk DIR")
        for flag, on in (("--offload", self.offload), ("--fp32-grad-accum", self.fp32_grad_accum)):
            if on:
                raise ConfigError(f"--offload-disk with {flag}: not available yet (the states are "
                                  f"in the file, not in RAM where {flag} looks for them); use one "
                                  f"of them")
        if self.ep > 1 and self.zero != 3:
            raise ConfigError(f"--offload-disk with --ep {self.ep}: experts and dense parameters "
                              f"have two optimizers, one file per rank holds one; use --zero 3 "
                              f"(one optimizer over both) or --ep 1")

    def _validate_experts(self) -> None:
        E, P, k = self.experts, self.ep, self.top_k
        for name in ("experts", "top_k", "moe_every"):  # (whole numbers: validate checked)
            v = getattr(self, name)
            if v < (0 if name == "experts" else 1):
                raise ConfigError(f"{_flag(name)} {v!r}: must be a whole number >= "
                                  f"{0 if name == 'experts' else 1}")
        if E == 0:
            if P > 1:
                raise ConfigError(f"--ep {P}: expert parallel shards the experts of a mixture-of-"
                                  f"experts model; add --experts E (a multiple of {P})")
            return
        if k > E:
            raise ConfigError(f"--top-k {k}: each token picks k of the --experts {E}; choose "
                              f"k <= {E}")
        if not self.capacity_factor > 0:
            raise ConfigError(f"--capacity-factor {self.capacity_factor!r}: must be > 0 (1.0 = "
                              f"each expert takes its fair share, tokens*k/E, per sequence)")
        if self.aux_loss_weight < 0 or self.z_loss_weight < 0:
            raise ConfigError("--aux-loss-weight and --z-loss-weight: must be >= 0")
        if self.moe_every > self.layers:
            raise ConfigError(f"--moe-every {self.moe_every}: with --layers {self.layers} no block "
                              f"would get experts; choose at most {self.layers}")
        if E % P:
            raise ConfigError(f"--experts {E}: expert parallel gives each of --ep {P} ranks E/ep "
                              f"experts; choose a multiple of {P}")
        if (self.dp * self.cp) % P:
            raise ConfigError(f"--ep {P}: expert parallel is carved out of the data-parallel ranks "
                              f"(dp x cp = {self.dp * self.cp}); choose an ep that divides it")
        if self.schedule.startswith("pipedream") and self.pp > 1:
            raise ConfigError(f"--experts with --schedule {self.schedule}: not available yet; use "
                              f"a synchronous schedule (1f1b, gpipe, ...)")
        shard = self.dp_shard * self.cp  # HYBRID_SHARD's shard group (mesh.split_expert_replicas)
        if P > 1 and 0 < self.dp_shard < self.dp and shard % P and P % shard:
            raise ConfigError(f"--ep {P} with --dp-shard {self.dp_shard}: an ep group must lie "
                              f"inside one shard group or span whole ones (experts sharded inside "
                              f"it, replicated across); choose an ep that divides dp-shard x cp = "
                              f"{shard} or is a multiple of it")

    def _validate_async(self) -> None:
        """--async, --max-staleness, --straggler: they compose with --dp alone."""
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) \
                or self.max_staleness < -1:
            raise ConfigError(f"--max-staleness {_show(self.max_staleness)}: a whole number >= 0 "
                              f"(steps a worker may run ahead of the slowest), or -1 for no bound")
        if self.max_staleness != -1 and not self.asynchronous:
            raise ConfigError("--max-staleness: only asynchronous SGD reads it; add --async")
        if not isinstance(self.straggler, str):
            raise ConfigError(f"--straggler {self.straggler!r}: write RANK:FACTOR, e.g. 3:3")
        if not (self.asynchronous or self.straggler):
            return
        what = "--async" if self.asynchronous else "--straggler"
        others = [name for name, bad in (
            ("--tp", self.tp > 1), ("--pp", self.pp > 1), ("--cp", self.cp > 1),
            ("--experts", self.experts > 0)) if bad]
        if others:
            raise ConfigError(f"{what} with {others[0]}: composes with --dp alone (one whole model "
                              f"per rank); drop {others[0]}")
        if self.straggler and self.federated:
            raise ConfigError("--straggler with --federated: a federated round's clients are not "
                              "ranks; drop --straggler")
        if self.dp < 2:
            raise ConfigError(f"{what}: needs --dp 2 or more (" + (
                "rank 0 serves the parameters, the other ranks compute gradients)"
                if self.asynchronous else "with one rank nobody waits for a straggler)"))
        if self.asynchronous:
            for flag, bad, why in (
                    ("--sync-every", self.sync_every, "local SGD averages replicas that step "
                     "alone; asynchronous workers step no replica of their own: choose one"),
                    ("--federated", self.federated, "federated averaging's server averages "
                     "clients' weights once a round; this one applies gradients: choose one"),
                    ("--zero", self.zero, "the server holds the whole optimizer; use --zero 0"),
                    ("--grad-accum", self.grad_accum != 1, "each push is one gradient; leave it at 1"),
                    ("--precision", self.precision != "fp32",
                     "the replay oracle is exact in fp32; use --precision fp32"),
                    ("--checkpointing", self.checkpointing != "none",
                     "workers run the plain model; use --checkpointing none"),
                    ("--save", self.save, "checkpoints of a parameter server are not available"),
                    ("--resume", self.resume, "checkpoints of a parameter server are not available"),
                    ("--backend", self.backend == "nccl",
                     "the server receives from any worker, which NCCL cannot; use gloo or auto"),
                    ("--sync-every", self.sync_every, "local SGD averages in lock step; choose one"),
                    ("--federated", self.federated, "federated rounds wait for every sampled "
                                                    "client; choose one")):
                if bad:
                    raise ConfigError(f"--async with {flag}: {why}")
            workers = self.dp - 1
            if self.batch % workers:
                raise ConfigError(f"--batch {self.batch}: with --async each of the {workers} "
                                  f"workers (ranks 1..{self.dp - 1}) computes on batch/{workers} "
                                  f"sequences; choose a multiple of {workers * self.dp} "
                                  f"(also divisible by --dp {self.dp})")
        if self.straggler:
            parsed = straggler_of(self.straggler)
            if parsed is None:
                raise ConfigError(f"--straggler {self.straggler!r}: write RANK:FACTOR, e.g. 3:3 "
                                  f"(rank 3 three times slower)")
            rank, factor = parsed
            first = 1 if self.asynchronous else 0
            if not first <= rank < self.dp:
                raise ConfigError(f"--straggler {self.straggler}: RANK must be a " + (
                    f"worker, 1..{self.dp - 1} (rank 0 is the parameter server; it computes no "
                    f"gradient to slow)" if self.asynchronous else f"rank, 0..{self.dp - 1}"))
            if not 1 <= factor <= 100:
                raise ConfigError(f"--straggler {self.straggler}: FACTOR must be between 1 (no "
                                  f"slower) and 100 (a step 100 times as long)")

    def _validate_context(self) -> None:
        c, impl = self.cp, self.cp_impl
        parts = 2 * c if impl == "zigzag" else c  # zigzag cuts the sequence into 2C chunks
        if self.seq % parts:
            raise ConfigError(f"--seq {self.seq}: --cp-impl {impl} cuts each sequence into {parts} "
                              f"equal chunks (--cp {c}); choose a multiple of {parts}")
        if self.sp and (self.seq // c) % self.tp:
            raise ConfigError(f"--seq {self.seq}: with --cp {c} and --sp each rank's {self.seq // c} "
                              f"tokens are split again over --tp {self.tp}; choose a multiple of "
                              f"{c * self.tp}")
        heads = self.heads // self.tp
        if impl == "ulysses" and heads % c:
            raise ConfigError(f"--heads {self.heads}: Ulysses gives each of --cp {c} ranks whole "
                              f"heads ({heads} per tensor-parallel rank); choose heads divisible by "
                              f"{c * self.tp}, or --cp-impl ring")

    def _validate_dualpipe(self) -> None:
        """DualPipe's phases need every rank to start 2 x pp micro-batches (per direction, p)."""
        if self.schedule not in ("dualpipev", "dualpipe"):
            return
        if self.schedule == "dualpipe" and self.pp % 2:
            raise ConfigError(f"--pp {self.pp}: dualpipe pairs rank i with rank pp-1-i (both hold "
                              f"stages i and pp-1-i); choose an even --pp")
        if self.microbatches < 2 * self.pp or (self.schedule == "dualpipe" and self.microbatches % 2):
            k = 2 * self.pp
            raise ConfigError(f"--microbatches {self.microbatches}: {self.schedule} needs at least "
                              f"2 x pp = {k}" + (", an even number (half enter from each end)"
                                                 if self.schedule == "dualpipe" else "")
                              + f"; try --microbatches {max(k, self.microbatches + self.microbatches % 2)}")
        if self.schedule == "dualpipe" and self.zero == 3:
            raise ConfigError("--zero 3 with --schedule dualpipe: the two copies of a stage sum "
                              "their gradients before the step, which ZeRO-3's per-layer "
                              "reduce-scatter in W does not wait for; use --zero 0, 1 or 2")

    def _validate_pipeline(self) -> None:
        if self.virtual_stages < 0:
            raise ConfigError(f"--virtual-stages {self.virtual_stages}: must be >= 1 (or 0 for the "
                              f"schedule's default)")
        v = virtual_stages(self.schedule, self.virtual_stages)
        if self.schedule in ("zbv", "dualpipev", "dualpipe") and v != 2:
            raise ConfigError(f"--virtual-stages {v}: {self.schedule} places exactly 2 chunks on "
                              f"each rank; leave --virtual-stages at 0")
        if v > 1 and self.schedule not in ("interleaved", "zbv", "dualpipev", "dualpipe"):
            raise ConfigError(f"--virtual-stages {v}: several model chunks per rank need "
                              f"--schedule interleaved ({self.schedule} runs one chunk per rank)")
        self._validate_dualpipe()
        chunks = self.pp * v // (2 if self.schedule == "dualpipe" else 1)  # dualpipe: p stages, twice
        if self.layers % chunks:
            raise ConfigError(f"--layers {self.layers}: {self.pp} stages x {v} chunks each need a "
                              f"multiple of {chunks} layers; try --layers {chunks * max(1, self.layers // chunks)}")
        if self.batch % (self.dp * self.microbatches):
            k = self.dp * self.microbatches
            raise ConfigError(f"--batch {self.batch}: must be divisible by dp x microbatches = {k} "
                              f"(equal micro-batches on every stage); try --batch {k * max(1, self.batch // k)}")
        if self.schedule in ("interleaved", "zb", "zbv") and self.microbatches < self.pp:
            raise ConfigError(f"--microbatches {self.microbatches}: {self.schedule} needs at least "
                              f"as many micro-batches as stages (--pp {self.pp}) to fill the pipeline")
        if self.schedule == "interleaved" and self.microbatches % self.pp:
            raise ConfigError(f"--microbatches {self.microbatches}: interleaved sends micro-batches "
                              f"through the chunks in groups of --pp {self.pp}; use a multiple of {self.pp}")
        if self.schedule.startswith("pipedream") and self.dp > 1:
            raise ConfigError(f"--schedule {self.schedule} updates each stage after every "
                              f"micro-batch; with --dp {self.dp} that needs a gradient sync per "
                              f"micro-batch, not available yet: use --dp 1")
        if self.grad_accum != 1:
            raise ConfigError("--grad-accum: with --pp > 1 the pipeline's --microbatches already "
                              "accumulate gradients; leave --grad-accum at 1")
        if self.zero and self.schedule.startswith("pipedream"):
            raise ConfigError(f"--zero {self.zero} with --schedule {self.schedule}: PipeDream steps "
                              f"each stage's own optimizer after every micro-batch; use --zero 0")
        if self.fp32_grad_accum:
            raise ConfigError(f"--fp32-grad-accum with --pp {self.pp}: fp32 gradient buffers inside "
                              f"pipeline stages are not available yet; use one of them at a time")


def straggler_of(text: str) -> tuple[int, float] | None:
    """--straggler "RANK:FACTOR" as (rank, factor); None when it is not of that form."""
    rank, sep, factor = text.partition(":")
    try:
        parsed = int(rank), float(factor)
    except ValueError:
        return None
    return parsed if sep and math.isfinite(parsed[1]) else None

def offload_file(directory: str, rank: int) -> str:
    """--offload-disk's file of one rank (parallel/offload_disk.py writes it, runtime/launch.run removes it)."""
    return os.path.join(directory, f"rank{rank}.states")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(v) -> str:
    """A value for a one-line message: a 400-digit number is not repeated in full."""
    text = repr(v)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} characters)"
