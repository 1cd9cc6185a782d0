#!/usr/bin/env bash
# The suite on a loaded machine (issue 12): stress-ng keeps every core busy while the unit +
# integration suite runs RUNS times (default 5), the e2e suite once, the lock group's hypothesis
# schedules 10 000 times each (tests/faults/test_group*_schedules.py), its decision cores over
# 100 000 random cases each (tests/test_decisions.py, tests/test_switch_outcome.py, tests/test_lease_calls.py,
# tests/test_acquire_calls.py), and the randomized process
# schedules (bench/schedules.py) SCHEDULES times per backend (default 1000, about 40 minutes per backend on 2 cores; the suite runs a slice);
# each run's time and result is printed. Needs stress-ng (Debian package, installed when missing)
# and, for e2e, root.
#   hack/stress-test.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
command -v stress-ng >/dev/null || apt-get install -y -q stress-ng >/dev/null
stress-ng --cpu "$(nproc)" --quiet &
stress=$!
trap 'kill "$stress" 2>/dev/null; wait "$stress" 2>/dev/null' EXIT
failed=0
for i in $(seq 1 "${RUNS:-5}"); do
  start=$(date +%s)
  if .venv/bin/pytest -q -p no:cacheprovider tests >"/tmp/stress-unit-$i.log" 2>&1; then result=passed; else result=FAILED; failed=1; fi
  echo "unit run $i: $result in $(( $(date +%s) - start )) s ($(tail -n 1 "/tmp/stress-unit-$i.log"))"
done
start=$(date +%s)
if hack/e2e.sh >/tmp/stress-e2e.log 2>&1; then result=passed; else result=FAILED; failed=1; fi
echo "e2e run: $result in $(( $(date +%s) - start )) s ($(grep -E '[0-9]+ (passed|failed)' /tmp/stress-e2e.log | tail -n 1))"
start=$(date +%s)
if TIMESLICE_SCHEDULE_EXAMPLES=10000 .venv/bin/pytest -q -p no:cacheprovider --timeout 3600 tests/faults/test_group_schedules.py \
    tests/faults/test_group_memory_schedules.py >/tmp/stress-group-schedules.log 2>&1; then result=passed; else result=FAILED; failed=1; fi
echo "group schedules (hypothesis, 10000 each): $result in $(( $(date +%s) - start )) s"
start=$(date +%s)
if TIMESLICE_DECISION_EXAMPLES=100000 .venv/bin/pytest -q -p no:cacheprovider --timeout 3600 tests/test_decisions.py \
    tests/test_switch_outcome.py tests/test_lease_calls.py tests/test_acquire_calls.py tests/test_takeover.py >/tmp/stress-decisions.log 2>&1; then result=passed; else result=FAILED; failed=1; fi
echo "decision cores (hypothesis, 100000 cases each): $result in $(( $(date +%s) - start )) s"
for backend in cooperative cuda freeze none app vmm; do
  start=$(date +%s)
  if .venv/bin/python bench/schedules.py --backend "$backend" --count "${SCHEDULES:-1000}" --seed 100001 --workers 2 \
      --out "/tmp/stress-schedules-$backend.json" >"/tmp/stress-schedules-$backend.log" 2>&1; then
    result=passed
  else
    result=FAILED; failed=1
  fi
  echo "schedules $backend: $result in $(( $(date +%s) - start )) s ($(grep -c '"failures": \[{' \
    "/tmp/stress-schedules-$backend.log") of ${SCHEDULES:-1000} failed; /tmp/stress-schedules-$backend.json)"
done
exit "$failed"
