"""The cooperative backend's steps: checkpoint and restore commands to a job's processes.

A checkpoint of a job whose last stream ended with its state on the GPU (`departing`:
exiting, or reconnecting) waits for a reconnect until the grace has passed; past it, the job
exited and nothing is left to move. A process whose stream closes while a checkpoint command
waits for its answer (it ended right after its release, or was killed) is departing the same
way: the checkpoint waits for it, and a job whose processes all left has nothing to move (the
waiter is granted once NVML shows their memory freed, `SwitchCoordinator`; it never fails on
a job that ended). A command for a process whose stream has already closed (it closed after
the caller looked, during an await) fails at once the same way: it is never queued on a
stream nobody reads, where it would wait out the whole step timeout (300 s by default) with
the group switching. A command that times out leaves the process's state unknown: it is not
moved again until it answers, and its late answer is recorded (a late checkpoint is rolled
back at once); its client also restores by itself when a grant finds its state out.
"""

from __future__ import annotations

import asyncio
import logging
import time

from timeslice.controller.orchestrator import cooperative_processes
from timeslice.controller.orchestrator.agents import StepResult
from timeslice.controller.orchestrator.cooperative_processes import Commands, Departed, Process, Processes
from timeslice.controller.orchestrator.cooperative_records import CheckpointRecords
from timeslice.driver.errors import BackendError, NotFound, ProcessGone, StepTimeout
from timeslice.driver.rollback import undo
from timeslice.v1 import orchestrator_pb2 as pb

log = logging.getLogger("timeslice.cooperative")
# How often a checkpoint looks whether a departing job came back, seconds.
DEPARTING_POLL_SECONDS = 0.1
# Bound on rolling back a checkpoint that answered after its switch gave up, seconds.
LATE_ROLLBACK_TIMEOUT_SECONDS = 60.0


