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
it reconnects or its job is forgotten (`forget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from timeslice.controller.orchestrator.agents import StepResult
from timeslice.controller.orchestrator.pinned_pool import PinnedPool
from timeslice.driver.errors import BackendError, NotFound, ProcessGone, StepTimeout
from timeslice.v1 import orchestrator_pb2 as pb

log = logging.getLogger("timeslice.cooperative")


@dataclass
class _Process:
    group: str
    job: str
    stream_id: str
    pid: int
    registered: int
    commands: asyncio.Queue[pb.MemoryCommand] = field(default_factory=asyncio.Queue)
    connected: bool = True
    checkpointed: bool = False
    pool_ranges: list[tuple[int, int]] = field(default_factory=list)  # where its checkpoint is in the pool


class CooperativeJobs:
    """The connected cooperative processes by (group, job), and their pending commands."""

    def __init__(self, pool: PinnedPool | None = None) -> None:
        self.pool = pool
        self._procs: dict[tuple[str, str], dict[str, _Process]] = {}
        self._pending: dict[str, tuple[asyncio.Future[pb.MemoryCommandAck], _Process]] = {}

    # -- the process side (RPCs) -------------------------------------------------
    async def stream(self, group: str, job: str, stream_id: str, pid: int,
                     registered: int) -> AsyncIterator[pb.MemoryCommand]:
        """Commands for one process, starting with "hello"; runs until the caller goes away."""
        procs = self._procs.setdefault((group, job), {})
        p = procs.get(stream_id)
        if p is None:
            p = procs[stream_id] = _Process(group, job, stream_id, pid, registered)
        else:  # a reconnect: keep its checkpoint, drop commands queued for the old stream
            p.connected, p.pid, p.registered, p.commands = True, pid, registered, asyncio.Queue()
        log.info("cooperative process connected group=%s job=%s pid=%d registered_bytes=%d checkpointed=%s",
                 group, job, pid, registered, p.checkpointed)
        mine = p.commands
        try:
            yield pb.MemoryCommand(op_id="hello", kind="hello", pool_path=str(self.pool.path) if self.pool else "",
                                   pool_bytes=self.pool.size if self.pool else 0)
            while True:
                yield await mine.get()
        finally:
            if p.commands is mine:  # not taken over by a reconnect
                p.connected = False
                for op, (fut, owner) in list(self._pending.items()):
                    if owner is p and not fut.done():
                        fut.set_exception(ProcessGone(f"process {p.pid} of job {job} closed its command stream"))
                        del self._pending[op]
                if not p.checkpointed:
                    procs.pop(stream_id, None)
                log.info("cooperative process disconnected group=%s job=%s pid=%d", group, job, p.pid)

    def ack(self, ack: pb.MemoryCommandAck) -> None:
        """A process's answer to a command. Raises NotFound for an unknown or finished command."""
        entry = self._pending.pop(ack.op_id, None)
        if entry is None or entry[1].job != ack.job_id:
            raise NotFound(f"no pending memory command {ack.op_id!r} for job {ack.job_id!r}")
        fut, p = entry
        if ack.registered_bytes:
            p.registered = ack.registered_bytes
        if not fut.done():
            fut.set_result(ack)

    # -- the switch side -----------------------------------------------------------
    def registered_bytes(self, group: str, job: str) -> int:
        return sum(p.registered for p in self._procs.get((group, job), {}).values())

    def checkpointed(self, group: str, job: str) -> bool:
        return any(p.checkpointed for p in self._procs.get((group, job), {}).values())

    async def checkpoint(self, group: str, job: str, timeout: float) -> StepResult:
        """Every process of the job copies its state out and frees the GPU memory. All or
        nothing: on a failure the processes already done restore. Raises NotFound (no
        process of the job is connected: nothing to move), BackendError, StepTimeout."""
        t0 = time.monotonic()
        done: list[_Process] = []
        moved = 0
        for p in self._live(group, job):
            if p.checkpointed:
                continue
            offered = self.pool.take_all() if self.pool else []
            try:
                ack = await self._command(p, "checkpoint", offered, timeout)
            except BaseException as err:
                if isinstance(err, StepTimeout):  # it may still finish: restore it too (a no-op if it did not)
                    p.pool_ranges = offered
                    p.checkpointed = True
                    done.append(p)
                elif offered:
                    self.pool.keep(offered, 0)  # type: ignore[union-attr]
                undo = await asyncio.gather(*(self._restore_one(q, timeout) for q in done), return_exceptions=True)
                stuck = [f"pid {q.pid}: {e}" for q, e in zip(done, undo) if isinstance(e, BaseException)]
                note = f"; ROLLBACK FAILED ({'; '.join(stuck)})" if stuck else f"; rolled back {len(done)} process(es)"
                if isinstance(err, BackendError | StepTimeout | ProcessGone):
                    raise type(err)(f"{err}{note}") from err
                raise
            if offered:
                p.pool_ranges = self.pool.keep(offered, ack.bytes if ack.pinned else 0)  # type: ignore[union-attr]
            if not ack.pinned and self.pool is not None:
                log.warning("cooperative checkpoint group=%s job=%s pid=%d went to the process's own host memory (the "
                            "pinned pool had %d bytes free for its %d bytes): slower",
                            group, job, p.pid, sum(n for _, n in offered), p.registered)
            p.checkpointed = True
            done.append(p)
            moved += ack.bytes or p.registered
        return StepResult(moved, time.monotonic() - t0)

    async def restore(self, group: str, job: str, timeout: float) -> StepResult:
        """Every checkpointed process of the job brings its state back. Raises NotFound,
        BackendError, StepTimeout, ProcessGone (its state went with it)."""
        t0 = time.monotonic()
        procs = [p for p in self._procs.get((group, job), {}).values() if p.checkpointed]
        gone = [p for p in procs if not p.connected]
        if gone:
            raise ProcessGone(f"job {job}: process(es) {[p.pid for p in gone]} hold a checkpoint but are not "
                              "connected (their command stream closed)")
        results = await asyncio.gather(*(self._restore_one(p, timeout) for p in procs), return_exceptions=True)
        failures = [f"pid {p.pid}: {r}" for p, r in zip(procs, results) if isinstance(r, BaseException)]
        if failures:
            raise BackendError(f"cooperative restore of job {job} failed ({'; '.join(failures)})")
        return StepResult(sum(int(r) for r in results), time.monotonic() - t0)  # type: ignore[call-overload]

    def forget(self, group: str, job: str) -> None:
        """The job is gone: drop its processes and free their pool ranges."""
        for p in self._procs.pop((group, job), {}).values():
            if self.pool is not None:
                self.pool.release(p.pool_ranges)

    # -- internals -----------------------------------------------------------------
    def _live(self, group: str, job: str) -> list[_Process]:
        procs = [p for p in self._procs.get((group, job), {}).values() if p.connected]
        if not procs:
            raise NotFound(f"job {job} has no process connected for cooperative memory commands in group {group} "
                           "(register its GPU state with timeslice.torch.register)")
        return procs

    async def _restore_one(self, p: _Process, timeout: float) -> int:
        ack = await self._command(p, "restore", p.pool_ranges, timeout)
        if self.pool is not None:
            self.pool.release(p.pool_ranges)
        p.pool_ranges = []
        p.checkpointed = False
        return int(ack.bytes)

    async def _command(self, p: _Process, kind: str, ranges: list[tuple[int, int]],
                       timeout: float) -> pb.MemoryCommandAck:
        op = uuid.uuid4().hex
        fut: asyncio.Future[pb.MemoryCommandAck] = asyncio.get_running_loop().create_future()
        self._pending[op] = (fut, p)
        p.commands.put_nowait(pb.MemoryCommand(op_id=op, kind=kind, timeout_seconds=timeout,
                                               ranges=[pb.PoolRange(offset=o, length=n) for o, n in ranges]))
        try:
            ack = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise StepTimeout(f"cooperative {kind} of job {p.job} pid {p.pid}: no answer within {timeout:g} s") \
                from None
        finally:
            self._pending.pop(op, None)
        if not ack.ok:
            raise BackendError(f"cooperative {kind} of job {p.job} pid {p.pid} failed: {ack.error}")
        return ack

    async def close(self) -> None:
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()
        with contextlib.suppress(Exception):
            if self.pool is not None:
                self.pool.close()
