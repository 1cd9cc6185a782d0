"""StateFile: what a standalone orchestrator must not forget across a restart.

Owned by the orchestrator (`timeslice orchestrator --state-file`). Per group:
- Fencing epochs, used in blocks of `BLOCK`: before the first epoch of a new block is
  granted, the block's end is written, so a restarted orchestrator starts every group at
  the persisted end, past every epoch the previous run granted.
- Its *placement*: the job granted last (it may still compute: after a restart it is the
  group's presumptive holder, whose lease is accepted), the jobs that must leave the GPUs
  before anyone is granted (a holder whose lease lapsed, or dropped, while it may still
  compute), and the jobs that may be on the GPUs (the residents, and the incoming job of a
  switch: an agent finishes a restore whose caller died), and the jobs the agents moved out.
  Written before each grant and each switch, and whenever a job must leave; the agents'
  records say which jobs are checkpointed, so these are adopted only for jobs they do not
  hold (a job moved out that they no longer hold is back on the GPUs: `timeslice serve`'s
  stop restores every job it moved out).
And, per node pinned pool (cooperative backend), where each process's checkpoint is: the
ranges offered to a checkpoint command before it is sent (write-ahead: after a restart
they are handed to nobody else until that process reconnects and says what it did, or
the reconnect grace has passed), then its bytes and checksum once acknowledged; dropped
once restored or forgotten. Written by `CooperativeJobs` (its `CheckpointRecords`). A
record does not make its job checkpointed after a restart (the process may have restored
after it was written): until the process confirms it, its job counts as on the GPUs.
Written off the event loop as a snapshot and a journal of changes (state_journal.py,
state_writer.py): a change marks its group (or the pool) dirty; one writer thread appends
a journal line of what is dirty with one synchronous `pwrite`. A caller that waits
(`when_written`, `durable`) starts that write at once when none is in flight; changes made
meanwhile, by any group, share the next; changes nobody waits for are written after their
loop turn (the cost: `bench/handoff.py --state-file`). A grant is delivered, a hold joined,
a switch started and a checkpoint command sent only once `durable()` says the state that
tells a restarted orchestrator about them is written. Format: state_format.py. In a
cluster the controller adopts epochs and the holder from claim status instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from timeslice.controller.orchestrator import state_format
from timeslice.controller.orchestrator.state_format import Placement, PoolCheckpoint
from timeslice.controller.orchestrator.state_journal import Journal
from timeslice.controller.orchestrator.state_writer import StateWriter

log = logging.getLogger("timeslice.orchestrator")
BLOCK = 1000


class StateFile:
    """`path`: the state file (None: in memory only, nothing survives a restart); its
    journal is `<path>.journal`. Raises ValueError, naming the file and the cause, when it
    cannot be read, is not a valid state file, or cannot be written (checked at once: an
    orchestrator that cannot persist refuses every grant, so it must not start)."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._ends: dict[str, int] = {}
        self._placements: dict[str, Placement] = {}
        self._pool: tuple[str, int, tuple[PoolCheckpoint, ...]] | None = None  # (path, bytes, checkpoints)
        self._group_json: dict[str, str] = {}  # each group's placement as JSON, made when written
        self._stale: set[str] = set()  # groups whose `_group_json` is out of date
        self._pool_json: str | None = None
        self._seq = 0  # the last journal change made
        self._dirty_epochs: set[str] = set()  # what changed since the last write (or the one in flight)
        self._dirty_groups: set[str] = set()
        self._dirty_pool = False
        # the writer: one thread, handed one write at a time (`_flush`), its end reported on the loop
        self._waiting: list[Callable[[OSError | None], None]] = []  # callers that the next write covers
        self._in_flight: list[Callable[[OSError | None], None]] | None = None  # ... that the one in flight covers
        self._batch: tuple[set[str], set[str], bool] = (set(), set(), False)  # (what it writes: kept if it fails)
        self._flush_scheduled = False
        self._writer = StateWriter(self._written)
        if path is None:
            return
        try:
            self._journal = Journal(path)
        except OSError as err:
            raise _unwritable(path, err) from None
        try:
            doc, torn = state_format.read(path)
        except ValueError:
            self._journal.release()
            raise
        if doc is not None:
            self._seq = doc.seq
            self._ends = dict(doc.epochs)
            for g, p in doc.groups.items():
                self._set_placement(g, Placement(p.holder, tuple(p.mustLeave), tuple(p.residents),
                                                 tuple(p.movedOut)))
            if doc.pool is not None:
                self._set_pool((doc.pool.path, doc.pool.bytes, tuple(
                    PoolCheckpoint(c.group, c.job, c.stream, c.pid, tuple((o, n) for o, n in c.ranges), c.bytes,
                                   c.checksum) for c in doc.pool.checkpoints)))
        try:
            if torn:
                self._journal.keep_torn()
            self._journal.compact(self._snapshot())
        except OSError as err:
            self._journal.release()
            raise _unwritable(path, err) from None

    def start(self, group_id: str) -> int:
        """The epoch a group starts from: the end of its last persisted block (0: none)."""
        return self._ends.get(group_id, 0)

    def placement(self, group_id: str) -> Placement:
        """The group's placement as last written (empty: none)."""
        return self._placements.get(group_id, Placement())

    def reserve(self, group_id: str, epoch: int) -> None:
        """Before `epoch` is granted: a new block when it passes the current one (the grant
        waits for `durable()`: its epoch could repeat after a restart)."""
        if self._path is None or epoch <= self._ends.get(group_id, 0):
            return
        self._ends[group_id] = epoch + BLOCK
        self._dirty_epochs.add(group_id)
        self._changed()
        log.debug("epoch block reserved group=%s up_to=%d", group_id, self._ends[group_id])

    def record(self, group_id: str, holder: str | None, must_leave: Iterable[str], residents: Iterable[str],
               moved_out: Iterable[str] = ()) -> None:
        """The group's placement, written when it changed (`durable()`)."""
        p = Placement(holder, tuple(sorted(must_leave)), tuple(sorted(set(residents))), tuple(sorted(moved_out)))
        if self._path is None or self._placements.get(group_id) == p:
            return
        self._set_placement(group_id, p)
        self._dirty_groups.add(group_id)
        self._changed()

    @property
    def persistent(self) -> bool:
        """Whether anything written here survives a restart (a path was given)."""
        return self._path is not None

    def pool_checkpoints(self) -> tuple[Path, tuple[PoolCheckpoint, ...]] | None:
        """(the pool file, its checkpoints) as last written (None: this file recorded no pool)."""
        if self._pool is None:
            return None
        return Path(self._pool[0]), self._pool[2]

    def record_pool(self, path: Path, size: int, checkpoints: Iterable[PoolCheckpoint]) -> None:
        """The pool's checkpoints, written when they changed (`durable()`)."""
        pool = (str(path), size, tuple(sorted(checkpoints, key=lambda c: (c.group, c.job, c.stream))))
        if self._path is None or self._pool == pool:
            return
        self._set_pool(pool)
        self._dirty_pool = True
        self._changed()

    def durable(self) -> asyncio.Future[None]:
        """A future done once every change made so far is on disk: its result None, or the
        OSError of the write that failed (the change stays pending: the next `durable()`
        writes it again). Done at once when nothing is pending (or no path was given).
        Call on the event loop."""
        fut = asyncio.get_running_loop().create_future()

        def settle(err: OSError | None) -> None:
            if fut.done():  # (its caller went away)
                return
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
                fut.exception()  # retrieved: a caller that went away does not log it again
        self.when_written(settle)
        return fut

    def when_written(self, callback: Callable[[OSError | None], None]) -> None:
        """Call `callback(None)` on the event loop once every change made so far is on disk,
        or `callback(err)` with the OSError of the write that failed: at once when nothing
        is pending, else straight from the write's completion (no loop turn of a future's
        own in between: a grant waits for this). Starts the write at once when none is in
        flight; the changes made while one is, by any group, share the next. Call on the
        event loop."""
        self._rebind()
        if self._dirty:
            self._waiting.append(callback)
            if self._in_flight is None:  # at once: the caller has made its changes (a turn later costs a grant a turn)
                self._flush()
        elif self._in_flight is not None:
            self._in_flight.append(callback)
        else:
            callback(None)

    async def written(self) -> None:
        """Return once every change made so far is written, or its write failed (logged by
        the writer, not raised here: the next change or `durable()` writes it again)."""
        with contextlib.suppress(OSError):
            await self.durable()

    def close(self) -> None:
        """Stop the writer thread and close the journal (after `written()`: later changes are lost)."""
        if self._path is None:
            return
        self._writer.stop()
        self._journal.release()

    @property
    def _dirty(self) -> bool:
        return bool(self._dirty_epochs or self._dirty_groups or self._dirty_pool)

    def _set_placement(self, group_id: str, p: Placement) -> None:
        self._placements[group_id] = p
        self._stale.add(group_id)

    def _json_of(self, groups: Collection[str]) -> str:
        """The members of a "groups" object for `groups`, from JSON made once per change."""
        for g in [g for g in self._stale if g in groups]:
            p = self._placements[g]
            self._group_json[g] = f"{json.dumps(g)}: " + json.dumps(
                {"holder": p.holder, "mustLeave": list(p.must_leave), "residents": list(p.residents),
                 "movedOut": list(p.moved_out)})
            self._stale.discard(g)
        return ", ".join(self._group_json[g] for g in groups)

    def _set_pool(self, pool: tuple[str, int, tuple[PoolCheckpoint, ...]]) -> None:
        self._pool = pool
        self._pool_json = state_format.pool_json(*pool)

    def _changed(self) -> None:
        """Write after this loop turn, unless a caller's wait (`when_written`) or the write in flight does."""
        if self._flush_scheduled or self._in_flight is not None:
            return
        with contextlib.suppress(RuntimeError):  # no loop running (a start-up adoption): the next durable() writes
            asyncio.get_running_loop().call_soon(self._flush)
            self._flush_scheduled = True

    def _flush(self) -> None:
        """Hand what changed since the last write to the writer thread: a journal line of it,
        or a new snapshot once the journal has grown (`Journal.compact_due`)."""
        self._flush_scheduled = False
        self._rebind()
        if self._in_flight is not None or not self._dirty:
            return
        self._batch = (self._dirty_epochs, self._dirty_groups, self._dirty_pool)
        self._dirty_epochs, self._dirty_groups, self._dirty_pool = set(), set(), False
        self._in_flight, self._waiting = self._waiting, []
        if self._journal.compact_due():
            step: tuple[Callable[[bytes], None], bytes] = (self._journal.compact, self._snapshot())
        else:
            self._seq += 1
            step = (self._journal.append, self._change(*self._batch))
        self._writer.put(*step)

    def _written(self, err: OSError | None) -> None:
        """On the loop: the write in flight ended. Settle its callers (a failed write fails
        those waiting for the next one too, and keeps its changes pending); then write what
        changed meanwhile."""
        callbacks, self._in_flight = self._in_flight or [], None
        # a file removed or replaced while it ran: its callers wait for the whole state, written next (`compact_due`)
        moved = err is None and not self._journal.intact()
        if err is not None or moved:
            self._pending_again()
        if moved:
            callbacks, self._waiting = [], [*callbacks, *self._waiting]
        elif err is not None:
            log.error("orchestrator state file %s not written: %s", self._path, err)
            callbacks, self._waiting = [*callbacks, *self._waiting], []
        for callback in callbacks:
            try:
                callback(err)
            except Exception:  # (one caller's bug must not keep the others waiting)
                log.exception("state file: a caller's callback failed")
        if err is None and self._dirty:
            self._flush()

    def _pending_again(self) -> None:
        """The changes of the write that was in flight are pending again."""
        epochs, groups, pool = self._batch
        self._dirty_epochs |= epochs
        self._dirty_groups |= groups
        self._dirty_pool |= pool

    def _rebind(self) -> None:
        """Used from a new event loop (an in-process restart, a test) while a write handed on the old
        one is in flight: it counts as not written (its report and callers belong to the old loop),
        and the writer is started again for this loop."""
        if self._in_flight is not None and self._writer.loop is not asyncio.get_running_loop():
            self._writer.stop()
            self._pending_again()
            self._in_flight = None

    def _change(self, epochs: set[str], groups: set[str], pool: bool) -> bytes:
        """One journal line: the changed groups' epochs and placements, and the pool if it changed."""
        pool_part = f', "pool": {self._pool_json}' if pool and self._pool_json is not None else ""
        return (f'{{"seq": {self._seq}, "epochs": {json.dumps({g: self._ends[g] for g in epochs})}, '
                f'"groups": {{{self._json_of(groups)}}}{pool_part}}}\n').encode()

    def _snapshot(self) -> bytes:
        """The whole state's bytes, from each part's JSON made once per change."""
        return state_format.snapshot_json(self._seq, json.dumps(self._ends), self._json_of(self._placements),
                                           self._pool_json)


def _unwritable(path: Path, err: OSError) -> ValueError:
    return ValueError(f"orchestrator state file {path} cannot be written ({err}): every grant would be refused; "
                      "give the orchestrator a writable path")
