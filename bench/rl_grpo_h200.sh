#!/usr/bin/env bash
# The committed H200 runs of bench/rl_grpo.py (docs/results.md): GRPO-shaped jobs through the
# product's own commands, default settings, solo vs shared. One call runs the stages it is given, in order:
#   bench/rl_grpo_h200.sh OUTDIR STAGE ...
# STAGE:
#   wheels          HERE, not on the GPU machine: download into .whl/ the server dependencies the GPU image lacks
#                   (pinned to this machine's .venv); the device tool carries them (`carry: [".whl"]`)
#   hugepages       reserve 2 MiB huge pages for serve's default pool (or HUGEPAGES_GB) and mount hugetlbfs (an admin's set-up:
#                   `timeslice serve` then puts the pinned pool there); without it the pool is on /dev/shm
#   probe           the GPU, shared memory, CPUs, CPU contention, and whether the installed product imports
#   solo-a|solo-b|solo-c      the shape's jobs alone, one after the other -> OUTDIR/solo-<shape>.json
#   vmm-switch      bench/vmm_switch.py: two unmodified 50 GB jobs (GB) switched 10 times by backend vmm, CUDA graphs
#                   replayed and tensors checked bitwise after each -> OUTDIR/vmm-switch-h200.json
#   a|b|c[-MODE[-BACKEND]]    the shape shared, MODE serve|agent (default both), BACKEND cuda|cooperative|vmm (default
#                   both) -> OUTDIR/rl-grpo-<stage>[-declared]-h200.json; solo runs from OUTDIR/solo-<shape>.json
#                   (or SOLO=file), else measured first and saved there
# Shapes (1b model, bf16; --extra-gb sizes each job's peak; the H200 has 150.7 GB, 10% headroom by default):
#   a: 2 jobs x ~18 GB (fit)       b: 3 jobs x ~57 GB (two fit)       c: 4 jobs x ~30 GB (fit)
# Environment: STEPS (default 6; must match the solo runs'), REWARD_SECONDS (3), JOBS and EXTRA_GB (a shape's
# job count and --extra-gb instead of the table's: another GPU), TAG (h200: the result files' last word), DECLARE=1 (each job declares its
# solo peak in TIMESLICE_MEMORY: --declare-memory), POOL_GB (cooperative: a pinned_pool of that many GB in the
# config; default none, the product's default), JOB_TIMEOUT (seconds for one shared run's jobs, default 480),
# LOGS (default /tmp/rl-grpo-logs; packed into OUTDIR/logs.tgz at the end), BENCH_FLAGS (appended to every
# bench/rl_grpo.py call, last: they win; a dry run on a CPU machine: BENCH_FLAGS='--size tiny --device cpu
# --extra-gb 0 --reward-seconds 0.2' and a stage such as a-serve-freeze), SITE (/tmp/site), WHL_DIR (.whl).
# A device call runs at most 10 minutes and brings back at most 8 files: split the stages over calls, e.g.
#   `probe solo-a a`, `solo-c c-serve`, `c-agent`, `solo-b b-serve-cooperative`, `b-agent-cooperative`,
#   `b-serve-cuda`, `b-agent-cuda` (a solo job of 6 steps takes ~50 s, a shared run of a ~60 s, of c ~90 s, of b
#   ~2-3 min at a gain near 1).
# On the lent machine the project is installed from this tree and its server dependencies from .whl/ into
# /tmp/site (README of the device tool), once per call: `carry: [".whl"]`.
set -uo pipefail
out="$1"
shift
export TIMESLICE_MACHINE="${TIMESLICE_MACHINE:-lent $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) host (device tool)}"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device/KINDS.md
steps="${STEPS:-6}"
logs="${LOGS:-/tmp/rl-grpo-logs}"
status=0

# Server dependencies the GPU image lacks (its package list: device/KINDS.md), at this machine's versions.
WHEELS="grpcio protobuf grpcio-health-checking pydantic pydantic-core annotated-types typing-inspection
typing-extensions cryptography cffi pycparser kubernetes durationpy websocket-client requests-oauthlib oauthlib
aiohttp-retry urllib3 xxhash prometheus-client"

