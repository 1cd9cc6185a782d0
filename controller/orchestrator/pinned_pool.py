"""PinnedPool: one node's pinned host memory for cooperative checkpoints, shared by its jobs.

Owned by the orchestrator (one-box mode: `timeslice orchestrator`, the demo, the RL
benchmark). The pool is a file on a memory filesystem (`/dev/shm`, or hugetlbfs where
the host reserved huge pages for it: `huge_pages`) that every cooperative job process of
the node maps and registers with CUDA once (`cudaHostRegister`, CUDA Runtime API), so
copies run at the link's pinned speed (reference/checkpoint-h200.md: ~51 GB/s each way on
the H200) while the host holds only what is checkpointed now, not a buffer per job. Its size is the node's bound on
pinned memory: a job whose state does not fit in the largest free range falls back to
its own pageable memory (slower, with a warning), it does not fail.

This class only hands out byte ranges (free ranges merged when given back); a job's
state may span several ranges, so fragmentation never refuses a state that fits in the
free total. The bytes are written by the job processes; the orchestrator writes them
only when it creates the file (`populate`). `default_size` is the size a node gets unless
told (`timeslice serve`).

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

from timeslice.controller.orchestrator import huge_pages

log = logging.getLogger("timeslice.cooperative")
# The pool of a node without a GPU (tests, demos), bytes.
NO_GPU_BYTES = 10**9
SHM = Path("/dev/shm")


def default_size(gpu_bytes: int, shm: Path | None = SHM) -> int:
    """Bytes of a pool nobody sized: the GPUs' total memory (`gpu_bytes`, bytes; 0: no GPU,
    then `NO_GPU_BYTES`), capped by three quarters of the host's memory and (unless None) by
    the free space of the memory filesystem `shm`. What is checkpointed is what does not fit on the
    GPUs, and a swap holds two states at once (the one going out is written before the one
    coming in is read back): on the H200 host (135 GB) half the host held one 50 GB state,
    so every swap of two such jobs waited for host memory (bench/results/
    rl-grpo-b-serve-cooperative-h200.json); three quarters hold two and leave the jobs'
    own processes a quarter. Raises OSError when `shm` cannot be read."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = host if shm is None else shutil.disk_usage(shm).free
    return max(0, min(gpu_bytes or NO_GPU_BYTES, host * 3 // 4, free))


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
class PinnedPool:
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

    def reserve(self, ranges: list[tuple[int, int]]) -> None:
        """Mark `ranges` used (a checkpoint learned after a restart). Raises ValueError,
        reserving nothing, when one is outside the pool, empty, or not wholly free."""
        free = list(self._free)
        for off, length in ranges:
            hit = next((i for i, (f, n) in enumerate(free) if f <= off and off + length <= f + n), None)
            if length <= 0 or hit is None:
                raise ValueError(f"pool range [{off}, {off + length}) is not free in the {self.size}-byte pool")
            f, n = free.pop(hit)
            free[hit:hit] = [r for r in ((f, off - f), (off + length, f + n - off - length)) if r[1] > 0]
        self._free = sorted(free)
        for off, length in ranges:
            self._used[off] = length

    def take_all(self) -> list[tuple[int, int]]:
        """Reserve every free range, largest first; [(offset, length)], [] when full. A
        checkpoint fills them in order as one buffer, then `keep` gives back the rest."""
        taken = sorted(self._free, key=lambda r: (-r[1], r[0]))
        self._free = []
        for off, length in taken:
            self._used[off] = length
        return taken

    def take(self, nbytes: int) -> list[tuple[int, int]]:
        """Reserve free ranges, largest first, that hold `nbytes` together (the last one cut to
        fit); [] when the free total is smaller (nothing is reserved then). For one process
        of several checkpointed at once; `keep` gives back what it did not use."""
        if nbytes <= 0 or sum(n for _, n in self._free) < nbytes:
            return []
        taken: list[tuple[int, int]] = []
        free: list[tuple[int, int]] = []
        left = nbytes
        for off, length in sorted(self._free, key=lambda r: (-r[1], r[0])):
            n = min(length, left)
            if n > 0:
                taken.append((off, n))
                self._used[off] = n
                left -= n
            if n < length:
                free.append((off + n, length - n))
        self._free = sorted(free)
        return taken

    def keep(self, ranges: list[tuple[int, int]], used: int) -> list[tuple[int, int]]:
        """Of `ranges` (from `take_all`), keep the first `used` bytes in order and give back
        the rest; returns the ranges kept."""
        kept = []
        for off, length in ranges:
            n = max(0, min(length, used))
            used -= n
            self._used.pop(off, None)
            if n:
                self._used[off] = n
                kept.append((off, n))
            if n < length:
                self._give_back(off + n, length - n)
        return kept

    def release(self, ranges: list[tuple[int, int]]) -> None:
        """Give back `ranges` (ranges this pool does not hold are ignored)."""
        for off, _ in ranges:
            length = self._used.pop(off, None)
            if length:
                self._give_back(off, length)

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def _give_back(self, offset: int, length: int) -> None:
        ranges = sorted([*self._free, (offset, length)])
        merged: list[tuple[int, int]] = []
        for off, n in ranges:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self._free = merged

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
