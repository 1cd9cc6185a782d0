"""ProcessResolver: which host PIDs on this node belong to a job.

Owned by the node agent. `StaticProcessResolver` is filled by whoever starts the
processes (the demo, tests, a standalone node). In a cluster the kubelet plugin
resolves claim -> pods -> cgroup PIDs instead (issue "DRA kubelet plugin").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from timeslice.driver.errors import NotFound
from timeslice.kubelet_plugin.agent import procfs


class ProcessResolver(Protocol):
    async def pids(self, job_id: str) -> list[int]:
        """Host PIDs of `job_id` on this node; raises NotFound when there are none."""
        ...


class StaticProcessResolver:
    """Jobs' PIDs as told by whoever starts them. `descendants`: a job is also every live
    descendant of its PIDs (a launcher such as torchrun, whose ranks it starts; the
    launcher itself has no CUDA context and is skipped by the CUDA backends)."""

    def __init__(self, jobs: dict[str, Sequence[int]] | None = None, descendants: bool = False) -> None:
        self._jobs: dict[str, list[int]] = {j: list(p) for j, p in (jobs or {}).items()}
        self._descendants = descendants

    def set(self, job_id: str, pids: Sequence[int]) -> None:
        self._jobs[job_id] = list(pids)

    def remove(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    async def pids(self, job_id: str) -> list[int]:
        pids = self._jobs.get(job_id)
        if not pids:
            raise NotFound(f"no processes known for job {job_id!r} on this node")
        if not self._descendants:
            return list(pids)
        out = list(pids)
        for pid in pids:
            out.extend(p for p in procfs.descendants(pid) if p not in out)
        return out
