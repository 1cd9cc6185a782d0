"""StateFile: what a standalone orchestrator must not forget across a restart.

Owned by the orchestrator (`timeslice orchestrator --state-file`). Per group:
- Fencing epochs, used in blocks of `BLOCK`: before the first epoch of a new block is
  granted, the block's end is written, so a restarted orchestrator starts every group at
  the persisted end, past every epoch the previous run granted.
- Its *placement*: the job granted last (it may still compute: after a restart it is the
  group's presumptive holder, whose lease is accepted), the jobs that must leave the GPUs
  before anyone is granted (a holder whose lease lapsed, or dropped, while it may still
  compute), and the jobs that may be on the GPUs (the residents, and the incoming job of a
  switch: an agent finishes a restore whose caller died). Written before each grant and
  each switch, and whenever a job must leave; the agents' records say which jobs are
  checkpointed, so these are adopted only for jobs they do not hold.
And, per node pinned pool (cooperative backend), where each process's checkpoint is: the
ranges offered to a checkpoint command before it is sent (write-ahead: after a restart
they are handed to nobody else until that process reconnects and says what it did, or
the reconnect grace has passed), then its bytes and checksum once acknowledged; dropped
once restored or forgotten. Written by `CooperativeJobs` (its `CheckpointRecords`). A
record does not make its job checkpointed after a restart (the process may have restored
after it was written): until the process confirms it, its job counts as on the GPUs.
Every write is `write_atomic` (fsync'd), off the event loop: a change is made in memory and
marks the file dirty; one task writes a snapshot of everything in a thread, so the changes
of one loop turn, and those made while a write is in flight, share one write (at 1000
groups, writing the whole file on the loop before each grant cut hand-offs from 942/s to
372/s). What must be on disk before something happens waits for `durable()`: a grant is
delivered, a hold joined, a switch started and a checkpoint command sent only once the
state that tells a restarted orchestrator about them is written. File format (JSON):

    {"apiVersion": "timeslice.dev/orchestrator-state/v1",
     "epochs": {"<group>": <end of block>},
     "groups": {"<group>": {"holder": "<job>" | null, "mustLeave": ["<job>", ...],
                            "residents": ["<job>", ...]}},
     "pool": {"path": "<file>", "bytes": <size>,
              "checkpoints": [{"group": "<group>", "job": "<job>", "stream": "<stream id>", "pid": <pid>,
                               "ranges": [[<offset>, <length>], ...],
                               "bytes": <bytes used> | null, "checksum": <crc> | null}]}}

("groups" and "pool" are optional: files written before they existed still load; a
checkpoint whose "bytes" is null was offered, not yet acknowledged.) In a cluster the
controller adopts epochs and the holder from claim status instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError
from timeslice.driver.atomic import write_atomic

log = logging.getLogger("timeslice.orchestrator")
API_VERSION = "timeslice.dev/orchestrator-state/v1"
BLOCK = 1000


@dataclass(frozen=True)
class Placement:
    """`holder`: the job granted last (None: none yet); `must_leave`: jobs to checkpoint
    before anyone is granted; `residents`: jobs that may be on the GPUs."""

    holder: str | None = None
    must_leave: tuple[str, ...] = ()
    residents: tuple[str, ...] = ()


class _GroupPlacement(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    holder: str | None = None
    mustLeave: list[str] = []
    residents: list[str] = []


@dataclass(frozen=True)
class PoolCheckpoint:
    """One process's place in the pinned pool: `ranges` [(offset, length)] in bytes, filled
    in order; `nbytes` used from their start and `checksum` (see
    `timeslice.memory_commands.pool_checksum`), both None while the checkpoint command is out."""

    group: str
    job: str
    stream: str
    pid: int
    ranges: tuple[tuple[int, int], ...]
    nbytes: int | None = None
    checksum: int | None = None


class _PoolCheckpoint(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    group: str
    job: str
    stream: str
    pid: int
    ranges: list[tuple[NonNegativeInt, NonNegativeInt]]
    bytes: NonNegativeInt | None = None
    checksum: NonNegativeInt | None = None


class _Pool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str
    bytes: NonNegativeInt
    checkpoints: list[_PoolCheckpoint] = []


class _File(BaseModel):
    """The file's schema (`strict`: an epoch is an integer >= 0, a job id a string)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    apiVersion: Literal["timeslice.dev/orchestrator-state/v1"]
    epochs: dict[str, NonNegativeInt]
    groups: dict[str, _GroupPlacement] = {}
    pool: _Pool | None = None


