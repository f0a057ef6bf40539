"""RunReport: what a run measured, per rank and merged, beside theory's prediction. JSON-ready.

Times in the report are seconds from the earliest event of the run (all local ranks share one
monotonic clock). Comm records keep their own fields (op, group, count, payload_bytes,
wire_bytes_model, wire_bytes_measured, step); `step == -1` marks one-time setup traffic (the
start-up broadcast), outside every step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import theory


@dataclass
class RunReport:
    config: dict
    world_size: int
    losses: list[float]
    ranks: list[dict]
    theory: dict
    wall_s: float = 0.0
    reference_losses: list[float] | None = None
    max_abs_diff: float | None = None
    max_abs_diff_detail: dict | None = None
    extra: dict = field(default_factory=dict)

    # -- derived views -------------------------------------------------------------------------
    def wire_bytes_per_step(self, rank: int = 0, group: str | None = None,
                            kind: str = "model") -> dict[str, float | None]:
        """Bytes this rank sent per training step, by group: kind "model" sums the ring model of
        the ops that ran (records' `wire_bytes_model`), "measured" what the process wrote to its
        sockets during them (`wire_bytes_measured`; None for a group where it could not be read).
        Expert parallel's all-to-all depends on where the router sent tokens, so it is kept apart
        (moe_wire_bytes_per_step): what is left is traffic a formula predicts exactly."""
        key = {"model": "wire_bytes_model", "measured": "wire_bytes_measured"}[kind]
        steps = max(1, self.config["steps"])
        out: dict[str, float | None] = {}
        for rec in self.ranks[rank]["comm"]:
            if rec["step"] >= 0 and (group is None or rec["group"] == group) \
                    and rec.get("layer") != "moe":
                g, v = rec["group"], rec.get(key)
                out[g] = None if v is None or (g in out and out[g] is None) else out.get(g, 0) + v
        return {g: (None if b is None else b / steps) for g, b in out.items()}

    def wire_groups_apportioned(self, rank: int = 0) -> set[str]:
        """Groups whose measured bytes include a share of an interval in which another group's op
        was also writing (see meters.WireMeter): their split is by model bytes, their sum exact."""
        return {rec["group"] for rec in self.ranks[rank]["comm"] if rec["step"] >= 0
                and len(rec.get("wire_shared_with", [])) > 1}

    def moe_wire_bytes_per_step(self, rank: int = 0) -> float:
        """Expert parallel's all-to-all bytes this rank sent per step (counts, dispatch, combine;
        forward and backward): every row it routed to another rank's experts, and back."""
        steps = max(1, self.config["steps"])
        return sum(r["wire_bytes_model"] for r in self.ranks[rank]["comm"]
                   if r["step"] >= 0 and r.get("layer") == "moe") / steps

    def comm_summary(self, rank: int = 0) -> list[dict]:
        """Records of one rank aggregated by (op, group, setup/step): calls and bytes."""
        agg: dict[tuple, dict] = {}
        for rec in self.ranks[rank]["comm"]:
            key = (rec["op"], rec["group"], "setup" if rec["step"] < 0 else "steps")
            a = agg.setdefault(key, {"op": key[0], "group": key[1], "when": key[2], "calls": 0,
                                     "payload_bytes": 0, "wire_bytes_model": 0})
            a["calls"] += 1
            a["payload_bytes"] += rec["payload_bytes"]
            a["wire_bytes_model"] += rec["wire_bytes_model"]
        return list(agg.values())

    def to_dict(self) -> dict:
        d = {"config": self.config, "world_size": self.world_size, "losses": self.losses,
             "wall_s": self.wall_s, "ranks": self.ranks, "theory": self.theory,
             "measured": {"wire_bytes_per_step": self.wire_bytes_per_step(),
                          "wire_bytes_written_per_step": self.wire_bytes_per_step(kind="measured")}}
        if self.config.get("ep", 1) > 1:
            d["measured"]["ep_all_to_all_per_step"] = [self.moe_wire_bytes_per_step(r)
                                                       for r in range(len(self.ranks))]
        if self.reference_losses is not None:
            d.update(reference_losses=self.reference_losses, max_abs_diff=self.max_abs_diff,
                     max_abs_diff_detail=self.max_abs_diff_detail)
        d.update(self.extra)
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "RunReport":
        known = {"config", "world_size", "losses", "ranks", "theory", "wall_s",
                 "reference_losses", "max_abs_diff", "max_abs_diff_detail"}
        return cls(**{k: d[k] for k in known if k in d},
                   extra={k: v for k, v in d.items() if k not in known | {"measured"}})


def _rebase_times(per_rank: list[dict]) -> None:
    """Shift every timestamp so the run starts at 0 s."""
    starts = [e["start"] for r in per_rank for e in r["events"] + r["comm"] if "start" in e]
    t0 = min(starts, default=0.0)
    for r in per_rank:
        for e in r["events"] + r["comm"]:
            for key in ("start", "end", "waited_until"):
                if key in e:
                    e[key] -= t0


def merge_rank_results(cfg, per_rank: list[dict], wall_s: float = 0.0) -> RunReport:
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    _rebase_times(per_rank)
    rank0 = per_rank[0]
    report = RunReport(config=cfg.to_dict(), world_size=len(per_rank), losses=rank0["losses"],
                       ranks=per_rank, theory=theory.run_theory(cfg, rank0["n_params"]),
                       wall_s=wall_s)
    if "max_abs_diff" in rank0:
        detail = rank0.pop("max_abs_diff")
        report.reference_losses = rank0.pop("reference_losses")
        report.max_abs_diff_detail = detail
        report.max_abs_diff = max(detail["losses"], detail["params"])
    return report
