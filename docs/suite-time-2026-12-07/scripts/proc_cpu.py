"""CPU seconds per process of the machine while something runs, by kind of process: /proc is read
every 0.2 s, and each process (pid, start time) keeps the user + system time it had at its last
reading (a process that lives under 0.2 s is missed). Only processes started after the sampler are
counted.

    python proc_cpu.py sample OUT.json SECONDS &   # stops early when OUT.json.stop exists
    .venv/bin/python -m pytest -q; touch OUT.json.stop
    python proc_cpu.py report OUT.json
"""
import collections
import json
import os
import sys
import time


def sample(out: str, seconds: float) -> None:
    tick, me, seen = os.sysconf("SC_CLK_TCK"), os.getpid(), {}
    boot_now = time.clock_gettime(time.CLOCK_BOOTTIME)
    stop = time.time() + seconds
    while time.time() < stop and not os.path.exists(out + ".stop"):
        for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != me):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                key = (int(pid), int(rest[19]))
                if key not in seen:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
                    seen[key] = {"pid": int(pid), "ppid": int(rest[1]), "start": key[1] / tick,
                                 "cmd": cmd}
                seen[key]["cpu"] = (int(rest[11]) + int(rest[12])) / tick
            except (OSError, ValueError, IndexError):
                pass
        time.sleep(0.2)
    procs = [p for p in seen.values() if p["start"] >= boot_now]
    with open(out, "w") as f:
        json.dump(procs, f)


def kind(p: dict, by_pid: dict) -> str:
    cmd = p["cmd"]
    if "forkserver" in cmd:
        parent = by_pid.get(p["ppid"], {"cmd": ""})["cmd"]
        return "forkserver (start-up)" if "forkserver" not in parent else "ranks (forked)"
    for needle, name in (("ipykernel", "notebook kernels"), ("streamlit", "streamlit servers"),
                         ("chromium", "chromium"), ("playwright", "playwright driver"),
                         ("torchrun", "torchrun agents"), ("parallel_mini", "CLI runs"),
                         ("pytest", "pytest")):
        if needle in cmd:
            return name
    return "other"


def report(path: str) -> None:
    with open(path) as f:
        procs = json.load(f)
    by_pid = {p["pid"]: p for p in procs}
    cpu, count = collections.Counter(), collections.Counter()
    for p in procs:
        cpu[kind(p, by_pid)] += p["cpu"]
        count[kind(p, by_pid)] += 1
    print(f"{len(procs)} processes, {sum(cpu.values()):.0f} CPU s")
    for k, v in cpu.most_common():
        print(f"{v:7.1f} s {count[k]:5d}  {k}")


if __name__ == "__main__":
    if sys.argv[1] == "sample":
        sample(sys.argv[2], float(sys.argv[3]))
    else:
        report(sys.argv[2])
