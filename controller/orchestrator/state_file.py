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
once restored or forgotten. Written by `CooperativeJobs`. A record does not make its job
checkpointed after a restart (the process may have restored after it was written): until
the process confirms it, its job counts as on the GPUs.
Every write is `write_atomic` (fsync'd). File format (JSON):

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
            if data.pool is not None:
                self._pool = (data.pool.path, data.pool.bytes, tuple(
                    PoolCheckpoint(c.group, c.job, c.stream, c.pid, tuple((o, n) for o, n in c.ranges), c.bytes,
                                   c.checksum) for c in data.pool.checkpoints))
        try:
            self._write()
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
        """Before `epoch` is granted: persist a new block when it passes the current one.
        Raises OSError (the grant must not happen: its epoch could repeat after a restart)."""
        if self._path is None or epoch <= self._ends.get(group_id, 0):
            return
        self._ends[group_id] = epoch + BLOCK
        self._write()
        log.debug("epoch block reserved group=%s up_to=%d", group_id, self._ends[group_id])

    def record(self, group_id: str, holder: str | None, must_leave: Iterable[str], residents: Iterable[str]) -> None:
        """Persist the group's placement when it changed. Raises OSError."""
        p = Placement(holder, tuple(sorted(must_leave)), tuple(sorted(set(residents))))
        if self._path is None or self._placements.get(group_id) == p:
            return
        self._placements[group_id] = p
        self._write()

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
        """Persist the pool's checkpoints when they changed. Raises OSError."""
        pool = (str(path), size, tuple(sorted(checkpoints, key=lambda c: (c.group, c.job, c.stream))))
        if self._path is None or self._pool == pool:
            return
        self._pool = pool
        self._write()

    def _write(self) -> None:
        assert self._path is not None
        groups = {g: {"holder": p.holder, "mustLeave": list(p.must_leave), "residents": list(p.residents)}
                  for g, p in self._placements.items()}
        data: dict[str, object] = {"apiVersion": API_VERSION, "epochs": self._ends, "groups": groups}
        if self._pool is not None:
            path, size, checkpoints = self._pool
            data["pool"] = {"path": path, "bytes": size, "checkpoints": [
                {"group": c.group, "job": c.job, "stream": c.stream, "pid": c.pid,
                 "ranges": [list(r) for r in c.ranges],
                 "bytes": c.nbytes, "checksum": c.checksum} for c in checkpoints]}
        write_atomic(self._path, json.dumps(data).encode())
