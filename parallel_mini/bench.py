"""`python -m parallel_mini.bench dp|ring|zero|tp|pp|bubble|cp|ep|wire|plan|async|dualpipe|warm|all`
(`--json PATH`, `--compare OLD.json`): the benchmarks' command line. The benchmarks are course
tooling; their code is in course/bench.py."""
if __name__ == "__main__":
    from .course.bench import main

    raise SystemExit(main())
