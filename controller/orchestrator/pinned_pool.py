"""PinnedPool: one node's pinned host memory for cooperative checkpoints, shared by its jobs.

Owned by the orchestrator (one-box mode: `timeslice orchestrator`, the demo, the RL
benchmark). The pool is a file on a memory filesystem (e.g. `/dev/shm`) that every
cooperative job process of the node maps and registers with CUDA once
(`cudaHostRegister`, CUDA Runtime API), so copies run at the link's pinned speed
(reference/checkpoint-h200.md: ~51 GB/s each way on the H200) while the host holds
only what is checkpointed now, not a buffer per job. Its size is the node's bound on
pinned memory: a job whose state does not fit in the largest free range falls back to
its own pageable memory (slower, with a warning), it does not fail.

This class only hands out byte ranges (free ranges merged when given back); a job's
state may span several ranges, so fragmentation never refuses a state that fits in the
free total. The bytes are written by the job processes. `default_size` is the size a node gets unless
told (`timeslice serve`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# The pool of a node without a GPU (tests, demos), bytes.
NO_GPU_BYTES = 10**9
SHM = Path("/dev/shm")


def default_size(gpu_bytes: int, shm: Path = SHM) -> int:
    """Bytes of a pool nobody sized: the GPUs' total memory (`gpu_bytes`, bytes; 0: no GPU,
    then `NO_GPU_BYTES`), capped by half the host's memory (what is checkpointed is what
    does not fit on the GPUs: the host keeps the other half for the jobs) and by the free
    space of the memory filesystem `shm`. Raises OSError when `shm` cannot be read."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, min(gpu_bytes or NO_GPU_BYTES, host // 2, shutil.disk_usage(shm).free))


@dataclass
class PinnedPool:
    """`path`: the pool file (mode 0600); `size` in bytes; `populate`: allocate its memory now
    (`posix_fallocate`; raises OSError when the filesystem lacks the room) and write it once
    (tmpfs leaves fallocated pages to be cleared at their first fault: on the H200 host the
    first process to register a 95 GB pool took 43 s doing that, the next ones 8-9 s), in
    parallel threads, rather than page by page inside the first checkpoints."""

    path: Path
    size: int
    populate: bool = False
    _free: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), sorted, disjoint
    _used: dict[int, int] = field(default_factory=dict)  # offset -> length

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"pinned pool size must be > 0 bytes, got {self.size}")
        self.path = Path(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, self.size)
                if self.populate:
                    os.posix_fallocate(fd, 0, self.size)  # the node's memory is taken once, here, not mid-switch
                    _write_zeros(fd, self.size)
            finally:
                os.close(fd)
        except OSError as err:
            self.close()
            raise OSError(err.errno, f"pinned pool {self.path} ({self.size / 1e9:.1f} GB): {err.strerror}") from err
        self._free = [(0, self.size)]

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
        """Remove the pool file (job processes that mapped it keep their mapping)."""
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
