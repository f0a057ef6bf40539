"""`python -m parallel_mini run ...` and `plan ...`: the command line, whose body is runtime/cli.py.

This door is the one place where the run infrastructure meets the course: runtime/ imports nothing
from course/, so the course's parts are handed in here (the `plan` verb, a pipeline run's bubble in
the summary, the --trace file). All of them are torch-free: a bad flag still answers at once.
"""
from .course import planner, timelines, trace
from .runtime import cli

COURSE = cli.CourseParts(add_plan_parser=planner.add_parser, plan=planner.cli,
                         summary=trace.summary_lines, write_trace=timelines.write_chrome_trace)


def main(argv=None) -> int:
    return cli.main(argv, COURSE)


def _entry() -> None:  # (pyproject's `parallel-mini` script)
    cli.entry(main)


if __name__ == "__main__":
    _entry()
