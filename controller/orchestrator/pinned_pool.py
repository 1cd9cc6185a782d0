"""PinnedPool: one node's pinned host memory for cooperative checkpoints, shared by its jobs.

Owned by the orchestrator (one-box mode: `timeslice orchestrator`, the demo, the RL
benchmark). The pool is a file on a memory filesystem (`/dev/shm`, or hugetlbfs where
the host reserved huge pages for it: `huge_pages`) that every cooperative job process of
the node maps and registers with CUDA once (`cudaHostRegister`, CUDA Runtime API), so
copies run at the link's pinned speed (reference/checkpoint-h200.md: ~51 GB/s each way on
the H200) while the host holds only what is checkpointed now, not a buffer per job. Its size is the node's bound on
pinned memory: a job whose state does not fit in the largest free range falls back to
its own pageable memory (slower, with a warning), it does not fail.

This class only hands out byte ranges (`HostRanges`). The bytes are written by the job
processes; the orchestrator writes them only when it creates the file (`populate`).
`host_ranges.default_size` is the size a node gets unless told (`timeslice serve`).

Creation and reopening (an orchestrator restart must not rewrite what clients still map):
the file is created exclusively (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600). A file that
already exists is reopened as it is, never truncated nor written (`reopened`), once it is
proven private: a regular file (a symbolic link is refused, not followed), owned by this
user, with no group or other access, of the configured size; anything else raises
`PoolRefused` and the orchestrator does not start. Only processes of the same user can
open it (the clients check the same owner and mode before they map it), so no job of
another user can read or write a state in it. The caller decides at `close` whether to
remove it (not while processes map it or are checkpointed in it).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from timeslice.driver import huge_pages
from timeslice.driver.host_ranges import SHM, HostRanges

log = logging.getLogger("timeslice.cooperative")


def in_use(path: Path) -> bool:
    """Whether a process this user can see maps or holds open `path` (`/proc/<pid>/maps`
    and `/proc/<pid>/fd`; processes of other users are not readable, and cannot open a
    private pool anyway)."""
    name = str(path)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if name in (proc / "maps").read_text():
                return True
            if any(os.readlink(fd) == name for fd in (proc / "fd").iterdir()):
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


def remove_left(path: Path, shm: Path = SHM) -> bool:
    """Remove `path`'s folder when it is a private pool an earlier `timeslice serve` left
    under `shm` or a hugetlbfs mount (`timeslice-pool-*`, this user's, not a symbolic link) and nothing uses it
    (`in_use`): a serve that was killed (SIGKILL) did not remove its own, and each start
    makes a new one. True when removed; a pool in use stays (its processes restore from it)."""
    folder = path.parent
    try:
        st = folder.lstat()
    except OSError:
        return False
    roots = {shm, *(m.path for m in huge_pages.mounts())}
    if folder.parent not in roots or not folder.name.startswith("timeslice-pool-") or not stat.S_ISDIR(st.st_mode) \
            or st.st_uid != os.getuid() or in_use(path):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    log.warning("removed the pinned pool %s an earlier orchestrator left (nothing maps it)", path)
    return True


class PoolRefused(OSError):
    """The pool file exists but is not one this orchestrator may reopen (a symbolic link,
    not a regular file, another owner, group or other access, another size)."""


@dataclass
class PinnedPool(HostRanges):
    """`path`: the pool file (mode 0600); `size` in bytes; `populate`: allocate its memory now
    (`posix_fallocate`; raises OSError when the filesystem lacks the room) and write it once
    (tmpfs leaves fallocated pages to be cleared at their first fault: on the H200 host the
    first process to register a 95 GB pool took 43 s doing that, the next ones 8-9 s), in
    parallel threads, rather than page by page inside the first checkpoints. An existing
    file is reopened untouched (`reopened` True; see the module docstring). Raises
    PoolRefused (an existing file that is not private to this user), OSError."""

    path: Path
    size: int
    populate: bool = False
    reopened: bool = False  # the file existed: it may hold checkpoints of processes that map it
    _free: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), sorted, disjoint
    _used: dict[int, int] = field(default_factory=dict)  # offset -> length

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"pinned pool size must be > 0 bytes, got {self.size}")
        self.path = Path(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            self.reopened = True
            self._reopen()
        except OSError as err:
            raise OSError(err.errno, f"pinned pool {self.path} ({self.size / 1e9:.1f} GB): {err.strerror}") from err
        else:
            try:
                try:
                    os.fchmod(fd, 0o600)
                    huge = huge_pages.page_size_of(self.path)
                    if huge is not None and self.size % huge:
                        raise OSError(errno.EINVAL, f"a pool on hugetlbfs is a whole number of its {huge}-byte pages")
                    os.ftruncate(fd, self.size)
                    if self.populate:
                        os.posix_fallocate(fd, 0, self.size)  # the node's memory is taken once, here, not mid-switch
                        if huge is None:  # (hugetlbfs clears each page as it allocates it)
                            _write_zeros(fd, self.size)
                finally:
                    os.close(fd)
            except OSError as err:
                self.close()
                raise OSError(err.errno, f"pinned pool {self.path} ({self.size / 1e9:.1f} GB): {err.strerror}") \
                    from err
        self._free = [(0, self.size)]

    def _reopen(self) -> None:
        """Check the existing file without writing it. Raises PoolRefused."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            why = "it is a symbolic link (not followed)" if err.errno == errno.ELOOP else err.strerror
            raise PoolRefused(err.errno, f"pinned pool {self.path} exists and cannot be reopened: {why}; remove it "
                                         "(or name another path) to start") from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        problems = []
        if not stat.S_ISREG(st.st_mode):
            problems.append("it is not a regular file")
        if st.st_uid != os.geteuid():
            problems.append(f"it is owned by uid {st.st_uid}, not this orchestrator's uid {os.geteuid()}")
        if st.st_mode & 0o077:
            problems.append(f"its mode {stat.S_IMODE(st.st_mode):04o} gives group or other users access (0600 "
                            "needed: checkpointed states must stay private to their user)")
        if not problems and st.st_size != self.size:
            problems.append(f"it holds {st.st_size} bytes, the configuration says {self.size} (jobs may still map "
                            "it: remove it once none does, or configure its size)")
        if problems:
            raise PoolRefused(errno.EPERM, f"pinned pool {self.path} exists and is refused: {'; '.join(problems)}")
        log.warning("pinned pool reopened path=%s bytes=%d: its content is kept (checkpointed jobs are learned from "
                    "the state file and from their processes as they reconnect)", self.path, self.size)

    def close(self) -> None:
        """Remove the pool file (job processes that mapped it keep their mapping; a restarted
        orchestrator creates a new one)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _write_zeros(fd: int, size: int) -> None:
    """Write zeros over [0, size) of `fd` through a shared mapping, one slice per thread:
    `ctypes.memset` releases the GIL and page faults run in parallel (a `write` to tmpfs
    takes the file's lock: one writer at a time, ~1.7 GB/s measured on the H200 host)."""
    threads = max(1, min(8, os.cpu_count() or 1))
    step = -(-size // threads)
    with mmap.mmap(fd, size) as mm:
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            base = ctypes.addressof(anchor)
            with ThreadPoolExecutor(threads, thread_name_prefix="pinned-pool") as pool:
                list(pool.map(lambda start: ctypes.memset(base + start, 0, min(step, size - start)),
                              range(0, size, step)))
        finally:
            del anchor  # the mapping closes only once no ctypes object exports it
