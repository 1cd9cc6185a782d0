"""Which host processes belong to a job in one-box mode (`timeslice serve`).

Owned by the node agent there. A job is made of the process groups or cgroups of the
clients that acted for it (`PeerJobs`, bound by the orchestrator's peer authenticator),
narrowed to the job owner's processes and, as on a cluster node (`pod_processes.py`), to
those with a CUDA context on this machine's GPUs (NVML) or, without NVML, to those
marked TIMESLICE_ACCELERATOR_PROCESS=1 (so a CPU job's client process, which must keep
running to ask for the lock again, is never frozen).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from timeslice.driver.errors import NotFound
from timeslice.driver.peercred import PeerJobs, members
from timeslice.kubelet_plugin.agent.pod_processes import cuda_pids_on, marked

log = logging.getLogger("timeslice.agent")


def all_gpu_uuids() -> set[str]:
    """UUIDs of every NVIDIA GPU here (NVML); empty without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return {str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(int(pynvml.nvmlDeviceGetCount()))}
    except Exception:
        return set()


class PeerProcessResolver:
    """`cuda_pids(gpu uuids)`: PIDs with a CUDA context on them, None without NVML."""

    def __init__(self, jobs: PeerJobs, proc: Path = Path("/proc"),
                 cuda_pids: Callable[[set[str]], set[int] | None] = cuda_pids_on,
                 gpu_uuids: Callable[[], set[str]] = all_gpu_uuids) -> None:
        self._jobs = jobs
        self._proc = proc
        self._cuda_pids = cuda_pids
        self._gpus = gpu_uuids

    async def pids(self, job_id: str) -> list[int]:
        """Raises NotFound when the job has no such process (a job with nothing to move is
        a valid member: the agent then checkpoints and restores zero processes)."""
        return await asyncio.to_thread(self._pids, job_id)

    def _pids(self, job_id: str) -> list[int]:
        scopes = self._jobs.scopes(job_id)
        candidates = sorted({p for scope, uid in scopes for p in members(scope, uid, self._proc)})
        gpus = self._gpus()
        cuda = self._cuda_pids(gpus) if gpus else None
        chosen = [p for p in candidates if p in cuda] if cuda is not None else \
            [p for p in candidates if marked(p, "", self._proc)]
        if not chosen:
            raise NotFound(f"no accelerator processes of job {job_id!r} here ({len(candidates)} processes in "
                           f"{', '.join(str(s) for s, _ in scopes) or 'no scope yet'})")
        log.debug("resolved job=%s scopes=%s pids=%s", job_id, [str(s) for s, _ in scopes], chosen)
        return chosen
