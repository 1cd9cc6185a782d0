"""MemoryReports: a group's memory as its node agents report it, and a switch's waits for memory to be freed.

Used by `SwitchCoordinator` (switch.py). `memory` is its report (`Switcher.memory`, read by the group's
moves, exits and in-flight checks): the agents' `GetMemory` answers merged into one `MemorySnapshot`
(memory_snapshot.py), completed on a one-GPU `cooperative` group by what its processes registered.
`freed` and `room_for` are checks of the switch transaction: an acknowledged checkpoint counts once
NVML shows its memory freed, and a rollback restores once the GPUs have room for the checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from timeslice.controller.orchestrator.agent_pool import AgentPool
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.cooperative import CooperativeJobs
from timeslice.controller.orchestrator.memory_snapshot import DeviceMemory, MemorySnapshot, agent_of
from timeslice.driver import names

log = logging.getLogger("timeslice.switch")

# A cooperative checkpoint counts once NVML shows this fraction of its acknowledged bytes
# freed (the rest: allocator rounding), and a job evicted with no process to command (it
# ended after the plan) once this fraction of what it held is, checked every
# FREED_POLL_SECONDS for at most FREED_TIMEOUT_SECONDS; otherwise the switch rolls back
# (nothing is placed on memory that is not free).
FREED_FRACTION = 0.9
FREED_POLL_SECONDS = 0.05
FREED_TIMEOUT_SECONDS = 10.0


class MemoryReports:
    """`pool`: the node-agent clients; `cooperative`: the processes of `cooperative` groups,
    which tell what they registered."""

    def __init__(self, pool: AgentPool, cooperative: CooperativeJobs) -> None:
        self._pool = pool
        self.cooperative = cooperative

    async def memory(self, spec: GroupSpec, jobs: Sequence[str], watch: float = 0.0,
                     low_free: int = 0, *, for_plan: bool = True) -> MemorySnapshot:
        """One snapshot of the group's memory from all its node agents (in parallel). An
        agent that does not answer is left out (logged, and named in `unanswered`); its
        devices are then unknown.
        `watch` > 0 seconds: each agent samples its GPUs for that long or until one has less
        than `low_free` bytes free (`AgentClient.memory`), and the snapshot carries each
        job's peak over the samples. `for_plan` (and no watch): on `cooperative`, the
        processes are asked for their registered bytes first (`CooperativeJobs.refresh`);
        a switch checking NVML within its own steps passes False."""
        targets = list(spec.agents)
        asked = time.monotonic()  # (what is counted is as of the asking: a process that starts meanwhile is not)
        reports = await asyncio.gather(*(self._pool.get(t).memory([(j, spec.member(j)) for j in jobs], watch, low_free)
                                         for t in targets), return_exceptions=True)
        snap = MemorySnapshot(taken_at=asked)
        for target, rep in zip(targets, reports):
            if isinstance(rep, BaseException):
                log.warning("memory report failed group=%s agent=%s: %s", spec.id, target, rep)
                snap.unanswered.add(target)
                continue
            for uuid, (total, free) in rep.gpus.items():
                snap.devices[f"{target}/{uuid}"] = DeviceMemory(total, free)
            snap.exiting_bytes.update({f"{target}/{u}": n for u, n in rep.exiting.items()})
            snap.busy |= rep.busy
            for job, per in rep.device_bytes.items():
                snap.device_bytes.setdefault(job, {}).update({f"{target}/{u}": b for u, b in per.items()})
            for job, per in rep.checkpointed_bytes.items():
                snap.checkpointed_bytes.setdefault(job, {}).update({f"{target}/{u}": b for u, b in per.items()})
            for job, per in rep.peak_bytes.items():
                snap.peak_bytes.setdefault(job, {}).update({f"{target}/{u}": b for u, b in per.items()})
            for job, procs in rep.processes.items():
                snap.processes.setdefault(job, set()).update(f"{target}/{n}" for n in procs)
            snap.host_available[target] = rep.host_available
            if rep.incarnation:
                snap.incarnations[target] = rep.incarnation
        if spec.backend == names.BACKEND_COOPERATIVE:
            if for_plan and not watch:
                await self.cooperative.refresh(spec.id, jobs)  # sizes as the processes see them now
            self.cooperative.reap()  # what the processes gone for good registered counts for nobody
            if len(snap.devices) == 1:
                self._cooperative_bytes(spec, jobs, snap)
        return snap

    def _cooperative_bytes(self, spec: GroupSpec, jobs: Sequence[str], snap: MemorySnapshot) -> None:
        """Complete `snap` of a one-GPU cooperative group from what the processes registered:
        the pool's free bytes as host memory, checkpoint sizes, what can leave the GPU."""
        (dev,) = snap.devices
        pool = self.cooperative.pool
        if pool is not None:  # a checkpoint lands wholly in the pool's free ranges, else in host memory
            snap.pool_free[agent_of(dev)] = pool.size - pool.used_bytes
        for job in jobs:  # what the job's processes registered is what they hold when restored
            n = self.cooperative.registered_bytes(spec.id, job)
            if self.cooperative.checkpointed(spec.id, job):
                if n:
                    snap.checkpointed_bytes.setdefault(job, {}).setdefault(dev, n)
            elif not self.cooperative.connected(spec.id, job):
                snap.movable_bytes[job] = {dev: 0}  # no stream to command: what it holds cannot leave
            else:
                snap.movable_bytes[job] = {dev: n}  # only what it registered leaves the GPU
                if n and not snap.device_bytes.get(job):  # NVML does not see it (another PID namespace)
                    snap.device_bytes[job] = {dev: n}
                    snap.unseen.add(job)

    async def freed(self, spec: GroupSpec, jobs: Sequence[str], before: MemorySnapshot, nbytes: int,
                    room: int = 0, by_device: bool = False, exited: bool = False) -> str | None:
        """None once NVML shows `nbytes` freed by `jobs` since `before`: what their acknowledged
        checkpoints moved (a cooperative process answers once it dropped its tensors; the
        CUDA caching allocator or a late stream may still hold them), plus all that those
        with no process to command held (they are exiting: a job that ended between the
        plan and its checkpoint frees its memory only when its processes are gone). Per job
        by its processes' bytes where NVML sees them, else by the devices' free bytes (also
        once a job's processes are no longer told as its own: their PIDs leave /proc before
        the driver has freed their memory).
        With `room`, also until the GPUs have that many bytes free; `by_device`: by the devices'
        free bytes only (a job's processes changed meanwhile); `exited`: also until no ended process
        holds memory on the group's GPUs (`MemorySnapshot.exiting_bytes`). Polled every
        `FREED_POLL_SECONDS` for at most `FREED_TIMEOUT_SECONDS`; else why not (a node agent
        that does not answer shows nothing freed: schedules seed 5112, the agent killed as a
        job ended, a restore ran beside the ended job's 82 MB and ran out of memory)."""
        if before.unanswered:
            agents = ", ".join(sorted(before.unanswered))
            return f"node agent(s) {agents} did not answer: the GPU memory freed is unknown"
        if not before.devices:
            return None  # no GPU report (no NVML): nothing to check against
        seen = list(jobs) if not by_device and all(sum(before.on_device(j).values()) and j not in before.unseen
                                                   for j in jobs) else []
        want = int(FREED_FRACTION * nbytes)
        free0 = sum(d.free for d in before.devices.values())
        deadline = time.monotonic() + FREED_TIMEOUT_SECONDS
        dropped = 0
        while True:
            now = await self.memory(spec, jobs, for_plan=False)  # NVML only, every FREED_POLL_SECONDS
            if not now.unanswered:
                freed = sum(d.free for d in now.devices.values()) - free0
                if seen:
                    dropped = sum(sum(before.on_device(j).values()) - sum(now.on_device(j).values()) for j in seen)
                    if any(not now.on_device(j) for j in seen):
                        # none of a job's processes is told as its own now: ended, or only its PIDs gone from
                        # /proc while the driver still frees their memory (schedules seed 36: a restored job grew
                        # into the 78 MB of one that had just ended): the devices' free bytes must show it
                        dropped = min(dropped, freed)
                else:
                    dropped = freed
                enough = not nbytes or dropped >= want  # (nothing to see freed: only the room counts)
                if not now.devices or (enough and sum(d.free for d in now.devices.values()) >= room
                                       and not (exited and now.exiting_bytes)):
                    return None
            if time.monotonic() >= deadline:
                log.error("checkpoint acknowledged but not freed group=%s jobs=%s: %d of %d bytes freed%s", spec.id,
                          list(jobs), dropped, nbytes, " (a node agent did not answer)" if now.unanswered else "")
                return (f"the GPU memory was not freed within {FREED_TIMEOUT_SECONDS:.0f} s (NVML"
                        + ("; a node agent did not answer" if now.unanswered else "") + ")")
            await asyncio.sleep(FREED_POLL_SECONDS)

    async def room_for(self, spec: GroupSpec, jobs: Sequence[str]) -> dict[str, int]:
        """{} once every device where `jobs` have checkpoints has that many bytes free (polled every
        `FREED_POLL_SECONDS` for at most `FREED_TIMEOUT_SECONDS`), else the bytes each device lacks.
        A report that a node agent did not answer cannot tell: {} (the restore itself then says)."""
        deadline = time.monotonic() + FREED_TIMEOUT_SECONDS
        while True:
            now = await self.memory(spec, jobs, for_plan=False)
            if now.unanswered:
                return {}
            need: dict[str, int] = {}
            for job in jobs:
                for dev, n in now.checkpointed_bytes.get(job, {}).items():
                    need[dev] = need.get(dev, 0) + n
            short = {dev: n - now.devices[dev].free for dev, n in need.items()
                     if dev in now.devices and n > now.devices[dev].free}
            if not short or time.monotonic() >= deadline:
                return short
            await asyncio.sleep(FREED_POLL_SECONDS)
