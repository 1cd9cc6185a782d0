"""ProcessResolver: which host PIDs on this node belong to a job.

Owned by the node agent. `StaticProcessResolver` is filled by whoever starts the
processes (the demo, tests, a standalone node). In a cluster the kubelet plugin
resolves claim -> pods -> cgroup PIDs instead (issue "DRA kubelet plugin").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from timeslice.driver.errors import NotFound


class ProcessResolver(Protocol):
    async def pids(self, job_id: str) -> list[int]:
        """Host PIDs of `job_id` on this node; raises NotFound when there are none."""
        ...


class StaticProcessResolver:
    def __init__(self, jobs: dict[str, Sequence[int]] | None = None) -> None:
        self._jobs: dict[str, list[int]] = {j: list(p) for j, p in (jobs or {}).items()}

    def set(self, job_id: str, pids: Sequence[int]) -> None:
        self._jobs[job_id] = list(pids)

    def remove(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    async def pids(self, job_id: str) -> list[int]:
        pids = self._jobs.get(job_id)
        if not pids:
            raise NotFound(f"no processes known for job {job_id!r} on this node")
        return list(pids)
