"""The cooperative backend's processes: what the orchestrator knows of each, and of each job's.

`Process`: one command stream of a job's process (`stream_id`), with its checkpoint and the
commands it has not answered in time. `Processes`: every job's processes by stream id, and
what is known of those that left: which streams closed (one that connects again is a process
reconnecting), and when a job's last process left with its state on the GPU (`departing` for
`RECONNECT_GRACE_SECONDS`). `Commands`: the commands sent down the streams, until their
processes answer, also after the sender gave up (late). The rules for a process that
reconnects or is gone are in `cooperative.py`'s docstring, those for commands in
`cooperative_steps.py`'s.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from timeslice.driver.errors import NotFound, ProcessGone, StepTimeout
from timeslice.v1 import orchestrator_pb2 as pb

# A checkpointed process whose stream closed this long ago is taken as gone (its client
# reconnects within its backoff, at most 2 s), and its state as lost. The other cooperative
# modules read it as `cooperative_processes.RECONNECT_GRACE_SECONDS`, at each use (tests set it).
RECONNECT_GRACE_SECONDS = 10.0
# Closed command streams remembered per job: a process that connects again under one of their
# ids reconnected (a dropped stream), it did not start anew (`on_started`).
GONE_STREAMS_KEPT = 16

Ranges = list[tuple[int, int]]


class Departed(ProcessGone):
    """The process's command stream closed before it answered a checkpoint, its state on
    the GPU: it is exiting (its memory is freed with it) or reconnecting."""


def stream_closed(p: Process, kind: str) -> ProcessGone:
    """The error of a `kind` command that `p` cannot answer: its command stream closed."""
    gone = Departed if kind == "checkpoint" and not p.checkpointed else ProcessGone
    return gone(f"process {p.pid} of job {p.job} closed its command stream")


@dataclass
class Process:
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

    def past_grace(self, now: float) -> bool:
        """Its stream closed more than `RECONNECT_GRACE_SECONDS` before `now` (monotonic)."""
        return not self.connected and now - self.disconnected_at > RECONNECT_GRACE_SECONDS


PIN = pb.MemoryCommand(op_id="pin", kind="pin")


@dataclass
class Command:
    process: Process
    kind: str
    ranges: list[tuple[int, int]]
    future: asyncio.Future[pb.MemoryCommandAck]


class Processes:
    """The cooperative processes by (group, job) and stream id, and the jobs' departures."""

    def __init__(self) -> None:
        self._by_job: dict[tuple[str, str], dict[str, Process]] = {}
        # (group, job) -> monotonic seconds its last connected process left with its state on the GPU
        self._left: dict[tuple[str, str], float] = {}
        # (group, job) -> the stream ids of its processes whose streams closed: one that connects again is
        # a process reconnecting (a dropped stream), not a new one
        self._gone_streams: dict[tuple[str, str], list[str]] = {}

    def of(self, group: str, job: str) -> Mapping[str, Process]:
        """The job's processes by stream id (read only: `add`, `drop`, `forget` change them)."""
        return self._by_job.get((group, job), {})

    def all(self) -> Iterator[Process]:
        return (p for procs in self._by_job.values() for p in procs.values())

    def add(self, p: Process) -> None:
        self._by_job.setdefault((p.group, p.job), {})[p.stream_id] = p

    def drop(self, p: Process) -> None:
        del self._by_job[(p.group, p.job)][p.stream_id]

    def forget(self, group: str, job: str) -> list[Process]:
        """The job is gone: its processes, no longer kept."""
        self._left.pop((group, job), None)
        return list(self._by_job.pop((group, job), {}).values())

    # -- streams opening and closing -----------------------------------------------
    def connecting(self, group: str, job: str) -> dict[str, Process]:
        """A process of the job opens its stream: the job is not departing. Returns the
        job's entry, which its stream hands back to `closed` (a job forgotten meanwhile
        keeps its own)."""
        procs = self._by_job.setdefault((group, job), {})
        self._left.pop((group, job), None)
        return procs

    def reconnecting(self, group: str, job: str, stream_id: str) -> bool:
        """`stream_id` is one of the job's closed streams: its process reconnects."""
        return stream_id in self._gone_streams.get((group, job), ())

    def closed(self, p: Process, procs: dict[str, Process]) -> None:
        """`p`'s stream closed (`p.disconnected_at` is set); `procs`: the entry `connecting`
        returned. A process with nothing of it kept here (no checkpoint, no command left
        unanswered, no pool ranges offered to a checkpoint it did not answer) is dropped, its
        stream id remembered; a job whose last connected process left with its state on the
        GPU is departing."""
        if not p.checkpointed and not p.unanswered and not p.offered:
            procs.pop(p.stream_id, None)
            gone = self._gone_streams.setdefault((p.group, p.job), [])
            gone.append(p.stream_id)
            del gone[:-GONE_STREAMS_KEPT]
        if not p.checkpointed and not any(q.connected for q in procs.values()):
            self._left[(p.group, p.job)] = p.disconnected_at  # its state stays on the GPU, unmovable

    def waited(self, group: str, job: str) -> None:
        """A checkpoint waited for the departing job: when none of its processes came back,
        when they left is forgotten."""
        if not self.connected(group, job):
            self._left.pop((group, job), None)

    # -- questions -------------------------------------------------------------------
    def registered_bytes(self, group: str, job: str) -> int:
        return sum(p.registered for p in self.of(group, job).values())

    def checkpointed(self, group: str, job: str) -> bool:
        return any(p.checkpointed for p in self.of(group, job).values())

    def connected(self, group: str, job: str) -> bool:
        """A process of the job has its command stream open: its registered state can move."""
        return any(p.connected for p in self.of(group, job).values())

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
                   for p in self.of(group, job).values())

    def live(self, group: str, job: str) -> list[Process]:
        """The job's connected processes. Raises NotFound when it has none."""
        procs = [p for p in self.of(group, job).values() if p.connected]
        if not procs:
            raise NotFound(f"job {job} has no process connected for cooperative memory commands in group {group} "
                           "(its processes exited, or never registered their GPU state: timeslice.torch.register)")
        return procs


