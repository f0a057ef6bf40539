"""The course's tooling, built on the core above it and imported by nothing in it.

    viz/         altair charts: each chart once, for lessons and app alike
    grading/     the lessons' checkers (one module per lesson)
    planner      ranked layouts for a model and a cluster, theory only (`python -m parallel_mini plan`)
    guide        the decision guide of lesson 09 and the app's Plan page
    experiments  the live experiments lessons and pages call (overlap, wire bytes, TP shards)
    collectives  the primitives and ring experiments of lesson 01 and the Ring page
    peers        PyTorch's native peers (DDP, FSDP2, DTensor, pipelining) on our model
    bench        the benchmarks (`python -m parallel_mini.bench ...`)
    magic        the `%%ranks` cell magic of the notebooks
"""
