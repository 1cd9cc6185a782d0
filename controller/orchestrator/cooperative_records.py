"""Where the cooperative checkpoints are in the pinned pool, written down and taken back at a restart.

Restarts (`adopt`): every checkpoint into the pool is written to the state file (the ranges
offered before the command is sent, then the bytes its process acknowledged, and the
checksum it reports), so a restarted orchestrator, which reopens the pool file untouched
(`PinnedPool`), knows which ranges nobody else may have. Where each job's state is comes
from its processes, not from the record: the orchestrator may have died after a command ran
and before its answer was recorded (a restore done, a checkpoint taken). Each process reports
its checkpoint (ranges, bytes, checksum), or none (its state on the GPU), when its stream
(re)connects: a report that matches the record confirms it; none frees the recorded ranges;
one the orchestrator has no record of is adopted when its ranges are free; anything else
(another place or checksum, ranges taken by another job) cannot be proven intact, and the job
fails with the reason "checkpoint lost" (`on_lost`), as it does when its client finds the pool
bytes no longer match the checksum at a restore. Until a recorded process has reconnected
(`unconfirmed`) its job may be on the GPU: its checkpoint waits for the reconnect, and its
restore is refused until then (`CooperativeSteps.check_restore`). A reopened pool with no
records (no state file) offers no range for `RECONNECT_GRACE_SECONDS`, while its processes
reconnect and report.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from timeslice.controller.orchestrator import cooperative_processes
from timeslice.controller.orchestrator.cooperative_processes import Process, Processes, Ranges
from timeslice.controller.orchestrator.pinned_pool import PinnedPool
from timeslice.controller.orchestrator.state_file import PoolCheckpoint, StateFile
from timeslice.memory_commands import prefix
from timeslice.v1 import orchestrator_pb2 as pb

log = logging.getLogger("timeslice.cooperative")
# The reason a job whose checkpoint cannot be proven intact fails with (`on_lost`).
LOST_REASON = "checkpoint lost"


class CheckpointRecords:
    """The pinned pool (None: each process keeps its own host copy), the processes'
    checkpoints in it as the state file records them, and what their processes report."""

    def __init__(self, processes: Processes, pool: PinnedPool | None, state: StateFile | None,
                 on_lost: Callable[[str, str, str], None] | None,
                 on_learned: Callable[[str, str], None] | None) -> None:
        """`processes`: whose checkpoints are recorded (`adopt` adds the recorded ones);
        `state`, `on_lost`, `on_learned`: see `CooperativeJobs`."""
        self.pool = pool
        self._processes = processes
        self._state = state
        self._on_lost = on_lost
        self._on_learned = on_learned
        self._quiet_until = 0.0  # monotonic: until then the pool offers nothing (reopened, records unknown)
        self._keep_pool = False

    def offering(self) -> bool:
        """The pool may offer ranges now: not while a reopened pool's checkpoints are unknown."""
        return time.monotonic() >= self._quiet_until

    # -- restarts ------------------------------------------------------------------
    def adopt(self) -> dict[str, set[str]]:
        """Standalone start: take back the checkpoints the state file records (their ranges
        are handed to nobody else; each process confirms its own when it reconnects, or is
        taken as gone after `RECONNECT_GRACE_SECONDS`). Returns group -> its jobs with a
        checkpoint recorded (acknowledged, or its command out): `unconfirmed`, they may be on
        the GPU (the orchestrator may have died after their restore ran, or before their
        checkpoint did); a process that confirms a checkpoint is reported to `on_learned`. A
        record whose ranges do not fit the pool is reported lost (`on_lost`). A reopened pool
        the state file knows nothing of offers no range for the grace (see the module
        docstring)."""
        if self.pool is None:
            return {}
        recorded = self._state.pool_checkpoints() if self._state is not None else None
        records = recorded[1] if recorded is not None else None
        if recorded is not None and recorded[0] != self.pool.path and records:
            # e.g. `timeslice serve` makes a new private pool at each start: those processes still map the old
            # file and restore from it; their ranges are held here too until then (one bookkeeping for both)
            log.warning("the state file's checkpoints are in pinned pool %s, this orchestrator's is %s: their "
                        "processes restore from the file they map", recorded[0], self.pool.path)
        if records is None and self.pool.reopened:
            grace = cooperative_processes.RECONNECT_GRACE_SECONDS
            self._quiet_until = time.monotonic() + grace
            log.warning("pinned pool %s reopened with no record of its checkpoints: no range is offered for %g s, "
                        "while their processes reconnect and report them", self.pool.path, grace)
        found: dict[str, set[str]] = {}
        now = time.monotonic()
        for rec in records or ():
            p = Process(rec.group, rec.job, rec.stream, rec.pid, rec.nbytes or 0, connected=False,
                        disconnected_at=now, adopted=True)
            try:
                self.pool.reserve(list(rec.ranges))
            except ValueError as err:
                self.lost(p, f"its record in the state file does not fit the pool ({err})")
                continue
            self._processes.add(p)
            if rec.nbytes is None:  # a checkpoint command was out: its process says what it did
                p.offered = list(rec.ranges)
            else:
                p.checkpointed, p.pool_ranges, p.nbytes, p.checksum = True, list(rec.ranges), rec.nbytes, rec.checksum
            found.setdefault(rec.group, set()).add(rec.job)
            log.info("cooperative checkpoint adopted group=%s job=%s pid=%d ranges=%d bytes=%s", rec.group, rec.job,
                     rec.pid, len(rec.ranges), rec.nbytes)
        self.persist()
        return found

    def keep_pool_if_in_use(self) -> None:
        """Before the server stops: keep the pool file at `close` when a process maps it or
        is checkpointed in it (a restarted orchestrator reopens it); else it is removed."""
        self._keep_pool = any(p.connected or p.checkpointed or p.offered for p in self._processes.all())

    def learn(self, p: Process, report: pb.PoolCheckpoint) -> None:
        """A checkpoint this orchestrator has no record of, reported by its process."""
        ranges = [(r.offset, r.length) for r in report.ranges]
        if ranges:
            if self.pool is None:
                self.lost(p, "it reports a pinned-pool checkpoint and this orchestrator has no pool")
                return
            try:
                self.pool.reserve(ranges)
            except ValueError as err:  # another job may have written there since
                self.lost(p, f"its pool ranges are not free ({err})")
                return
        p.checkpointed, p.pool_ranges, p.nbytes, p.checksum = True, ranges, report.bytes, report.checksum
        log.warning("cooperative checkpoint learned from its process group=%s job=%s pid=%d ranges=%d bytes=%d",
                    p.group, p.job, p.pid, len(ranges), report.bytes)
        self.persist()
        if self._on_learned is not None:
            self._on_learned(p.group, p.job)

    def confirm(self, p: Process, report: pb.PoolCheckpoint | None) -> None:
        """An adopted process, or one whose stream closed before it answered a checkpoint
        (`p.offered`), reconnected with its `report`: it confirms the record (a
        checkpoint is reported to `on_learned`), says its state is on the GPU, or the state
        is lost."""
        p.adopted = False
        ranges = [(r.offset, r.length) for r in report.ranges] if report is not None else []
        if p.offered:  # the command's answer was never seen: the process says what it did
            offered, p.offered = p.offered, []
            if report is None:
                self.pool.keep(offered, 0)  # type: ignore[union-attr]
            elif ranges == prefix(offered, report.bytes) or not ranges:
                p.checkpointed, p.nbytes, p.checksum = True, report.bytes, report.checksum
                p.pool_ranges = self.pool.keep(offered, report.bytes if ranges else 0)  # type: ignore[union-attr]
                if self._on_learned is not None:
                    self._on_learned(p.group, p.job)
            else:
                self.pool.keep(offered, 0)  # type: ignore[union-attr]
                self.lost(p, f"it reports ranges {ranges} outside those it was offered")
                return
        elif report is None:
            log.warning("cooperative process reconnected with its state on the GPU, recorded as checkpointed "
                        "group=%s job=%s pid=%d: its pool ranges are freed", p.group, p.job, p.pid)
            self.record_restore(p)
            return
        elif (ranges, report.bytes) != (p.pool_ranges, p.nbytes) or \
                (p.checksum is not None and report.checksum != p.checksum):
            self.lost(p, f"it reports {report.bytes} bytes in ranges {ranges} with checksum {report.checksum:#010x}, "
                         f"the state file {p.nbytes} bytes in {p.pool_ranges} with {p.checksum or 0:#010x}")
            return
        else:
            p.checksum = report.checksum
            if self._on_learned is not None:
                self._on_learned(p.group, p.job)
        log.info("cooperative checkpoint confirmed group=%s job=%s pid=%d checkpointed=%s", p.group, p.job, p.pid,
                 p.checkpointed)
        self.persist()

    def lost(self, p: Process, why: str) -> None:
        """`p`'s checkpoint cannot be proven intact: its ranges are freed, its job fails."""
        reason = f"{LOST_REASON}: process {p.pid} of job {p.job}: {why}"
        log.error("cooperative %s group=%s", reason, p.group)
        if self.pool is not None:
            self.pool.release(p.pool_ranges)
            self.pool.keep(p.offered, 0)
        p.pool_ranges, p.offered, p.checkpointed, p.adopted = [], [], False, False
        self.persist()
        if self._on_lost is not None:
            self._on_lost(p.group, p.job, reason)

    # -- a step's outcome ------------------------------------------------------------
    def unoffer(self, p: Process, offered: Ranges) -> None:
        """A checkpoint command did not take its offered ranges: they are free again."""
        if offered and self.pool is not None:
            self.pool.keep(offered, 0)
        p.offered = []

    def record_checkpoint(self, p: Process, offered: Ranges, ack: pb.MemoryCommandAck) -> None:
        if offered and self.pool is not None:
            p.pool_ranges = self.pool.keep(offered, ack.bytes if ack.pinned else 0)
        p.offered, p.checkpointed, p.nbytes, p.checksum = [], True, ack.bytes, None  # reported at a reconnect
        self.persist()

    def record_restore(self, p: Process) -> None:
        if self.pool is not None:
            self.pool.release(p.pool_ranges)
        p.pool_ranges, p.nbytes, p.checksum = [], 0, None
        p.checkpointed = False
        self.persist()

    # -- the state file --------------------------------------------------------------
    def persist(self) -> None:
        """Record where every checkpoint into the pool is (write-ahead for offers: the offers
        wait for the write). A failed write is logged by the state file: the processes'
        reports still tell a restarted orchestrator."""
        if self._state is None or not self._state.persistent or self.pool is None:
            return
        records = [PoolCheckpoint(p.group, p.job, p.stream_id, p.pid,
                                  tuple(p.pool_ranges if p.checkpointed else p.offered),
                                  p.nbytes if p.checkpointed else None, p.checksum if p.checkpointed else None)
                   for p in self._processes.all() if p.checkpointed or p.offered]
        self._state.record_pool(self.pool.path, self.pool.size, records)

    async def persisted(self) -> None:
        """`persist`, and return once it is written (`StateFile.written`)."""
        self.persist()
        if self._state is not None:
            await self._state.written()

    async def durable(self) -> None:
        """`persist`, and return once it is on disk. Raises OSError: the write failed
        (`StateFile.durable`)."""
        self.persist()
        if self._state is not None:
            await self._state.durable()

    def close(self) -> None:
        """Remove the pool file, unless `keep_pool_if_in_use` found it in use."""
        if self.pool is not None and self._keep_pool:
            log.warning("pinned pool kept path=%s: cooperative processes map it or are checkpointed in it (an "
                        "orchestrator started with the same configuration reopens it; remove it once they are gone)",
                        self.pool.path)
        elif self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.close()
