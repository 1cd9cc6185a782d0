"""Journal: writes the orchestrator's state file (format: state_format.py), a snapshot and a journal.

Owned by `StateFile` (state_file.py), which decides what is recorded; the writes run in
its writer thread (state_writer.py). Holds `<path>.lock` (one orchestrator process per
file). Files:
- `<path>`, the snapshot: the whole state, written by `write_atomic` at start and once the
  journal has passed `COMPACT_MIN` and 8 times the snapshot; its "seq" is the last journal
  change it includes.
- `<path>.journal`: one line per change. A change is one `pwrite` on a descriptor opened
  `O_DSYNC`: on disk when it returns (POSIX synchronized I/O data integrity; Linux
  open(2)), with no rename, inode or folder fsync. Lines follow the last one written whole
  (a failed write is cut off first), so a crash tears only the last line (`keep_torn`
  keeps a journal whose last line was dropped).
- Either file removed, renamed or replaced while the orchestrator runs (`intact`): the
  whole state is written again before anyone is told a change is written.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from pathlib import Path

from timeslice.controller.orchestrator.state_format import journal_path
from timeslice.driver.atomic import write_atomic

log = logging.getLogger("timeslice.orchestrator")
COMPACT_MIN = 1 << 20  # bytes of journal before a compaction is considered


class Journal:
    """Writes the two files; holds `<path>.lock` (a POSIX record lock: one orchestrator
    process per state file) from construction to `release()`. `compact` and `append` block
    (disk I/O): call them from one thread at a time, off the event loop. Raises OSError when
    a write fails (nothing reported written is lost: a failed compaction leaves the old
    snapshot and journal, a failed append is cut off before the next), ValueError at
    construction when another process holds the lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._end = 0  # bytes of whole lines in the journal
        self._torn = False  # the last append failed: cut the journal back to `_end` first
        self._snapshot_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the snapshot last written
        self.snapshot_bytes = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock: int | None = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                         0o600)
        try:
            fcntl.lockf(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.release()
            raise ValueError(f"orchestrator state file {path} is in use by another orchestrator (it holds "
                             f"{path.name}.lock): two would overwrite each other's records and repeat fencing "
                             "epochs; stop the other one, or give this one its own state file") from None

    def compact_due(self) -> bool:
        """Whether a new snapshot should replace the journal: it has grown, it is not open,
        or either file is not where it was written (removed, renamed, replaced: what is
        appended would not be found at the next start). Call it on the event loop while
        no write is in flight (it may close the journal)."""
        if self._fd is not None and not self.intact():
            log.warning("orchestrator state file %s or its journal was removed or replaced: the whole state is "
                        "written again", self.path)
            self.close()
        return self._fd is None or self._end >= max(COMPACT_MIN, 8 * self.snapshot_bytes)

    def intact(self) -> bool:
        """Whether the journal open here and the snapshot last written are the files at
        their paths (a `stat` of each path and an `fstat`: no disk I/O)."""
        try:
            return (self._fd is not None and _id(os.stat(journal_path(self.path))) == _id(os.fstat(self._fd))
                    and _id(os.stat(self.path)) == self._snapshot_id)
        except OSError:
            return False

    def compact(self, snapshot: bytes) -> None:
        """Replace the snapshot with `snapshot` (a whole `FileDoc`), then empty the journal."""
        fd = self._open()  # (first: a journal it creates is named durably by write_atomic's fsync of the folder)
        write_atomic(self.path, snapshot)
        self._snapshot_id = _id(os.stat(self.path))
        self.snapshot_bytes = len(snapshot)
        try:
            os.ftruncate(fd, 0)
            self._end, self._torn = 0, False
            os.fsync(fd)
        except BaseException:
            self.close()  # (opened again, and its size read, by the next compaction)
            raise

    def append(self, line: bytes) -> None:
        """Write one journal line (`line` ends with a newline); on disk when this returns."""
        fd = self._fd
        if fd is None:
            raise OSError(errno.ENOENT, "no state journal open (the whole state is written next)",
                          str(journal_path(self.path)))
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

    def keep_torn(self) -> None:
        """Keep a journal whose last line `read` dropped beside it, as
        `<journal>.torn-<unix seconds>` (what was dropped may be someone's edit), before
        the first compaction empties it."""
        kept = journal_path(self.path).with_name(f"{journal_path(self.path).name}.torn-{int(time.time())}")
        os.replace(journal_path(self.path), kept)
        log.warning("orchestrator state journal kept as %s (its last line was dropped)", kept)

    def close(self) -> None:
        """Close the journal (the lock is kept: `release`)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Close the journal and give up the lock."""
        self.close()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(journal_path(self.path), os.O_WRONLY | os.O_CREAT | os.O_DSYNC | os.O_CLOEXEC, 0o600)
            self._end = os.fstat(self._fd).st_size
            self._torn = False
        return self._fd


def _id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