wheels() {
  local py="${PY_HERE:-.venv/bin/python}" dir="${WHL_DIR:-.whl}" pins
  pins=$("$py" -c "import sys
from importlib.metadata import version
print(' '.join(f'{n}=={version(n)}' for n in sys.argv[1:]))" $WHEELS) || return 1
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64 \
    -d "$dir" $pins && ls -la "$dir" && du -sh "$dir"
}

install() {  # the server dependencies from .whl/, then the project from this tree, into $SITE
  local deps=() site="${SITE:-/tmp/site}"
  for w in "${WHL_DIR:-.whl}"/*.whl; do [[ -e "$w" && "$(basename "$w")" != timeslice_dra-* ]] && deps+=("$w"); done
  if ((${#deps[@]})); then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${deps[@]}" \
      || return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target "$site" . || return 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
}

extra_of() { [ -n "${EXTRA_GB:-}" ] && { echo "$EXTRA_GB"; return; }; case "$1" in a) echo 7 ;; b) echo 45 ;; c) echo 19 ;; esac; }
jobs_of() { [ -n "${JOBS:-}" ] && { echo "$JOBS"; return; }; case "$1" in a) echo 2 ;; b) echo 3 ;; c) echo 4 ;; esac; }
tag="${TAG:-h200}"

run() {  # bench/rl_grpo.py with the common flags; a failed run (a lost job, states that differ) fails the call
  python3 bench/rl_grpo.py --steps "$steps" --reward-seconds "${REWARD_SECONDS:-3}" \
    --job-timeout "${JOB_TIMEOUT:-480}" ${POOL_GB:+--pool-gb "$POOL_GB"} "$@" ${BENCH_FLAGS:-} \
    || { echo "stage failed: $*" >&2; status=1; }
}

trap '[ -d "$logs" ] && [ "$out" != - ] && tar czf "$out/logs.tgz" -C "$(dirname "$logs")" "$(basename "$logs")"' EXIT
if [ "${1:-}" != wheels ]; then
  install || { echo "installing the project into ${SITE:-/tmp/site} failed" >&2; exit 1; }
fi
for stage in "$@"; do
  case "$stage" in
    wheels) wheels || exit 1 ;;
    hugepages)  # the host's one-time set-up that `timeslice serve` uses when present (docs/one-box.md): 2 MiB huge
      # pages reserved for the pinned pool (as many as serve's default pool takes on this host, or HUGEPAGES_GB;
      # HUGEPAGES_GB=0 gives them back: the pool is on /dev/shm again) and a hugetlbfs mount; the call fails when the
      # host refuses either
      if [ "${HUGEPAGES_GB:-}" = 0 ]; then echo 0 > /proc/sys/vm/nr_hugepages; grep -E '^HugePages_Total' /proc/meminfo; continue; fi
      mountpoint -q /dev/hugepages || { mkdir -p /dev/hugepages && mount -t hugetlbfs -o pagesize=2M none /dev/hugepages; } \
        || { echo "no hugetlbfs mount" >&2; exit 1; }
      pages=$(python3 -c "
from timeslice.cli.serve import gpus
from timeslice.driver.host_ranges import default_size
gb = '${HUGEPAGES_GB:-}'
print(-(-(int(float(gb) * 1e9) if gb else default_size(sum(g.total for g in gpus()), None)) // 2097152))") || exit 1
      echo "$pages" > /proc/sys/vm/nr_hugepages
      grep -E '^Huge' /proc/meminfo
      [ "$(cat /proc/sys/vm/nr_hugepages)" -ge "$pages" ] || { echo "the host reserved fewer than $pages huge pages" >&2; exit 1; }
      ;;
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
      python3 -c "
import google.protobuf, grpc, pydantic, torch, transformers, timeslice.cli.main, timeslice.controller.orchestrator.server
print('protobuf', google.protobuf.__version__, 'grpc', grpc.__version__, 'pydantic', pydantic.VERSION,
      'torch', torch.__version__, 'transformers', transformers.__version__, 'timeslice from', timeslice.__file__)"
      command -v timeslice
      ;;
    vmm-switch)
      python3 bench/vmm_switch.py --gb "${GB:-50}" --switches 10 --out "$out/vmm-switch-h200.json" \
        || { echo "stage failed: $stage" >&2; status=1; } ;;
    solo-a|solo-b|solo-c)
      shape="${stage#solo-}"
      mkdir -p "$logs/$stage"
      run --jobs "$(jobs_of "$shape")" --extra-gb "$(extra_of "$shape")" --backends \
        --save-solo "$out/solo-$shape.json" --logs "$logs/$stage" ;;
    a|a-*|b|b-*|c|c-*)
      IFS=- read -r shape mode backend <<<"$stage"
      modes=(${mode:-serve agent})
      backends=(${backend:-cuda cooperative})
      solo="${SOLO:-$out/solo-$shape.json}"
      if [ -f "$solo" ]; then solo_flag=(--solo-json "$solo"); else solo_flag=(--save-solo "$solo"); fi
      declared=(); suffix=""
      if [ -n "${DECLARE:-}" ]; then declared=(--declare-memory); suffix="-declared"; fi
      mkdir -p "$logs/$stage$suffix"
      run --jobs "$(jobs_of "$shape")" --extra-gb "$(extra_of "$shape")" --modes "${modes[@]}" \
        --backends "${backends[@]}" "${solo_flag[@]}" "${declared[@]}" --logs "$logs/$stage$suffix" \
        --out "$out/rl-grpo-$stage$suffix-$tag.json" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit "$status"
