#!/usr/bin/env bash
# Issue 14 on two H200s of one host (device tool, nvidia-h200-x2): two 2-rank data-parallel jobs
# (torchrun, NCCL all-reduce in every train step) one after the other, then sharing both GPUs.
#   bench/rl_grpo_h200x2.sh OUTDIR probe|smoke|refuse|cuda|cooperative ...
# probe: GPU links, and what a 2-rank NCCL job shows from outside (bench/nccl_probe.py)
# smoke: tiny model, 2 steps, both backends (the plumbing, before the long runs)
# refuse: tiny model, NCCL defaults, backend cuda: the node agent must refuse the ranks before
#         locking anything (issue 14, item 0); the shared run is expected to fail with that message
# cuda: NCCL peer-to-peer and shared memory off (the transparent path), residency exclusive (every
#       hand-off checkpoints one job's ranks and restores the other's), 1b model (~8 GB per rank,
#       CUDA_EXTRA_GB more), solo runs measured first
# cooperative: NCCL defaults, residency exclusive, a pinned pool for both jobs (80 GB), ~20 GB per rank (1b model and
#       EXTRA_GB); solo runs measured first
# STEPS steps per job (default 4). SOLO_TRANSPARENT: solo runs saved by an earlier cuda stage (same STEPS).
set -uo pipefail
out="$1"
shift
export TIMESLICE_MACHINE="${TIMESLICE_MACHINE:-lent host with two NVIDIA H200 (device tool, nvidia-h200-x2)}"
export PYTHONUNBUFFERED=1
# multicast stays off on this host (device/KINDS.md): a program that uses it can take the GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
steps="${STEPS:-4}"
extra="${EXTRA_GB:-12}"
cuda_extra="${CUDA_EXTRA_GB:-0}"
run() { python3 bench/rl_grpo.py --jobs 2 --nproc 2 --steps "$steps" --reward-seconds 2 "$@" || echo "stage failed: $*" >&2; }
for stage in "$@"; do
  case "$stage" in
    probe)
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
      nvidia-smi topo -m || true
      python3 -c "import torch, torch.cuda.nccl as n; print('torch', torch.__version__, 'nccl', n.version())"
      python3 bench/nccl_probe.py default transparent
      ;;
    smoke) run --size tiny --steps 2 --nccl-transparent --residency exclusive --backends cuda cooperative \
             --pool-gb 2 --out "$out/smoke.json" ;;
    refuse) run --size tiny --steps 2 --residency exclusive --backends cuda --out "$out/refuse.json" ;;
    cuda)
      if [ -n "${SOLO_TRANSPARENT:-}" ]; then solo=(--solo-json "$SOLO_TRANSPARENT"); else solo=(--save-solo "$out/solo-transparent.json"); fi
      run --nccl-transparent --residency exclusive --extra-gb "$cuda_extra" --backends cuda "${solo[@]}" \
        --out "$out/rl-grpo-ddp-cuda-h200x2.json" ;;
    cooperative) run --residency exclusive --extra-gb "$extra" --backends cooperative --pool-gb 80 \
                   --save-solo "$out/solo-default.json" --out "$out/rl-grpo-ddp-cooperative-h200x2.json" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
