"""The orchestrator's state file format: its records, its schema, and how it is read.

The snapshot `<path>` and the journal `<path>.journal` (written by `Journal`,
state_journal.py) hold one state, as one document:

    {"apiVersion": "timeslice.dev/orchestrator-state/v1", "seq": <last change included>,
     "epochs": {"<group>": <end of block>},
     "groups": {"<group>": {"holder": "<job>" | null, "mustLeave": ["<job>", ...],
                            "residents": ["<job>", ...], "movedOut": ["<job>", ...]}},
     "pool": {"path": "<file>", "bytes": <size>,
              "checkpoints": [{"group": "<group>", "job": "<job>", "stream": "<stream id>", "pid": <pid>,
                               "ranges": [[<offset>, <length>], ...],
                               "bytes": <bytes used> | null, "checksum": <crc> | null}]}}

A journal line (`Change`) has "seq" and the parts that changed since the line before.
("seq", "groups", "movedOut" and "pool" are optional: files written before they existed load as they
did; a checkpoint whose "bytes" is null was offered, not yet acknowledged.) `read` applies
over the snapshot each line whose "seq" is past the snapshot's (a crash between a
compaction's snapshot and its emptying of the journal leaves lines it already has); a
crash tears only the last line, never reported written: it is dropped, and a bad line
elsewhere is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

log = logging.getLogger("timeslice.orchestrator")
API_VERSION = "timeslice.dev/orchestrator-state/v1"


@dataclass(frozen=True)
class Placement:
    """`holder`: the job granted last (None: none yet); `must_leave`: jobs to checkpoint
    before anyone is granted; `residents`: jobs that may be on the GPUs; `moved_out`: jobs
    checkpointed (or frozen) by the node agents."""

    holder: str | None = None
    must_leave: tuple[str, ...] = ()
    residents: tuple[str, ...] = ()
    moved_out: tuple[str, ...] = ()


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


class GroupDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    holder: str | None = None
    mustLeave: list[str] = []
    residents: list[str] = []
    movedOut: list[str] = []


class PoolCheckpointDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    group: str
    job: str
    stream: str
    pid: int
    ranges: list[tuple[NonNegativeInt, NonNegativeInt]]
    bytes: NonNegativeInt | None = None
    checksum: NonNegativeInt | None = None


class PoolDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str
    bytes: NonNegativeInt
    checkpoints: list[PoolCheckpointDoc] = []


class FileDoc(BaseModel):
    """The snapshot's schema (`strict`: an epoch is an integer >= 0, a job id a string)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    apiVersion: Literal["timeslice.dev/orchestrator-state/v1"]
    seq: NonNegativeInt = 0
    epochs: dict[str, NonNegativeInt]
    groups: dict[str, GroupDoc] = {}
    pool: PoolDoc | None = None


class Change(BaseModel):
    """One journal line."""

    model_config = ConfigDict(extra="forbid", strict=True)

    seq: NonNegativeInt
    epochs: dict[str, NonNegativeInt] = {}
    groups: dict[str, GroupDoc] = {}
    pool: PoolDoc | None = None


def journal_path(path: Path) -> Path:
    return path.with_name(path.name + ".journal")


def load(path: Path) -> FileDoc | None:
    """The state as last written: the snapshot at `path` with its journal's later changes
    applied (None: no snapshot and no journal). Raises ValueError naming the file, the place
    and the cause (also where the snapshot is gone but its journal is not: the journal alone
    is not the state)."""
    return read(path)[0]


def read(path: Path) -> tuple[FileDoc | None, bool]:
    """(`load(path)`, whether the journal's last line was dropped as torn)."""
    if not path.exists():
        with contextlib.suppress(OSError):
            if journal_path(path).stat().st_size:
                raise ValueError(f"orchestrator state file {path} is missing, but its journal "
                                 f"{journal_path(path)} is not empty: put the snapshot back, or move the journal "
                                 "away to start afresh (fencing epochs may then repeat those of the last run)")
        return None, False
    try:
        doc = FileDoc.model_validate_json(path.read_bytes())
        lines = journal_path(path).read_bytes().split(b"\n") if journal_path(path).exists() else []
    except OSError as err:
        raise ValueError(f"orchestrator state file {path} cannot be read ({err.strerror})") from None
    except ValidationError as err:
        raise _unreadable(path, err) from None
    while lines and not lines[-1]:
        lines.pop()
    seq, torn = doc.seq, False
    for n, line in enumerate(lines, 1):
        try:
            change = Change.model_validate_json(line)
        except ValidationError as err:
            if n == len(lines):  # a write cut short by a crash: never reported written
                log.warning("orchestrator state journal %s: its last line is torn (%d bytes); ignored, as the "
                            "write it was never finished", journal_path(path), len(line))
                torn = True
                break
            raise _unreadable(journal_path(path), err, f"line {n}") from None
        if change.seq <= doc.seq:  # (already in the snapshot)
            continue
        if change.seq <= seq:
            raise ValueError(f"orchestrator state journal {journal_path(path)} is unreadable (line {n}: change "
                             f"{change.seq} after {seq}): move both files away to start afresh")
        seq = change.seq
        doc.epochs.update(change.epochs)
        doc.groups.update(change.groups)
        if change.pool is not None:
            doc.pool = change.pool
    doc.seq = seq
    return doc, torn


def _unreadable(path: Path, err: ValidationError, where: str = "") -> ValueError:
    first = err.errors()[0]
    loc = ".".join(map(str, first["loc"])) or "the file"
    return ValueError(f"orchestrator state file {path} is unreadable ({where + ': ' if where else ''}{loc}: "
                      f"{first['msg']}): move it away to start afresh (fencing epochs may then repeat those of "
                      "the last run)")


def snapshot_json(seq: int, epochs: str, groups: str, pool: str | None) -> bytes:
    """A snapshot's bytes from its parts' JSON (`groups`: the members of its object)."""
    pool_part = f', "pool": {pool}' if pool is not None else ""
    return (f'{{"apiVersion": {json.dumps(API_VERSION)}, "seq": {seq}, "epochs": {epochs}, '
            f'"groups": {{{groups}}}{pool_part}}}').encode()


def pool_json(path: str, size: int, checkpoints: tuple[PoolCheckpoint, ...]) -> str:
    """The "pool" part of the state (`PoolDoc`) as JSON."""
    return json.dumps({"path": path, "bytes": size, "checkpoints": [
        {"group": c.group, "job": c.job, "stream": c.stream, "pid": c.pid, "ranges": [list(r) for r in c.ranges],
         "bytes": c.nbytes, "checksum": c.checksum} for c in checkpoints]})
