"""What the final-parameter gather pickles per rank: the blocks as own tensors (engine.own_blocks)
against the same tensors as views of their storages, and the elements' own bytes; the toy at dp 4,
ZeRO-1. python docs/suite-time-2026-12-07/scripts/gather_payload.py"""
import pickle

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks


def probe(cfg_dict):
    from parallel_mini import engine
    sizes = {}
    original = engine.gather_full_parameters

    def spy(model, local, mesh):
        sizes["own tensors"] = len(pickle.dumps(engine.own_blocks(model, local)))
        sizes["views"] = len(pickle.dumps({n: t.detach() for n, t in local.items()}))
        sizes["elements"] = sum(t.numel() * t.element_size() for t in local.values())
        return original(model, local, mesh)
    engine.gather_full_parameters = spy
    engine.train_rank(cfg_dict)
    return sizes


print(run_ranks(probe, 4, RunConfig(dp=4, zero=1, steps=1, reference=True).to_dict())[0].value)
