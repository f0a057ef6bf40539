"""Run infrastructure, which a learner need not read to learn parallelism: starting the ranks and
diagnosing their failures (launch.py, whose `run` is the library's entry: one training run),
the checks before any rank starts (preflight.py), checkpoint files and their hygiene
(checkpoint.py), and the command line's body (cli.py). It imports the core, never course/."""