class CooperativeSteps:
    """Checkpoints and restores of cooperative jobs, made of commands to their processes, and
    the late answers of commands whose step gave up (recorded, then rolled back)."""

    def __init__(self, processes: Processes, commands: Commands, records: CheckpointRecords) -> None:
        self._processes = processes
        self._commands = commands
        self._records = records
        self._rollbacks: set[asyncio.Task[None]] = set()

    # -- the answers -----------------------------------------------------------------
    def ack(self, ack: pb.MemoryCommandAck) -> None:
        """A process's answer to a command, also one that came after the orchestrator gave up
        waiting (its effect is recorded: the state follows what the process did). Raises
        NotFound for an unknown command or another job's."""
        c = self._commands.answer(ack)
        if c is None:  # its sender had it
            return
        p = c.process
        log.warning("late answer group=%s job=%s pid=%d command=%s ok=%s", p.group, p.job, p.pid, c.kind, ack.ok)
        if c.kind == "restore" and not ack.ok:
            if ack.lost:
                self._records.lost(p, ack.error)
        elif ack.ok:  # a step its switch gave up on: the switch rolled back, so this one is too
            if c.kind == "restore":  # (the group counts the job checkpointed and may have given its room away)
                self._records.record_restore(p)
            else:
                self._records.record_checkpoint(p, c.ranges, ack)
            task = asyncio.get_running_loop().create_task(self._roll_back_late(p, c.kind))
            self._rollbacks.add(task)
            task.add_done_callback(self._rollbacks.discard)
        else:
            self._records.unoffer(p, c.ranges)
            self._records.persist()

    async def _roll_back_late(self, p: Process, kind: str) -> None:
        """Undo a `kind` step answered after its switch gave up: restore a late checkpoint,
        checkpoint a late restore."""
        try:
            if kind == "restore":
                offered = (await self._offers([p]))[0]
                try:
                    ack = await self.command(p, "checkpoint", offered, LATE_ROLLBACK_TIMEOUT_SECONDS)
                except BaseException:
                    self._records.unoffer(p, offered)
                    raise
                self._records.record_checkpoint(p, offered, ack)
            else:
                await self._restore_one(p, LATE_ROLLBACK_TIMEOUT_SECONDS)
        except Exception as err:  # a late checkpoint: its client restores it by itself at its next grant
            log.warning("rollback of a late %s failed group=%s job=%s pid=%d: %s", kind, p.group, p.job, p.pid, err)

    # -- the steps -------------------------------------------------------------------
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
        left = not self._processes.connected(group, job) and self._processes.departing(group, job)
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
        processes = self._processes
        while processes.unconfirmed(group, job) or \
                (not processes.connected(group, job) and processes.departing(group, job)):
            if time.monotonic() - t0 > timeout:
                raise StepTimeout(f"job {job}'s processes closed their memory command streams with their state on "
                                  "the GPU, or have not reconnected since a restart, and neither came back nor "
                                  f"passed the {cooperative_processes.RECONNECT_GRACE_SECONDS:g} s grace within "
                                  f"{timeout:g} s")
            await asyncio.sleep(DEPARTING_POLL_SECONDS)  # exiting (its memory is freed) or reconnecting
        processes.waited(group, job)
        procs = [p for p in processes.live(group, job) if not (p.checkpointed and not p.unanswered)]
        for p in procs:
            self._check_answered(p)
        offers = await self._offers(procs)
        # all at once: a job's ranks hold their state on different GPUs, each moving over its own link
        results = await asyncio.gather(*(self.command(p, "checkpoint", o, timeout) for p, o in zip(procs, offers)),
                                       return_exceptions=True)
        done, moved, failed, departed = [], 0, None, None
        for p, offered, ack in zip(procs, offers, results):
            if isinstance(ack, BaseException):
                # after a timeout, or a stream closed before the answer (`Departed`), the ranges wait for what the
                # process says it did: it may have copied its state there (schedules seed 30039: an orchestrator
                # stopped mid-checkpoint freed them, its successor handed them to another job's checkpoint, and
                # the state the first process had copied there was overwritten)
                if offered and not isinstance(ack, StepTimeout | Departed):
                    self._records.unoffer(p, offered)
                if isinstance(ack, Departed):
                    departed = departed or ack
                else:
                    failed = failed or ack
                continue
            self._records.record_checkpoint(p, offered, ack)
            if not ack.pinned and self._records.pool is not None:
                log.warning("cooperative checkpoint group=%s job=%s pid=%d went to the process's own host memory (the "
                            "pinned pool had %d bytes free for its %d bytes): slower",
                            group, job, p.pid, sum(n for _, n in offered), p.registered)
            done.append(p)
            moved += ack.bytes or p.registered
        await self._records.persisted()  # the switch's restore runs in the memory they freed: recorded first
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
        procs = self._processes.of(group, job)
        for p in list(procs.values()):
            if (p.checkpointed or p.adopted) and p.past_grace(now):
                log.warning("cooperative process gone while checkpointed group=%s job=%s pid=%d: its state is lost",
                            group, job, p.pid)
                self.forget(p)
                self._processes.drop(p)
        waiting = [p.pid for p in procs.values() if (p.checkpointed or p.adopted) and not p.connected]
        if waiting:
            raise ProcessGone(f"job {job}: process(es) {waiting} may hold a checkpoint and are reconnecting (their "
                              "command stream closed less than "
                              f"{cooperative_processes.RECONNECT_GRACE_SECONDS:g} s ago); try again")
        for p in procs.values():
            self._check_answered(p)

    async def restore(self, group: str, job: str, timeout: float) -> StepResult:
        """Every checkpointed process of the job brings its state back. Raises
        ProcessGone, BackendError, StepTimeout (see `check_restore`)."""
        t0 = time.monotonic()
        self.check_restore(group, job)
        procs = [p for p in self._processes.of(group, job).values() if p.checkpointed]
        results = await asyncio.gather(*(self._restore_one(p, timeout) for p in procs), return_exceptions=True)
        failures = [f"pid {p.pid}: {r}" for p, r in zip(procs, results) if isinstance(r, BaseException)]
        if failures:
            raise BackendError(f"cooperative restore of job {job} failed ({'; '.join(failures)})")
        return StepResult(sum(r for r in results if isinstance(r, int)), time.monotonic() - t0)

    def reap(self) -> None:
        """Forget the processes gone for longer than the grace while checkpointed or holding
        pool ranges (their state went with them: a job's process that starts again starts
        from scratch), so that their ranges serve others and their bytes count for nobody
        (schedules seed 3718: a killed process's adopted checkpoint, never restored, stayed
        counted in its restarted job's size, 123 MB on a 100 MB model GPU, and the job was
        never granted again)."""
        now, reaped = time.monotonic(), False
        for p in list(self._processes.all()):
            if p.past_grace(now) and (p.checkpointed or p.adopted or p.pool_ranges or p.offered) and not p.unanswered:
                log.warning("cooperative process gone while checkpointed group=%s job=%s pid=%d: its state "
                            "went with it", p.group, p.job, p.pid)
                self.forget(p)
                self._processes.drop(p)
                reaped = True
        if reaped:
            self._records.persist()

    def forget(self, p: Process) -> None:
        """`p` is gone: its pool ranges are freed, its late commands no longer awaited."""
        pool = self._records.pool
        if pool is not None:
            pool.release(p.pool_ranges)
            pool.keep(p.offered, 0)
        for c in self._commands.drop_late(p):
            if pool is not None:
                pool.release(c.ranges)
        p.pool_ranges, p.offered, p.unanswered, p.checkpointed, p.adopted = [], [], set(), False, False

    # -- internals -------------------------------------------------------------------
    @staticmethod
    def _check_answered(p: Process) -> None:
        if p.unanswered:
            raise BackendError(f"process {p.pid} of job {p.job} has not answered an earlier memory command (it timed "
                               "out): where its state is is unknown, so it is not moved until it answers")

    async def _offers(self, procs: list[Process]) -> list[list[tuple[int, int]]]:
        """Pool ranges for each process about to checkpoint: one process gets every free
        range (its state may have grown since it registered); several at once get room for
        their registered bytes each, while it lasts ([]: it keeps its own host copy).
        Returns once the offers are on disk."""
        pool = self._records.pool
        if pool is None or not self._records.offering():
            return [[] for _ in procs]
        self.reap()
        offers = [pool.take_all()] if len(procs) == 1 else [pool.take(p.registered) for p in procs]
        for p, offered in zip(procs, offers):
            p.offered = offered
        try:  # before any command goes: a restart hands these ranges to nobody else
            await self._records.durable()
        except OSError as err:  # not on disk: the processes keep their own host copies
            for p, offered in zip(procs, offers):
                self._records.unoffer(p, offered)
            log.warning("cooperative checkpoint of %s into the pinned pool not offered: the state file did not record "
                        "the offer (%s); the processes copy to their own host memory", procs[0].job, err)
            return [[] for _ in procs]
        return offers

    async def _restore_one(self, p: Process, timeout: float) -> int:
        self._check_answered(p)
        ack = await self.command(p, "restore", p.pool_ranges, timeout)
        self._records.record_restore(p)
        return int(ack.bytes)

    async def command(self, p: Process, kind: str, ranges: list[tuple[int, int]],
                      timeout: float) -> pb.MemoryCommandAck:
        """Send `kind` to `p` and wait for its answer, at most `timeout` seconds. Raises
        ProcessGone (`Departed`: a checkpoint of state on the GPU) when `p`'s stream is
        closed, at once, or closes before it answers; StepTimeout; BackendError (it
        answered with an error; one that says its state is lost fails its job)."""
        ack = await self._commands.send(p, kind, ranges, timeout)
        if not ack.ok:
            if ack.lost:
                self._records.lost(p, ack.error)
            raise BackendError(f"cooperative {kind} of job {p.job} pid {p.pid} failed: {ack.error}")
        return ack

    def close(self) -> None:
        """Cancel the commands awaited and the late rollbacks running."""
        self._commands.cancel()
        for task in list(self._rollbacks):
            task.cancel()
