#!/usr/bin/env bash
# `make soak [SOAK_N=3]`: the whole suite, N times, each from a fresh clone of this repository's
# HEAD (its own venv, as CI builds it), then every failure of every round. A flaky test is a bug:
# this is how one is found before CI finds it. Exit 0 only if every round passed.
# SOAK_LOAD=K runs K CPU-bound busy loops beside the suite for the whole soak (a classroom laptop
# or a CI neighbour is such a machine); they end with the soak, whatever ends it.
set -uo pipefail
cd "$(dirname "$0")/.."
n="${SOAK_N:-3}"
repo="$(pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/parallel_mini_soak.XXXXXX")"
passed=0
busy=()
stop_busy() { [ "${#busy[@]}" -gt 0 ] && kill "${busy[@]}" 2>/dev/null; }
trap stop_busy EXIT
for _ in $(seq 1 "${SOAK_LOAD:-0}"); do
  ( while :; do :; done ) &
  busy+=("$!")
done
[ "${#busy[@]}" -gt 0 ] && echo "soak: ${#busy[@]} busy loops beside the suite (pids ${busy[*]})"
for i in $(seq 1 "$n"); do
  dir="$work/round_$i"
  git clone -q "$repo" "$dir"
  start=$(date +%s)
  # --durations: each round's log ends with its 25 slowest tests (where a loaded round spends)
  (cd "$dir" && CI="${CI:-}" PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} --durations=25" \
    make test) > "$work/round_$i.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    echo "round $i/$n: passed in ${took} s, load $(cut -d' ' -f1-3 /proc/loadavg) ($(grep -Eo '[0-9]+ passed[^=]*' "$work/round_$i.log" | tail -1))"
  else
    echo "round $i/$n: FAILED (exit $rc) after ${took} s; log: $work/round_$i.log"
    grep -E '^(FAILED|ERROR) ' "$work/round_$i.log" | sed 's/^/    /'
    grep -E 'terminate called|Segmentation|Timed out|timeout' "$work/round_$i.log" | head -5 | sed 's/^/    /'
  fi
  rm -rf "$dir"  # the venv alone is ~1 GB; the log stays
done
echo "soak: $passed of $n rounds passed (logs in $work)"
[ "$passed" -eq "$n" ]
