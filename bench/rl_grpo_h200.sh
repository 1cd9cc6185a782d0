#!/usr/bin/env bash
# The committed H200 runs of bench/rl_grpo.py (README "Measured results"), by configuration:
#   bench/rl_grpo_h200.sh OUTDIR probe|solo|a|a-cooperative|b|b-fifo|b-cuda|c ...
# solo: 4 jobs alone, one after the other (saved; the shared runs compare with them)
# a: 2 jobs x ~18 GB, residency auto, backends cuda and cooperative (a-cooperative: the latter alone)
# c: 4 jobs x ~30 GB, residency auto (all fit with headroom), backend cuda
# b: 3 jobs x ~49 GB (at most two resident on 150 GB with 10% headroom), cooperative (95 GB pinned pool), cuda;
#    b-fifo: the same in strict queue order (residentFirstSeconds 0); b-cuda: backend cuda with
#    residentFirstSeconds 300 (its switches take ~35 s, more than the default 30 s bound: every
#    waiter passed it and the three jobs rotated, one switch per phase: 10 of 24 phases in 545 s)
# STEPS (default 8) must match the solo runs'; SOLO: the solo runs' JSON (bench/results/rl-grpo-solo-h200.json)
# On the lent machine the project and its server dependencies come as wheels in .whl/.
set -uo pipefail
out="$1"
shift
export TIMESLICE_MACHINE="${TIMESLICE_MACHINE:-lent NVIDIA H200 host (device tool, nvidia-h200)}"
export PYTHONUNBUFFERED=1
run() { python3 bench/rl_grpo.py --steps "${STEPS:-8}" "$@" || echo "stage failed: $*" >&2; }
for stage in "$@"; do
  case "$stage" in
    probe)
      nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv
      df -h /dev/shm /tmp || true
      free -g || true
      python3 -c "
import os, pynvml, torch
x = torch.empty(int(2e9), dtype=torch.uint8, device='cuda')
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
print('pid', os.getpid(), 'nvml processes', [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)])"
      nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null || true; lscpu | grep -E '^(CPU\(s\)|Thread|Core|Socket|Model name)' || true
      python3 -c "
import multiprocessing as mp, time
def spin(q):
    t, n = time.monotonic(), 0
    while time.monotonic() - t < 1.5:
        n += 1
    q.put(n)
for k in (1, 2, 4, 8):  # Python busy loops at once: the rate of each vs. one alone (CPU contention)
    q = mp.Queue(); ps = [mp.Process(target=spin, args=(q,)) for _ in range(k)]
    [p.start() for p in ps]; rates = [q.get() for _ in ps]; [p.join() for p in ps]
    print('busy loops', k, 'mean rate', sum(rates) // k)"
      ;;
    solo) run --jobs 4 --backends --save-solo "${SOLO:-$out/solo.json}" ;;
    a) run --jobs 2 --extra-gb 7 --backends cuda cooperative --pool-gb 20 --solo-json "${SOLO:-$out/solo.json}" \
         --out "$out/rl-grpo-a-h200.json" ;;
    a-cooperative) run --jobs 2 --extra-gb 7 --backends cooperative --pool-gb 20 --solo-json "${SOLO:-$out/solo.json}" \
         --out "$out/rl-grpo-a-cooperative-h200.json" ;;
    c) run --jobs 4 --extra-gb 19 --backends cuda --solo-json "${SOLO:-$out/solo.json}" --out "$out/rl-grpo-c-h200.json" ;;
    b) run --jobs 3 --extra-gb 40 --init-hold --backends cooperative --pool-gb 95 --solo-json "${SOLO:-$out/solo.json}" \
         --out "$out/rl-grpo-b-h200.json" ;;
    b-fifo) run --jobs 3 --extra-gb 40 --init-hold --backends cooperative --pool-gb 95 --resident-first 0 \
         --solo-json "${SOLO:-$out/solo.json}" --out "$out/rl-grpo-b-fifo-h200.json" ;;
    b-cuda) run --jobs 3 --extra-gb 40 --init-hold --backends cuda --resident-first 300 --solo-json "${SOLO:-$out/solo.json}" \
         --out "$out/rl-grpo-b-cuda-h200.json" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
