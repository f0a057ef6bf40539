"""Sums suite_timeline.py's records per test file: wall s, CPU s busy (jiffies / 100), the pytest
process's own CPU s. python suite_by_file.py TIMELINE.jsonl"""
import collections
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
busy = sum(r["busy"] for r in rows) / 100
idle = sum(r["idle"] for r in rows) / 100
print(f"{len(rows)} tests, span {max(r['t1'] for r in rows) - min(r['t0'] for r in rows):.0f} s, "
      f"CPU busy {busy:.0f} s, idle {idle:.0f} s")
by = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
for r in rows:
    a = by[r["id"].split("::")[0]]
    a[0] += r["t1"] - r["t0"]
    a[1] += r["busy"] / 100
    a[2] += r.get("self", 0.0)
for name, (wall, cpu, own) in sorted(by.items(), key=lambda kv: -kv[1][1])[:30]:
    print(f"wall {wall:6.1f}  busy {cpu:6.1f}  pytest's own {own:5.1f}  {name}")
