"""The `cooperative` backend: job processes move their own registered GPU state on command.

Owned by the orchestrator; used by `SwitchCoordinator` in place of node agents for groups
whose backend is `cooperative`, and by the servicer's `MemoryCommands` /
`AckMemoryCommand` RPCs. A process that registered state (`timeslice.torch.register`)
keeps a `MemoryCommands` stream open, also between its phases; a checkpoint sends it
"checkpoint" (copy to host memory, free the device memory, acknowledge with the bytes),
a restore sends "restore" (copy back into the same tensors). With a `PinnedPool` the
checkpoint lands in the node's shared pinned pool, in the free ranges this class hands
out (all of them, in order, then trimmed to what the process used); a process whose
state does not fit in the free total keeps its own host copy instead (`pinned=False`).

A process is one stream (`stream_id`); a reconnect with the same id (the orchestrator
was briefly unreachable) takes over its entry, checkpoint included. The entry of a
checkpointed process whose stream ends is kept (its bytes are still in the pool) until
it reconnects, its job is forgotten (`forget`), or a restore finds it gone for longer
than `RECONNECT_GRACE_SECONDS` (its state went with it).

`CooperativeJobs` serves the streams and answers them, and the switch's steps and
questions, from its parts: `cooperative_processes.py` (`Processes`: each job's processes,
connected or departed; `Commands`: the commands awaiting their answers),
`cooperative_steps.py` (`CooperativeSteps`: checkpoints and restores, departing jobs,
late answers) and `cooperative_records.py` (`CheckpointRecords`: the pool's ranges, the
state file, restarts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from timeslice.controller.orchestrator.agents import StepResult
from timeslice.controller.orchestrator.cooperative_processes import PIN, Commands, Process, Processes
from timeslice.controller.orchestrator.cooperative_records import CheckpointRecords
from timeslice.controller.orchestrator.cooperative_steps import CooperativeSteps
from timeslice.controller.orchestrator.pinned_pool import PinnedPool
from timeslice.controller.orchestrator.state_file import StateFile
from timeslice.v1 import orchestrator_pb2 as pb

log = logging.getLogger("timeslice.cooperative")
# Seconds a plan waits for the processes' "report" of their registered bytes (a process
# busy in a long command answers later; its last known size stands meanwhile).
REPORT_TIMEOUT_SECONDS = 1.0


class CooperativeJobs:
    """The connected cooperative processes by (group, job), and their pending commands."""

    def __init__(self, pool: PinnedPool | None = None, state: StateFile | None = None,
                 on_lost: Callable[[str, str, str], None] | None = None,
                 on_learned: Callable[[str, str], None] | None = None,
                 on_streams_closed: Callable[[str, str], None] | None = None,
                 on_started: Callable[[str, str], None] | None = None) -> None:
        """`state`: where checkpoints into `pool` persist (`adopt` reads them back);
        `on_lost(group, job, reason)`: a job's checkpoint cannot be proven intact (it must
        fail); `on_learned(group, job)`: a checkpoint its process reported, one the
        orchestrator had no record of or a recorded one it confirmed after a restart (the
        group must restore the job before it computes);
        `on_streams_closed(group, job)`: the last open stream of a job closed;
        `on_started(group, job)`: a new process of a job connected with no checkpoint of its
        own while no other process of the job is connected: the job started (again: its
        memory grows from nothing as at its first start), or, after an orchestrator restart,
        a process with its state on the GPU came back (taken as started: it settles again)."""
        self._on_streams_closed = on_streams_closed
        self._on_started = on_started
        self._processes = Processes()
        self._commands = Commands()
        self._records = CheckpointRecords(self._processes, pool, state, on_lost, on_learned)
        self._steps = CooperativeSteps(self._processes, self._commands, self._records)
        self._pinning: set[str] = set()  # groups whose processes pin the pool ahead (`pin_ahead`)

    @property
    def pool(self) -> PinnedPool | None:
        return self._records.pool

    # -- the process side (RPCs) -------------------------------------------------
    async def stream(self, group: str, job: str, stream_id: str, pid: int, registered: int,
                     report: pb.PoolCheckpoint | None = None) -> AsyncIterator[pb.MemoryCommand]:
        """Commands for one process, starting with "hello"; runs until the caller goes away.
        `report`: the process's checkpoint as it says (None: its state is on the GPU)."""
        procs = self._processes.connecting(group, job)
        p = procs.get(stream_id)
        if p is None:
            started = report is None and not any(q.connected for q in procs.values()) and \
                not self._processes.reconnecting(group, job, stream_id)
            p = Process(group, job, stream_id, pid, registered)
            self._processes.add(p)
            if report is not None:
                self._records.learn(p, report)
            if started and self._on_started is not None:
                self._on_started(group, job)
        else:
            self._reconnected(p, pid, registered, report)
        log.info("cooperative process connected group=%s job=%s pid=%d registered_bytes=%d checkpointed=%s",
                 group, job, pid, registered, p.checkpointed)
        mine = p.commands
        try:
            yield pb.MemoryCommand(op_id="hello", kind="hello", pool_path=str(self.pool.path) if self.pool else "",
                                   pool_bytes=self.pool.size if self.pool else 0)
            if group in self._pinning:
                yield PIN
            while True:
                yield await mine.get()
        finally:
            if p.commands is mine:  # not taken over by a reconnect
                p.connected, p.disconnected_at = False, time.monotonic()
                self._commands.fail_pending(p)
                self._processes.closed(p, procs)
                log.info("cooperative process disconnected group=%s job=%s pid=%d checkpointed=%s", group, job,
                         p.pid, p.checkpointed)
                if self._on_streams_closed is not None and not self.connected(group, job):
                    self._on_streams_closed(group, job)

    def _reconnected(self, p: Process, pid: int, registered: int, report: pb.PoolCheckpoint | None) -> None:
        """A process's stream reconnected: it keeps its checkpoint; the commands the old stream
        never sent fail now (the old stream's close fails nothing once the new one owns it)."""
        old = p.commands
        p.connected, p.pid, p.registered, p.commands = True, pid, registered, asyncio.Queue()
        self._commands.fail_unsent(p, old)
        if p.adopted or p.offered:  # (offered: its stream closed before it answered a checkpoint)
            self._records.confirm(p, report)
        elif p.checkpointed and report is not None and p.checksum is None:
            p.checksum = report.checksum
            self._records.persist()

    def pin_ahead(self, group: str) -> None:
        """Tell `group`'s processes, now and whenever one connects, to register the pinned pool
        with CUDA ahead of need ("pin", no answer): a grant may move memory from now on. Before
        that they pin nothing: each process registers the whole pool, host memory locked and
        work that no move of jobs that fit together ever uses (docs/one-box.md)."""
        if self.pool is None or group in self._pinning:
            return
        self._pinning.add(group)
        procs = [p for p in self._processes.all() if p.group == group and p.connected]
        for p in procs:
            p.commands.put_nowait(PIN)
        log.info("cooperative processes pin the pool ahead group=%s processes=%d (a grant may move memory)", group,
                 len(procs))

    def ack(self, ack: pb.MemoryCommandAck) -> None:
        """`CooperativeSteps.ack`."""
        self._steps.ack(ack)

    # -- the switch side -----------------------------------------------------------
    def registered_bytes(self, group: str, job: str) -> int:
        return self._processes.registered_bytes(group, job)


    async def refresh(self, group: str, jobs: Sequence[str]) -> None:
        """Ask every connected, resident process of `jobs` for its registered bytes now (a
        "report" command): a process registers before its model and optimizer exist, so
        the size it sent when its stream opened says too little (issue 21: residents that
        looked empty were never moved out). No answer within `REPORT_TIMEOUT_SECONDS`
        leaves the last known size; nothing is raised."""
        procs = [p for job in jobs for p in self._processes.of(group, job).values()
                 if p.connected and not p.checkpointed and not p.unanswered]
        results = await asyncio.gather(*(self._steps.command(p, "report", [], REPORT_TIMEOUT_SECONDS) for p in procs),
                                       return_exceptions=True)
        for p, r in zip(procs, results):
            if isinstance(r, BaseException):
                log.debug("no report group=%s job=%s pid=%d: %s", group, p.job, p.pid, r)

    def checkpointed(self, group: str, job: str) -> bool:
        return self._processes.checkpointed(group, job)

    def connected(self, group: str, job: str) -> bool:
        """`Processes.connected`."""
        return self._processes.connected(group, job)

    def departing(self, group: str, job: str) -> bool:
        """`Processes.departing`."""
        return self._processes.departing(group, job)

    def unconfirmed(self, group: str, job: str) -> bool:
        """`Processes.unconfirmed`."""
        return self._processes.unconfirmed(group, job)

    async def checkpoint(self, group: str, job: str, timeout: float) -> StepResult:
        """`CooperativeSteps.checkpoint`."""
        return await self._steps.checkpoint(group, job, timeout)

    def check_restore(self, group: str, job: str) -> None:
        """`CooperativeSteps.check_restore`."""
        self._steps.check_restore(group, job)

    async def restore(self, group: str, job: str, timeout: float) -> StepResult:
        """`CooperativeSteps.restore`."""
        return await self._steps.restore(group, job, timeout)

    def forget(self, group: str, job: str) -> None:
        """The job is gone: drop its processes and free their pool ranges."""
        for p in self._processes.forget(group, job):
            self._steps.forget(p)
        self._records.persist()

    def reap(self) -> None:
        """`CooperativeSteps.reap`."""
        self._steps.reap()

    # -- restarts ------------------------------------------------------------------
    def adopt(self) -> dict[str, set[str]]:
        """`CheckpointRecords.adopt`."""
        return self._records.adopt()

    def keep_pool_if_in_use(self) -> None:
        """`CheckpointRecords.keep_pool_if_in_use`."""
        self._records.keep_pool_if_in_use()

    async def close(self) -> None:
        self._steps.close()
        self._records.close()
