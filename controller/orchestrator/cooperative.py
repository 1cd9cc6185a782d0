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
than `RECONNECT_GRACE_SECONDS` (its state went with it). A checkpoint of a job whose last
stream ended with its state on the GPU (`departing`: exiting, or reconnecting) waits for
a reconnect until the grace has passed; past it, the job exited and nothing is left to
move. A process whose stream closes while a checkpoint command waits for its answer (it
ended right after its release, or was killed) is departing the same way: the checkpoint
waits for it, and a job whose processes all left has nothing to move (the waiter is
granted once NVML shows their memory freed, `SwitchCoordinator`; it never fails on a job
that ended). A command for a process whose stream has already closed (it closed after the
caller looked, during an await) fails at once the same way: it is never queued on a
stream nobody reads, where it would wait out the whole step timeout (300 s by default)
with the group switching. A command that times out leaves the
process's state unknown: it is not moved again
until it answers, and its late answer is recorded (a late checkpoint is rolled back at
once); its client also restores by itself when a grant finds its state out.

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
restore is refused until then (`check_restore`). A reopened pool with no records (no state
file) offers no range for `RECONNECT_GRACE_SECONDS`, while its processes reconnect and report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from timeslice.controller.orchestrator.agents import StepResult
from timeslice.controller.orchestrator.pinned_pool import PinnedPool
from timeslice.controller.orchestrator.state_file import PoolCheckpoint, StateFile
from timeslice.driver.errors import BackendError, NotFound, ProcessGone, StepTimeout
from timeslice.driver.rollback import undo
from timeslice.memory_commands import prefix
from timeslice.v1 import orchestrator_pb2 as pb

log = logging.getLogger("timeslice.cooperative")
# A checkpointed process whose stream closed this long ago is taken as gone (its client
# reconnects within its backoff, at most 2 s), and its state as lost.
RECONNECT_GRACE_SECONDS = 10.0
# Closed command streams remembered per job: a process that connects again under one of their
# ids reconnected (a dropped stream), it did not start anew (`on_started`).
GONE_STREAMS_KEPT = 16
# How often a checkpoint looks whether a departing job came back, seconds.
DEPARTING_POLL_SECONDS = 0.1
# Bound on rolling back a checkpoint that answered after its switch gave up, seconds.
LATE_ROLLBACK_TIMEOUT_SECONDS = 60.0
# Seconds a plan waits for the processes' "report" of their registered bytes (a process
# busy in a long command answers later; its last known size stands meanwhile).
REPORT_TIMEOUT_SECONDS = 1.0
# The reason a job whose checkpoint cannot be proven intact fails with (`on_lost`).
LOST_REASON = "checkpoint lost"

Ranges = list[tuple[int, int]]


class _Departed(ProcessGone):
    """The process's command stream closed before it answered a checkpoint, its state on
    the GPU: it is exiting (its memory is freed with it) or reconnecting."""


def _gone(p: _Process, kind: str) -> ProcessGone:
    """The error of a `kind` command that `p` cannot answer: its command stream closed."""
    gone = _Departed if kind == "checkpoint" and not p.checkpointed else ProcessGone
    return gone(f"process {p.pid} of job {p.job} closed its command stream")


@dataclass
class _Process:
    group: str
    job: str
    stream_id: str
    pid: int
    registered: int
    commands: asyncio.Queue[pb.MemoryCommand] = field(default_factory=asyncio.Queue)
    connected: bool = True
    disconnected_at: float = 0.0  # monotonic seconds
    checkpointed: bool = False
    pool_ranges: Ranges = field(default_factory=list)  # where its checkpoint is in the pool
    unanswered: set[str] = field(default_factory=set)  # commands it has not answered in time (state unknown)
    offered: Ranges = field(default_factory=list)  # reserved for a checkpoint command not answered yet
    nbytes: int = 0  # of its checkpoint, from the start of `pool_ranges` (or in its own memory)
    checksum: int | None = None  # of those bytes in the pool, as its process reported it at a (re)connect
    adopted: bool = False  # learned from the state file, not yet confirmed by its reconnect


