"""The orchestrator's state file on disk: a snapshot and a journal of the changes since.

Owned by `StateFile` (state_file.py), which decides what is recorded; this module only
reads and writes it. Two files:

- `<path>`, the snapshot: the whole state as one JSON document (`FileDoc`), written whole
  by `write_atomic` (temporary file, fsync, rename, fsync of the folder) at start and
  whenever the journal has grown past `compact_at` bytes (and at least `COMPACT_MIN`).
  Its `seq` is the last journal change it includes.
- `<path>.journal`, the journal: one JSON object per line (`Change`) with the parts that
  changed since the line before, `{"seq": n, "epochs": {group: end}, "groups": {group:
  placement}, "pool": {...}}` (absent parts did not change). A change is written with one
  `pwrite` on a descriptor opened `O_DSYNC`: on return it is on disk (POSIX
  synchronized I/O data integrity; Linux open(2)), with no rename, no new inode and no
  folder fsync. A line is written at the end of the last one that was written whole; a
  write that failed is cut off (`ftruncate`) before the next, so a crash can leave only
  the last line torn, and that change was never reported written: `load` ignores a last
  line that does not parse, and refuses a bad line anywhere else.

Loading applies, over the snapshot, each journal line whose `seq` is past the snapshot's
(a crash between a compaction's snapshot and its truncation of the journal leaves lines
the snapshot already has). Files written before the journal existed are a snapshot
without `seq` and load as they did.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError
from timeslice.driver.atomic import write_atomic

log = logging.getLogger("timeslice.orchestrator")
API_VERSION = "timeslice.dev/orchestrator-state/v1"
COMPACT_MIN = 1 << 20  # bytes of journal before a compaction is considered


class GroupDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    holder: str | None = None
    mustLeave: list[str] = []
    residents: list[str] = []


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
    applied (None: no snapshot). Raises ValueError naming the file, the place and the cause."""
    if not path.exists():
        return None
    try:
        doc = FileDoc.model_validate_json(path.read_bytes())
        lines = journal_path(path).read_bytes().split(b"\n") if journal_path(path).exists() else []
    except OSError as err:
        raise ValueError(f"orchestrator state file {path} cannot be read ({err.strerror})") from None
    except ValidationError as err:
        raise _unreadable(path, err) from None
    while lines and not lines[-1]:
        lines.pop()
    seq = doc.seq
    for n, line in enumerate(lines, 1):
        try:
            change = Change.model_validate_json(line)
        except ValidationError as err:
            if n == len(lines):  # a write cut short by a crash: never reported written
                log.warning("orchestrator state journal %s: its last line is torn (%d bytes); ignored, as the "
                            "write it was never finished", journal_path(path), len(line))
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
    return doc


def _unreadable(path: Path, err: ValidationError, where: str = "") -> ValueError:
    first = err.errors()[0]
    loc = ".".join(map(str, first["loc"])) or "the file"
    return ValueError(f"orchestrator state file {path} is unreadable ({where + ': ' if where else ''}{loc}: "
                      f"{first['msg']}): move it away to start afresh (fencing epochs may then repeat those of "
                      "the last run)")


class Journal:
    """Writes the two files. `compact` and `append` block (disk I/O): call them from one
    thread at a time, off the event loop. Raises OSError when a write fails (nothing
    reported written is lost: a failed compaction leaves the old snapshot and journal, a
    failed append is cut off before the next)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._end = 0  # bytes of whole lines in the journal
        self._torn = False  # the last append failed: cut the journal back to `_end` first
        self.snapshot_bytes = 0

    @property
    def journal_bytes(self) -> int:
        return self._end

    def compact_due(self) -> bool:
        """Whether a new snapshot should replace the journal: it has grown, it is not open,
        or it was removed (what is appended to it would be written nowhere). Does not block
        (`fstat` of an open descriptor): call it on the event loop."""
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
            log.warning("orchestrator state journal %s was removed: the whole state is written again",
                        journal_path(self.path))
            self.close()
        return self._fd is None or self._end >= max(COMPACT_MIN, 8 * self.snapshot_bytes)

    def compact(self, snapshot: bytes) -> None:
        """Replace the snapshot with `snapshot` (a whole `FileDoc`), then empty the journal."""
        write_atomic(self.path, snapshot)
        self.snapshot_bytes = len(snapshot)
        fd = self._open()
        os.ftruncate(fd, 0)
        os.fsync(fd)
        self._end, self._torn = 0, False

    def append(self, line: bytes) -> None:
        """Write one journal line (`line` ends with a newline); on disk when this returns."""
        fd = self._open()
        if self._torn:
            os.ftruncate(fd, self._end)
            self._torn = False
        written = 0
        try:
            while written < len(line):  # (a short write's next one says why: ENOSPC, EFBIG, EIO)
                written += os.pwrite(fd, line[written:], self._end + written)
        except BaseException:
            self._torn = True
            raise
        self._end += written

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        if self._fd is None:
            created = not journal_path(self.path).exists()
            self._fd = os.open(journal_path(self.path), os.O_WRONLY | os.O_CREAT | os.O_DSYNC | os.O_CLOEXEC, 0o600)
            self._end = os.fstat(self._fd).st_size
            self._torn = False
            if created:  # its name too must survive a crash
                folder = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(folder)
                finally:
                    os.close(folder)
        return self._fd


def snapshot_json(seq: int, epochs: str, groups: str, pool: str | None) -> bytes:
    """A snapshot's bytes from its parts' JSON (`groups`: the members of its object)."""
    pool_part = f', "pool": {pool}' if pool is not None else ""
    return (f'{{"apiVersion": {json.dumps(API_VERSION)}, "seq": {seq}, "epochs": {epochs}, '
            f'"groups": {{{groups}}}{pool_part}}}').encode()