class StateFile:
    """`path`: the state file (None: in memory only, nothing survives a restart). Raises
    ValueError, naming the file and the cause, when it cannot be read, is not a valid
    state file, or cannot be written (checked at once: an orchestrator that cannot persist
    refuses every grant, so it must not start)."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._ends: dict[str, int] = {}
        self._placements: dict[str, Placement] = {}
        self._pool: tuple[str, int, tuple[PoolCheckpoint, ...]] | None = None  # (path, bytes, checkpoints)
        # each part's JSON, serialized again only when it changed (`_snapshot`)
        self._epochs_json: str | None = None
        self._group_json: dict[str, str] = {}
        self._stale: set[str] = set()  # groups whose `_group_json` is out of date
        self._pool_json: str | None = None
        self._dirty = False  # changed since the snapshot last written (or being written)
        self._writer: asyncio.Task[None] | None = None
        self._next: list[asyncio.Future[None]] = []  # durable() callers that the next snapshot covers
        self._writing: list[asyncio.Future[None]] = []  # ... that the snapshot being written covers
        if path is None:
            return
        if path.exists():
            try:
                data = _File.model_validate_json(path.read_bytes())
            except OSError as err:
                raise ValueError(f"orchestrator state file {path} cannot be read ({err.strerror})") from None
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(map(str, first["loc"])) or "the file"
                raise ValueError(f"orchestrator state file {path} is unreadable ({where}: {first['msg']}): move "
                                 "it away to start afresh (fencing epochs may then repeat those of the last run)") \
                    from None
            self._ends = dict(data.epochs)
            self._placements = {g: Placement(p.holder, tuple(p.mustLeave), tuple(p.residents))
                                for g, p in data.groups.items()}
            self._stale = set(self._placements)
            if data.pool is not None:
                self._pool = (data.pool.path, data.pool.bytes, tuple(
                    PoolCheckpoint(c.group, c.job, c.stream, c.pid, tuple((o, n) for o, n in c.ranges), c.bytes,
                                   c.checksum) for c in data.pool.checkpoints))
        try:
            write_atomic(path, self._snapshot())
        except OSError as err:
            raise ValueError(f"orchestrator state file {path} cannot be written ({err}): every grant would be "
                             "refused; give the orchestrator a writable path") from None

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
        self._epochs_json = None
        self._changed()
        log.debug("epoch block reserved group=%s up_to=%d", group_id, self._ends[group_id])

    def record(self, group_id: str, holder: str | None, must_leave: Iterable[str], residents: Iterable[str]) -> None:
        """The group's placement, written when it changed (`durable()`)."""
        p = Placement(holder, tuple(sorted(must_leave)), tuple(sorted(set(residents))))
        if self._path is None or self._placements.get(group_id) == p:
            return
        self._placements[group_id] = p
        self._stale.add(group_id)
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
        self._pool = pool
        self._pool_json = None
        self._changed()

    def durable(self) -> asyncio.Future[None]:
        """A future done once every change made so far is on disk: its result None, or the
        OSError of the write that failed (the change stays pending: the next `durable()`
        writes it again). Done at once when nothing is pending (or no path was given).
        Call on the event loop."""
        fut = asyncio.get_running_loop().create_future()
        if self._dirty:
            self._next.append(fut)
            self._start_writer()
        elif self._writer is not None and not self._writer.done():
            self._writing.append(fut)
        else:
            fut.set_result(None)
        return fut

    def _changed(self) -> None:
        self._dirty = True
        with contextlib.suppress(RuntimeError):  # no loop running (a start-up adoption): the next durable() writes
            self._start_writer()

    def _start_writer(self) -> None:
        if self._writer is None or self._writer.done():  # started now, it runs after this loop turn's changes
            self._writer = asyncio.get_running_loop().create_task(self._write(), name="orchestrator-state-file")

    async def _write(self) -> None:
        """Write snapshots while changes are pending; settle the `durable()` futures each covers."""
        assert self._path is not None
        while self._dirty:
            self._dirty = False
            self._writing, self._next = self._next, []
            try:
                await asyncio.to_thread(write_atomic, self._path, self._snapshot())
            except Exception as exc:  # (a bug too must fail the waiting grants, never leave them waiting)
                err = exc if isinstance(exc, OSError) else OSError(f"{type(exc).__name__}: {exc}")
                self._dirty = True
                log.error("orchestrator state file %s not written: %s", self._path, err)
                for fut in (*self._writing, *self._next):
                    if not fut.done():
                        fut.set_exception(err)
                        fut.exception()  # retrieved: a caller that went away does not log it again
                self._writing, self._next = [], []
                return
            for fut in self._writing:
                if not fut.done():
                    fut.set_result(None)
            self._writing = []

    async def written(self) -> None:
        """Return once every change made so far is written, or its write failed (logged by
        the writer, not raised here: the next change or `durable()` writes it again)."""
        with contextlib.suppress(OSError):
            await self.durable()

    def _snapshot(self) -> bytes:
        """The file's bytes now, built on the loop from each part's JSON, serialized once per
        change (`_group_json`): a write at 1000 groups re-serializes only what changed."""
        if self._epochs_json is None:
            self._epochs_json = json.dumps(self._ends)
        for g in self._stale:
            p = self._placements[g]
            self._group_json[g] = f"{json.dumps(g)}: " + json.dumps(
                {"holder": p.holder, "mustLeave": list(p.must_leave), "residents": list(p.residents)})
        self._stale.clear()
        if self._pool_json is None and self._pool is not None:
            path, size, checkpoints = self._pool
            self._pool_json = json.dumps({"path": path, "bytes": size, "checkpoints": [
                {"group": c.group, "job": c.job, "stream": c.stream, "pid": c.pid,
                 "ranges": [list(r) for r in c.ranges],
                 "bytes": c.nbytes, "checksum": c.checksum} for c in checkpoints]})
        pool = f', "pool": {self._pool_json}' if self._pool_json is not None else ""
        return (f'{{"apiVersion": {json.dumps(API_VERSION)}, "epochs": {self._epochs_json}, '
                f'"groups": {{{", ".join(self._group_json.values())}}}{pool}}}').encode()
