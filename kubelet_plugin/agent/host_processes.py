"""Which host processes belong to a job outside Kubernetes.

Owned by the node agent of one-box mode (`timeslice serve`: `PeerProcessResolver`) and
of a standalone node (`timeslice node-agent`: `EnvironProcessResolver`). A job's
candidates are the processes whose environment names it (`TIMESLICE_JOB=<job>`) and, in
one-box mode, the process groups or cgroups of the clients that acted for it (`PeerJobs`,
bound by the orchestrator's peer authenticator). As on a cluster node (`pod_processes.py`)
they are narrowed to those with a CUDA context on this machine's GPUs (NVML) or, without
NVML, to those marked TIMESLICE_ACCELERATOR_PROCESS=1 (so a CPU job's client process,
which must keep running to ask for the lock again, is never frozen).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from timeslice.driver.errors import NotFound
from timeslice.driver.peercred import PeerJobs, environ
from timeslice.kubelet_plugin.agent import model_gpu, procfs
from timeslice.kubelet_plugin.agent.pod_processes import cuda_pids_on, marked

log = logging.getLogger("timeslice.agent")
JOB_ENV = b"TIMESLICE_JOB="


def all_gpu_uuids() -> set[str]:
    """UUIDs of every NVIDIA GPU here (NVML); empty without NVML, and with
    `$TIMESLICE_MODEL_GPU` (tests only: its processes hold no CUDA context, so they are found
    by their TIMESLICE_ACCELERATOR_PROCESS mark, as without NVML; on a GPU host NVML named
    none of them and the agent moved nothing: the randomized schedules on the lent H200 host)."""
    if model_gpu.from_env() is not None:
        return set()
    try:
        import pynvml

        pynvml.nvmlInit()
        return {str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(int(pynvml.nvmlDeviceGetCount()))}
    except Exception:
        return set()


class _HostResolver:
    """`cuda_pids(gpu uuids)`: PIDs with a CUDA context on them, None without NVML."""

    def __init__(self, proc: Path = Path("/proc"), cuda_pids: Callable[[set[str]], set[int] | None] = cuda_pids_on,
                 gpu_uuids: Callable[[], set[str]] = all_gpu_uuids) -> None:
        self._proc = proc
        self._cuda_pids = cuda_pids
        self._gpus = gpu_uuids

    async def pids(self, job_id: str) -> list[int]:
        """Raises NotFound when the job has no such process (a job with nothing to move is
        a valid member: the agent then checkpoints and restores zero processes)."""
        return await asyncio.to_thread(self._pids, job_id)

    async def processes(self, job_id: str) -> list[int]:
        """Every live candidate of `job_id` (`ProcessResolver.processes`)."""
        return await asyncio.to_thread(lambda: [p for p in self._candidates(job_id)[0] if procfs.alive(p)])

    def _candidates(self, job_id: str) -> tuple[list[int], str]:
        """(candidate PIDs, where they were looked for): the subclass's rule."""
        raise NotImplementedError

    def _pids(self, job_id: str) -> list[int]:
        candidates, where = self._candidates(job_id)
        gpus = self._gpus()
        cuda = self._cuda_pids(gpus) if gpus else None
        chosen = [p for p in candidates if p in cuda] if cuda is not None else \
            [p for p in candidates if marked(p, "", self._proc)]
        if not chosen:
            raise NotFound(f"no accelerator processes of job {job_id!r} here ({len(candidates)} processes {where})")
        log.debug("resolved job=%s pids=%s (%s)", job_id, chosen, where)
        return chosen


class PeerProcessResolver(_HostResolver):
    """One-box mode: the processes of the job's scopes from `jobs` (and their descendants that
    left them), and its owner's processes started with TIMESLICE_JOB=<job> (`peercred.named`)."""

    def __init__(self, jobs: PeerJobs, proc: Path = Path("/proc"),
                 cuda_pids: Callable[[set[str]], set[int] | None] = cuda_pids_on,
                 gpu_uuids: Callable[[], set[str]] = all_gpu_uuids) -> None:
        super().__init__(proc, cuda_pids, gpu_uuids)
        self._jobs = jobs

    async def alive(self, job_ids: Sequence[str]) -> dict[str, bool | None]:
        """Also False: the job had processes bound and none is left (`PeerJobs.gone`: known
        across a restart of serve, from the bindings in its state dir). On the event loop, as
        serve binds jobs there (a scan of /proc per job at most: milliseconds)."""
        def alive(job: str) -> bool | None:
            if self._jobs.processes(job, self._proc):
                return True
            return False if self._jobs.gone(job, self._proc) else None
        return {j: alive(j) for j in job_ids}

    def _candidates(self, job_id: str) -> tuple[list[int], str]:
        scopes = ", ".join(str(s) for s, _ in self._jobs.scopes(job_id)) or "no live scope"
        return self._jobs.processes(job_id, self._proc), f"in {scopes} or named by TIMESLICE_JOB"


class EnvironProcessResolver(_HostResolver):
    """A standalone node: the processes whose environment has TIMESLICE_JOB=<job> (set by
    whoever starts the job; children inherit it), of any user (the agent runs as root to
    move them), never this process."""

    async def alive(self, job_ids: Sequence[str]) -> dict[str, bool | None]:
        """One scan of /proc for all of `job_ids` (`ProcessResolver.alive`)."""
        def named() -> set[bytes]:
            return {e for p in _pids(self._proc) for e in environ(p, self._proc) if e.startswith(JOB_ENV)}
        found = await asyncio.to_thread(named)
        return {j: True if JOB_ENV + j.encode() in found else None for j in job_ids}

    def _candidates(self, job_id: str) -> tuple[list[int], str]:
        want = JOB_ENV + job_id.encode()
        return [p for p in _pids(self._proc) if want in environ(p, self._proc)], f"with {want.decode()}"


def _pids(proc: Path) -> Iterable[int]:
    me = os.getpid()
    return (int(e.name) for e in proc.iterdir() if e.name.isdigit() and int(e.name) != me)
