"""Which processes of a job share GPU memory with each other through NCCL (issue 14, item 0).

Owned by the node agent; the `cuda` and `cuda-checkpoint` backends ask before they lock
anything. The CUDA checkpoint API locks and checkpoints processes whose GPU memory other
processes map (NCCL's peer-to-peer transport, which passes cuMem handles between the
ranks), but restoring them fails with CUDA_ERROR_NOT_SUPPORTED and unlocking with
CUDA_ERROR_ILLEGAL_STATE, so every rank is stuck for good (measured on two H200s, driver
580.159.04, torch 2.11, NCCL 2.28; with NCCL_CUMEM_ENABLE=0 restore fails with
CUDA_ERROR_INVALID_VALUE). With NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 both ranks
checkpoint and restore and the next all-reduce is right (bench/results, issue 14).

The mappings leave no trace outside the processes (no /dev/shm file, no extra device node:
bench/nccl_probe.py on two H200s), so the rule reads what can be read: two or more of the
job's processes with a CUDA context on different GPUs (NVML) that have NCCL loaded
(`libnccl` in /proc/PID/maps) and were started without both variables (/proc/PID/environ:
the environment at exec, so a program that sets them itself is still refused; set them in
the container, e.g. TimeSliceConfig `ncclPeerTransports: false`). Ranks on different
nodes are each alone on their node's agent, and NCCL talks between them over the network:
they pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from timeslice.driver.names import NCCL_NO_PEER_MEMORY_ENV


@dataclass(frozen=True)
class SharedGpuMemory:
    """Processes of one job that NCCL may let map each other's GPU memory."""

    pids: tuple[int, ...]
    gpus: tuple[int, ...]  # NVML indices they hold contexts on

    def message(self, backend: str) -> str:
        return (f"processes {', '.join(map(str, self.pids))} of this job run NCCL on GPUs "
                f"{', '.join(map(str, self.gpus))} without NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1, so their GPU "
                f"memory may be mapped by each other (NCCL peer-to-peer): backend {backend} could checkpoint them but "
                "not restore them (CUDA_ERROR_NOT_SUPPORTED; every rank would stay stuck), so nothing was locked. "
                "Use backend cooperative (each rank moves its own state), or start the job with NCCL_P2P_DISABLE=1 "
                "NCCL_SHM_DISABLE=1 (TimeSliceConfig ncclPeerTransports: false sets them in the claim's containers)")


def _uses_nccl(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libnccl" in line for line in f)
    except OSError:  # gone meanwhile: the step finds out
        return False


def _safe_env(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return True
    return all(env.get(k.encode()) == v.encode() for k, v in NCCL_NO_PEER_MEMORY_ENV.items())


def shared_gpu_memory(pids: Sequence[int], gpus_of: Mapping[int, set[int]]) -> SharedGpuMemory | None:
    """The job's processes that NCCL may have joined by peer mappings, when there are at
    least two on different GPUs; else None. `gpus_of`: pid -> NVML indices of the GPUs it
    has a context on (processes not in it have none). Reads /proc; never raises."""
    risky = [p for p in pids if gpus_of.get(p) and _uses_nccl(p) and not _safe_env(p)]
    gpus = sorted({g for p in risky for g in gpus_of[p]})
    if len(risky) < 2 or len(gpus) < 2:
        return None
    return SharedGpuMemory(tuple(risky), tuple(gpus))
