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

    async def alive(self, job_ids: Sequence[str]) -> dict[str, bool | None]:
        """Per job of `job_ids`, whether it has a live process on this node (any of its
        processes, with or without a GPU context): True; False when the resolver knows the
        job had processes and none is left; None when it has none now and cannot tell more
        (the agent's memory of the job decides: `NodeAgent.live_jobs`)."""
        ...

    async def processes(self, job_id: str) -> list[int]:
        """Every live process of `job_id` on this node, with or without a GPU context (those
        `alive` looks at); [] when there is none."""
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

    async def alive(self, job_ids: Sequence[str]) -> dict[str, bool | None]:
        """A job whose PIDs were told is alive while one of them runs, else gone."""
        return {j: any(procfs.alive(p) for p in self._jobs[j]) if self._jobs.get(j) else None for j in job_ids}

    async def processes(self, job_id: str) -> list[int]:
        """The told PIDs that run (and their descendants, with `descendants`)."""
        try:
            return [p for p in await self.pids(job_id) if procfs.alive(p)]
        except NotFound:
            return []

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