_PIN = pb.MemoryCommand(op_id="pin", kind="pin")


@dataclass
class _Command:
    process: _Process
    kind: str
    ranges: list[tuple[int, int]]
    future: asyncio.Future[pb.MemoryCommandAck]


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
        self.pool = pool
        self._state = state
        self._on_lost = on_lost
        self._on_learned = on_learned
        self._on_streams_closed = on_streams_closed
        self._on_started = on_started
        self._quiet_until = 0.0  # monotonic: until then the pool offers nothing (reopened, records unknown)
        self._keep_pool = False
        self._procs: dict[tuple[str, str], dict[str, _Process]] = {}
        self._pending: dict[str, _Command] = {}
        self._late: dict[str, _Command] = {}  # timed out, still expecting an answer
        self._rollbacks: set[asyncio.Task[None]] = set()
        # (group, job) -> monotonic seconds its last connected process left with its state on the GPU
        self._left: dict[tuple[str, str], float] = {}
        # (group, job) -> the stream ids of its processes whose streams closed: one that connects again is
        # a process reconnecting (a dropped stream), not a new one
        self._gone_streams: dict[tuple[str, str], list[str]] = {}
        self._pinning: set[str] = set()  # groups whose processes pin the pool ahead (`pin_ahead`)

    # -- the process side (RPCs) -------------------------------------------------
    async def stream(self, group: str, job: str, stream_id: str, pid: int, registered: int,
                     report: pb.PoolCheckpoint | None = None) -> AsyncIterator[pb.MemoryCommand]:
        """Commands for one process, starting with "hello"; runs until the caller goes away.
        `report`: the process's checkpoint as it says (None: its state is on the GPU)."""
        procs = self._procs.setdefault((group, job), {})
        self._left.pop((group, job), None)
        p = procs.get(stream_id)
        if p is None:
            started = report is None and not any(q.connected for q in procs.values()) and \
                stream_id not in self._gone_streams.get((group, job), ())
            p = procs[stream_id] = _Process(group, job, stream_id, pid, registered)
            if report is not None:
                self._learn(p, report)
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
                yield _PIN
            while True:
                yield await mine.get()
        finally:
            if p.commands is mine:  # not taken over by a reconnect
                p.connected, p.disconnected_at = False, time.monotonic()
                for c in list(self._pending.values()):
                    if c.process is p and not c.future.done():
                        c.future.set_exception(_gone(p, c.kind))
                if not p.checkpointed and not p.unanswered:
                    procs.pop(stream_id, None)
                    gone = self._gone_streams.setdefault((group, job), [])
                    gone.append(stream_id)
                    del gone[:-GONE_STREAMS_KEPT]
                if not p.checkpointed and not any(q.connected for q in procs.values()):
                    self._left[(group, job)] = p.disconnected_at  # its state stays on the GPU, unmovable
                log.info("cooperative process disconnected group=%s job=%s pid=%d checkpointed=%s", group, job,
                         p.pid, p.checkpointed)
                if self._on_streams_closed is not None and not self.connected(group, job):
                    self._on_streams_closed(group, job)

    def _reconnected(self, p: _Process, pid: int, registered: int, report: pb.PoolCheckpoint | None) -> None:
        """A process's stream reconnected: it keeps its checkpoint; the commands the old stream
        never sent fail now (the old stream's close fails nothing once the new one owns it)."""
        old = p.commands
        p.connected, p.pid, p.registered, p.commands = True, pid, registered, asyncio.Queue()
        while not old.empty():
            c = self._pending.get(old.get_nowait().op_id)
            if c is not None and not c.future.done():
                c.future.set_exception(_gone(p, c.kind))
        if p.adopted:
            self._confirm(p, report)
        elif p.checkpointed and report is not None and p.checksum is None:
            p.checksum = report.checksum
            self._persist()

    def pin_ahead(self, group: str) -> None:
        """Tell `group`'s processes, now and whenever one connects, to register the pinned pool
        with CUDA ahead of need ("pin", no answer): a grant may move memory from now on. Before
        that they pin nothing: each process registers the whole pool, host memory locked and
        work that no move of jobs that fit together ever uses (docs/one-box.md)."""
        if self.pool is None or group in self._pinning:
            return
        self._pinning.add(group)
        procs = [p for (g, _), by_stream in self._procs.items() if g == group for p in by_stream.values()
                 if p.connected]
        for p in procs:
            p.commands.put_nowait(_PIN)
        log.info("cooperative processes pin the pool ahead group=%s processes=%d (a grant may move memory)", group,
                 len(procs))

    def ack(self, ack: pb.MemoryCommandAck) -> None:
        """A process's answer to a command, also one that came after the orchestrator gave up
        waiting (its effect is recorded: the state follows what the process did). Raises
        NotFound for an unknown command or another job's."""
        c = self._pending.get(ack.op_id) or self._late.get(ack.op_id)
        if c is None or c.process.job != ack.job_id:
            raise NotFound(f"no pending memory command {ack.op_id!r} for job {ack.job_id!r}")
        p = c.process
        if ack.registered_bytes:
            p.registered = ack.registered_bytes
        if self._pending.pop(ack.op_id, None) is not None:
            if not c.future.done():
                c.future.set_result(ack)
            return
        del self._late[ack.op_id]
        p.unanswered.discard(ack.op_id)
        log.warning("late answer group=%s job=%s pid=%d command=%s ok=%s", p.group, p.job, p.pid, c.kind, ack.ok)
        if c.kind == "restore" and not ack.ok:
            if ack.lost:
                self._lost(p, ack.error)
        elif ack.ok:  # a step its switch gave up on: the switch rolled back, so this one is too
            if c.kind == "restore":  # (the group counts the job checkpointed and may have given its room away)
                self._restored(p)
            else:
                self._checkpointed(p, c.ranges, ack)
            task = asyncio.get_running_loop().create_task(self._roll_back_late(p, c.kind))
            self._rollbacks.add(task)
            task.add_done_callback(self._rollbacks.discard)
        else:
            if c.ranges and self.pool is not None:
                self.pool.keep(c.ranges, 0)
            p.offered = []
            self._persist()

    async def _roll_back_late(self, p: _Process, kind: str) -> None:
        """Undo a `kind` step answered after its switch gave up: restore a late checkpoint,
        checkpoint a late restore."""
        try:
            if kind == "restore":
                offered = (await self._offers([p]))[0]
                try:
                    ack = await self._command(p, "checkpoint", offered, LATE_ROLLBACK_TIMEOUT_SECONDS)
                except BaseException:
                    if offered and self.pool is not None:
                        self.pool.keep(offered, 0)
                    p.offered = []
                    raise
                self._checkpointed(p, offered, ack)
            else:
                await self._restore_one(p, LATE_ROLLBACK_TIMEOUT_SECONDS)
        except Exception as err:  # a late checkpoint: its client restores it by itself at its next grant
            log.warning("rollback of a late %s failed group=%s job=%s pid=%d: %s", kind, p.group, p.job, p.pid, err)

    # -- the switch side -----------------------------------------------------------
    def registered_bytes(self, group: str, job: str) -> int:
        return sum(p.registered for p in self._procs.get((group, job), {}).values())

    async def refresh(self, group: str, jobs: Sequence[str]) -> None:
        """Ask every connected, resident process of `jobs` for its registered bytes now (a
        "report" command): a process registers before its model and optimizer exist, so
        the size it sent when its stream opened says too little (issue 21: residents that
        looked empty were never moved out). No answer within `REPORT_TIMEOUT_SECONDS`
        leaves the last known size; nothing is raised."""
        procs = [p for job in jobs for p in self._procs.get((group, job), {}).values()
                 if p.connected and not p.checkpointed and not p.unanswered]
        results = await asyncio.gather(*(self._command(p, "report", [], REPORT_TIMEOUT_SECONDS) for p in procs),
                                       return_exceptions=True)
        for p, r in zip(procs, results):
            if isinstance(r, BaseException):
                log.debug("no report group=%s job=%s pid=%d: %s", group, p.job, p.pid, r)

    def checkpointed(self, group: str, job: str) -> bool:
        return any(p.checkpointed for p in self._procs.get((group, job), {}).values())

    def connected(self, group: str, job: str) -> bool:
        """A process of the job has its command stream open: its registered state can move."""
        return any(p.connected for p in self._procs.get((group, job), {}).values())

    def departing(self, group: str, job: str) -> bool:
        """The job's last process closed its command stream, with its state on the GPU, less
        than `RECONNECT_GRACE_SECONDS` ago: it is exiting (its memory is about to be freed) or
        reconnecting; or it is `unconfirmed`. Either way nothing can move it now."""
        left = self._left.get((group, job))
        return (left is not None and time.monotonic() - left < RECONNECT_GRACE_SECONDS) or self.unconfirmed(group, job)

    def unconfirmed(self, group: str, job: str) -> bool:
        """A process of the job that the state file records (`adopt`) has not reconnected
        since this orchestrator started, less than `RECONNECT_GRACE_SECONDS` ago: whether its
        state is on the GPU or checkpointed is not known until it says."""
        now = time.monotonic()
        return any(p.adopted and now - p.disconnected_at < RECONNECT_GRACE_SECONDS
                   for p in self._procs.get((group, job), {}).values())

    async def checkpoint(self, group: str, job: str, timeout: float) -> StepResult:
        """Every process of the job copies its state out and frees the GPU memory, all at
        once. All or nothing: on a failure the processes that succeeded restore. A job whose streams just
        closed (`departing`), also while they were being checkpointed, or a process of which
        has not reconnected since a restart (`unconfirmed`), is waited for until it
        reconnects (then it is checkpointed) or the grace has passed (it left: nothing of it
        to move). Raises NotFound (no process of the job is connected: nothing to move, e.g.
        it exited), BackendError (a process refused, or has not answered an earlier command:
        its state is unknown), StepTimeout (also: a departing job neither came back nor
        passed the grace within `timeout` seconds)."""
        t0, moved = time.monotonic(), 0
        # processes of the job left with their state on the GPU (before or during the command): what they
        # held leaves only as they exit (`StepResult.departed`)
        left = not self.connected(group, job) and self.departing(group, job)
        while True:
            try:
                n, departed = await self._checkpoint_live(group, job, t0, timeout)
            except NotFound:
                if moved:  # the rest left while the first were checkpointed
                    return StepResult(moved, time.monotonic() - t0, departed=True)
                raise
            moved, left = moved + n, left or departed
            if not departed:  # else some left mid-command: wait for them as for any departing job
                return StepResult(moved, time.monotonic() - t0, departed=left)

    async def _checkpoint_live(self, group: str, job: str, t0: float, timeout: float) -> tuple[int, bool]:
        """One round of `checkpoint` over the job's connected processes: (bytes moved,
        whether a process closed its stream mid-command while the others succeeded)."""
        while self.unconfirmed(group, job) or (not self.connected(group, job) and self.departing(group, job)):
            if time.monotonic() - t0 > timeout:
                raise StepTimeout(f"job {job}'s processes closed their memory command streams with their state on "
                                  "the GPU, or have not reconnected since a restart, and neither came back nor "
                                  f"passed the {RECONNECT_GRACE_SECONDS:g} s grace within {timeout:g} s")
            await asyncio.sleep(DEPARTING_POLL_SECONDS)  # exiting (its memory is freed) or reconnecting
        if not self.connected(group, job):
            self._left.pop((group, job), None)
        procs = [p for p in self._live(group, job) if not (p.checkpointed and not p.unanswered)]
        for p in procs:
            self._check_answered(p)
        offers = await self._offers(procs)
        # all at once: a job's ranks hold their state on different GPUs, each moving over its own link
        results = await asyncio.gather(*(self._command(p, "checkpoint", o, timeout) for p, o in zip(procs, offers)),
                                       return_exceptions=True)
        done, moved, failed, departed = [], 0, None, None
        for p, offered, ack in zip(procs, offers, results):
            if isinstance(ack, BaseException):
                if offered and not isinstance(ack, StepTimeout):  # after a timeout they wait for its answer
                    self.pool.keep(offered, 0)  # type: ignore[union-attr]
                    p.offered = []
                if isinstance(ack, _Departed):
                    departed = departed or ack
                else:
                    failed = failed or ack
                continue
            self._checkpointed(p, offered, ack)
            if not ack.pinned and self.pool is not None:
                log.warning("cooperative checkpoint group=%s job=%s pid=%d went to the process's own host memory (the "
                            "pinned pool had %d bytes free for its %d bytes): slower",
                            group, job, p.pid, sum(n for _, n in offered), p.registered)
            done.append(p)
            moved += ack.bytes or p.registered
        await self._persisted()  # the switch's restore runs in the memory they freed: recorded first
        if failed is not None:
            note = await undo(done, lambda q: self._restore_one(q, timeout), lambda q: f"pid {q.pid}",
                              f"cooperative checkpoint group={group} job={job} failed ({failed})")
            if isinstance(failed, BackendError | StepTimeout | ProcessGone):
                raise type(failed)(f"{failed}; {note}") from failed
            raise failed
        if departed is not None:
            log.info("cooperative process left while checkpointed for a switch group=%s job=%s: %s", group, job,
                     departed)
        return moved, departed is not None

    def check_restore(self, group: str, job: str) -> None:
        """Raise before anything moves when the job's checkpoint cannot be restored now: a
        checkpointed process, or one the state file records that has not reconnected since a
        restart (`unconfirmed`: its state may be out), is reconnecting (ProcessGone, retry
        later) or has not answered an earlier command (BackendError). Such a process gone for
        longer than `RECONNECT_GRACE_SECONDS` took its state with it: it is forgotten (its pool
        ranges freed, a warning logged) and the job's other processes restore alone."""
        now = time.monotonic()
        procs = self._procs.get((group, job), {})
        for stream_id, p in list(procs.items()):
            if (p.checkpointed or p.adopted) and not p.connected and now - p.disconnected_at > RECONNECT_GRACE_SECONDS:
                log.warning("cooperative process gone while checkpointed group=%s job=%s pid=%d: its state is lost",
                            group, job, p.pid)
                self._forget(p)
                del procs[stream_id]
        waiting = [p.pid for p in procs.values() if (p.checkpointed or p.adopted) and not p.connected]
        if waiting:
            raise ProcessGone(f"job {job}: process(es) {waiting} may hold a checkpoint and are reconnecting (their "
                              f"command stream closed less than {RECONNECT_GRACE_SECONDS:g} s ago); try again")
        for p in procs.values():
            self._check_answered(p)

    async def restore(self, group: str, job: str, timeout: float) -> StepResult:
        """Every checkpointed process of the job brings its state back. Raises
        ProcessGone, BackendError, StepTimeout (see `check_restore`)."""
        t0 = time.monotonic()
        self.check_restore(group, job)
        procs = [p for p in self._procs.get((group, job), {}).values() if p.checkpointed]
        results = await asyncio.gather(*(self._restore_one(p, timeout) for p in procs), return_exceptions=True)
        failures = [f"pid {p.pid}: {r}" for p, r in zip(procs, results) if isinstance(r, BaseException)]
        if failures:
            raise BackendError(f"cooperative restore of job {job} failed ({'; '.join(failures)})")
        return StepResult(sum(r for r in results if isinstance(r, int)), time.monotonic() - t0)

    def forget(self, group: str, job: str) -> None:
        """The job is gone: drop its processes and free their pool ranges."""
        self._left.pop((group, job), None)
        for p in self._procs.pop((group, job), {}).values():
            self._forget(p)
        self._persist()

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
            self._quiet_until = time.monotonic() + RECONNECT_GRACE_SECONDS
            log.warning("pinned pool %s reopened with no record of its checkpoints: no range is offered for %g s, "
                        "while their processes reconnect and report them", self.pool.path, RECONNECT_GRACE_SECONDS)
        found: dict[str, set[str]] = {}
        now = time.monotonic()
        for rec in records or ():
            p = _Process(rec.group, rec.job, rec.stream, rec.pid, rec.nbytes or 0, connected=False,
                         disconnected_at=now, adopted=True)
            try:
                self.pool.reserve(list(rec.ranges))
            except ValueError as err:
                self._lost(p, f"its record in the state file does not fit the pool ({err})")
                continue
            self._procs.setdefault((rec.group, rec.job), {})[rec.stream] = p
            if rec.nbytes is None:  # a checkpoint command was out: its process says what it did
                p.offered = list(rec.ranges)
            else:
                p.checkpointed, p.pool_ranges, p.nbytes, p.checksum = True, list(rec.ranges), rec.nbytes, rec.checksum
            found.setdefault(rec.group, set()).add(rec.job)
            log.info("cooperative checkpoint adopted group=%s job=%s pid=%d ranges=%d bytes=%s", rec.group, rec.job,
                     rec.pid, len(rec.ranges), rec.nbytes)
        self._persist()
        return found

    def keep_pool_if_in_use(self) -> None:
        """Before the server stops: keep the pool file at `close` when a process maps it or
        is checkpointed in it (a restarted orchestrator reopens it); else it is removed."""
        self._keep_pool = any(p.connected or p.checkpointed or p.offered
                              for procs in self._procs.values() for p in procs.values())

    def _learn(self, p: _Process, report: pb.PoolCheckpoint) -> None:
        """A checkpoint this orchestrator has no record of, reported by its process."""
        ranges = [(r.offset, r.length) for r in report.ranges]
        if ranges:
            if self.pool is None:
                self._lost(p, "it reports a pinned-pool checkpoint and this orchestrator has no pool")
                return
            try:
                self.pool.reserve(ranges)
            except ValueError as err:  # another job may have written there since
                self._lost(p, f"its pool ranges are not free ({err})")
                return
        p.checkpointed, p.pool_ranges, p.nbytes, p.checksum = True, ranges, report.bytes, report.checksum
        log.warning("cooperative checkpoint learned from its process group=%s job=%s pid=%d ranges=%d bytes=%d",
                    p.group, p.job, p.pid, len(ranges), report.bytes)
        self._persist()
        if self._on_learned is not None:
            self._on_learned(p.group, p.job)

    def _confirm(self, p: _Process, report: pb.PoolCheckpoint | None) -> None:
        """An adopted process reconnected with its `report`: it confirms the record (a
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
                self._lost(p, f"it reports ranges {ranges} outside those it was offered")
                return
        elif report is None:
            log.warning("cooperative process reconnected with its state on the GPU, recorded as checkpointed "
                        "group=%s job=%s pid=%d: its pool ranges are freed", p.group, p.job, p.pid)
            self._restored(p)
            return
        elif (ranges, report.bytes) != (p.pool_ranges, p.nbytes) or \
                (p.checksum is not None and report.checksum != p.checksum):
            self._lost(p, f"it reports {report.bytes} bytes in ranges {ranges} with checksum {report.checksum:#010x}, "
                          f"the state file {p.nbytes} bytes in {p.pool_ranges} with {p.checksum or 0:#010x}")
            return
        else:
            p.checksum = report.checksum
            if self._on_learned is not None:
                self._on_learned(p.group, p.job)
        log.info("cooperative checkpoint confirmed group=%s job=%s pid=%d checkpointed=%s", p.group, p.job, p.pid,
                 p.checkpointed)
        self._persist()

    def _lost(self, p: _Process, why: str) -> None:
        """`p`'s checkpoint cannot be proven intact: its ranges are freed, its job fails."""
        reason = f"{LOST_REASON}: process {p.pid} of job {p.job}: {why}"
        log.error("cooperative %s group=%s", reason, p.group)
        if self.pool is not None:
            self.pool.release(p.pool_ranges)
            self.pool.keep(p.offered, 0)
        p.pool_ranges, p.offered, p.checkpointed, p.adopted = [], [], False, False
        self._persist()
        if self._on_lost is not None:
            self._on_lost(p.group, p.job, reason)

    def _persist(self) -> None:
        """Record where every checkpoint into the pool is (write-ahead for offers: `_offers`
        waits for the write). A failed write is logged by the state file: the processes'
        reports still tell a restarted orchestrator."""
        if self._state is None or not self._state.persistent or self.pool is None:
            return
        records = [PoolCheckpoint(p.group, p.job, p.stream_id, p.pid,
                                  tuple(p.pool_ranges if p.checkpointed else p.offered),
                                  p.nbytes if p.checkpointed else None, p.checksum if p.checkpointed else None)
                   for procs in self._procs.values() for p in procs.values() if p.checkpointed or p.offered]
        self._state.record_pool(self.pool.path, self.pool.size, records)

    async def _persisted(self) -> None:
        """`_persist`, and return once it is written (`StateFile.written`)."""
        self._persist()
        if self._state is not None:
            await self._state.written()

    def reap(self) -> None:
        """Forget the processes gone for longer than the grace while checkpointed or holding
        pool ranges (their state went with them: a job's process that starts again starts
        from scratch), so that their ranges serve others and their bytes count for nobody
        (schedules seed 3718: a killed process's adopted checkpoint, never restored, stayed
        counted in its restarted job's size, 123 MB on a 100 MB model GPU, and the job was
        never granted again)."""
        now, reaped = time.monotonic(), False
        for procs in self._procs.values():
            for stream_id, p in list(procs.items()):
                if not p.connected and now - p.disconnected_at > RECONNECT_GRACE_SECONDS and \
                        (p.checkpointed or p.adopted or p.pool_ranges or p.offered) and not p.unanswered:
                    log.warning("cooperative process gone while checkpointed group=%s job=%s pid=%d: its state "
                                "went with it", p.group, p.job, p.pid)
                    self._forget(p)
                    del procs[stream_id]
                    reaped = True
        if reaped:
            self._persist()

    # -- internals -----------------------------------------------------------------
    def _forget(self, p: _Process) -> None:
        if self.pool is not None:
            self.pool.release(p.pool_ranges)
            self.pool.keep(p.offered, 0)
        for op in [op for op, c in self._late.items() if c.process is p]:
            if self.pool is not None:
                self.pool.release(self._late[op].ranges)
            del self._late[op]
        p.pool_ranges, p.offered, p.unanswered, p.checkpointed, p.adopted = [], [], set(), False, False

    @staticmethod
    def _check_answered(p: _Process) -> None:
        if p.unanswered:
            raise BackendError(f"process {p.pid} of job {p.job} has not answered an earlier memory command (it timed "
                               "out): where its state is is unknown, so it is not moved until it answers")

    async def _offers(self, procs: list[_Process]) -> list[list[tuple[int, int]]]:
        """Pool ranges for each process about to checkpoint: one process gets every free
        range (its state may have grown since it registered); several at once get room for
        their registered bytes each, while it lasts ([]: it keeps its own host copy).
        Returns once the offers are on disk."""
        if self.pool is None or time.monotonic() < self._quiet_until:
            return [[] for _ in procs]
        self.reap()
        offers = [self.pool.take_all()] if len(procs) == 1 else [self.pool.take(p.registered) for p in procs]
        for p, offered in zip(procs, offers):
            p.offered = offered
        await self._persisted()  # before any command goes: a restart hands these ranges to nobody else
        return offers

    def _checkpointed(self, p: _Process, offered: Ranges, ack: pb.MemoryCommandAck) -> None:
        if offered and self.pool is not None:
            p.pool_ranges = self.pool.keep(offered, ack.bytes if ack.pinned else 0)
        p.offered, p.checkpointed, p.nbytes, p.checksum = [], True, ack.bytes, None  # reported at a reconnect
        self._persist()

    def _restored(self, p: _Process) -> None:
        if self.pool is not None:
            self.pool.release(p.pool_ranges)
        p.pool_ranges, p.nbytes, p.checksum = [], 0, None
        p.checkpointed = False
        self._persist()

    def _live(self, group: str, job: str) -> list[_Process]:
        procs = [p for p in self._procs.get((group, job), {}).values() if p.connected]
        if not procs:
            raise NotFound(f"job {job} has no process connected for cooperative memory commands in group {group} "
                           "(its processes exited, or never registered their GPU state: timeslice.torch.register)")
        return procs

    async def _restore_one(self, p: _Process, timeout: float) -> int:
        self._check_answered(p)
        ack = await self._command(p, "restore", p.pool_ranges, timeout)
        self._restored(p)
        return int(ack.bytes)

    async def _command(self, p: _Process, kind: str, ranges: list[tuple[int, int]],
                       timeout: float) -> pb.MemoryCommandAck:
        """Send `kind` to `p` and wait for its answer, at most `timeout` seconds. Raises
        ProcessGone (`_Departed`: a checkpoint of state on the GPU) when `p`'s stream is
        closed, at once, or closes before it answers; StepTimeout; BackendError (it
        answered with an error)."""
        if not p.connected:  # closed since the caller looked: nobody would read this command, nor fail it
            raise _gone(p, kind)
        op = uuid.uuid4().hex
        c = _Command(p, kind, ranges, asyncio.get_running_loop().create_future())
        self._pending[op] = c
        p.commands.put_nowait(pb.MemoryCommand(op_id=op, kind=kind, timeout_seconds=timeout,
                                               ranges=[pb.PoolRange(offset=o, length=n) for o, n in ranges]))
        try:
            ack = await asyncio.wait_for(asyncio.shield(c.future), timeout)
        except TimeoutError:
            if kind == "report":  # moves nothing: a late answer is dropped
                raise StepTimeout(f"cooperative report of job {p.job} pid {p.pid}: no answer within {timeout:g} s") \
                    from None
            self._late[op] = c  # its answer still counts when it comes
            p.unanswered.add(op)
            raise StepTimeout(f"cooperative {kind} of job {p.job} pid {p.pid}: no answer within {timeout:g} s "
                              "(where its state is is settled by its answer)") from None
        finally:
            self._pending.pop(op, None)
        if not ack.ok:
            if ack.lost:
                self._lost(p, ack.error)
            raise BackendError(f"cooperative {kind} of job {p.job} pid {p.pid} failed: {ack.error}")
        return ack

    async def close(self) -> None:
        for c in self._pending.values():
            if not c.future.done():
                c.future.cancel()
        self._pending.clear()
        for task in list(self._rollbacks):
            task.cancel()
        if self.pool is not None and self._keep_pool:
            log.warning("pinned pool kept path=%s: cooperative processes map it or are checkpointed in it (an "
                        "orchestrator started with the same configuration reopens it; remove it once they are gone)",
                        self.pool.path)
        elif self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.close()