class Commands:
    """The commands sent to cooperative processes, by operation id, until they answer."""

    def __init__(self) -> None:
        self._pending: dict[str, Command] = {}
        self._late: dict[str, Command] = {}  # timed out, still expecting an answer

    async def send(self, p: Process, kind: str, ranges: list[tuple[int, int]],
                   timeout: float) -> pb.MemoryCommandAck:
        """Send `kind` to `p` and return its answer (ok or not), within `timeout` seconds.
        Raises ProcessGone (`Departed`: a checkpoint of state on the GPU) when `p`'s stream
        is closed, at once, or closes before it answers; StepTimeout (the command is then
        late, but for a "report": its answer still counts, `p.unanswered` until it comes)."""
        if not p.connected:  # closed since the caller looked: nobody would read this command, nor fail it
            raise stream_closed(p, kind)
        op = uuid.uuid4().hex
        c = Command(p, kind, ranges, asyncio.get_running_loop().create_future())
        self._pending[op] = c
        p.commands.put_nowait(pb.MemoryCommand(op_id=op, kind=kind, timeout_seconds=timeout,
                                               ranges=[pb.PoolRange(offset=o, length=n) for o, n in ranges]))
        try:
            return await asyncio.wait_for(asyncio.shield(c.future), timeout)
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

    def answer(self, ack: pb.MemoryCommandAck) -> Command | None:
        """A process's answer: handed to its sender, or, when it came late, returned (its
        process no longer waits for it). Raises NotFound for an unknown command or another
        job's."""
        c = self._pending.get(ack.op_id) or self._late.get(ack.op_id)
        if c is None or c.process.job != ack.job_id:
            raise NotFound(f"no pending memory command {ack.op_id!r} for job {ack.job_id!r}")
        p = c.process
        if ack.registered_bytes:
            p.registered = ack.registered_bytes
        if self._pending.pop(ack.op_id, None) is not None:
            if not c.future.done():
                c.future.set_result(ack)
            return None
        del self._late[ack.op_id]
        p.unanswered.discard(ack.op_id)
        return c

    def fail_pending(self, p: Process) -> None:
        """`p`'s stream closed: the commands it did not answer fail."""
        for c in list(self._pending.values()):
            if c.process is p and not c.future.done():
                c.future.set_exception(stream_closed(p, c.kind))

    def fail_unsent(self, p: Process, old: asyncio.Queue[pb.MemoryCommand]) -> None:
        """`p` reconnected: the commands its old stream never sent (`old`) fail."""
        while not old.empty():
            c = self._pending.get(old.get_nowait().op_id)
            if c is not None and not c.future.done():
                c.future.set_exception(stream_closed(p, c.kind))

    def drop_late(self, p: Process) -> list[Command]:
        """`p` is gone: its late commands, no longer awaited."""
        return [self._late.pop(op) for op in [op for op, c in self._late.items() if c.process is p]]

    def cancel(self) -> None:
        for c in self._pending.values():
            if not c.future.done():
                c.future.cancel()
        self._pending.clear()
