"""HostRanges: the byte ranges of a node's pinned pool, handed out to checkpoints and given back.

A pool is one region of host memory that job processes map and register with CUDA once, so
that their checkpoints copy at the link's pinned speed (reference/checkpoint-h200.md: ~51 GB/s
each way on the H200) and the host holds only what is checkpointed now. Two backends use one:
`cooperative` (the orchestrator's `PinnedPool`, a file the jobs map) and `vmm` (the node agent's
`VmmPool`, a memfd it hands to each process's shim). This mixin only does the arithmetic: free
ranges merged when given back, and a state may span several ranges, so fragmentation never
refuses a state that fits in the free total. A class using it sets `size` (bytes), `_free`
(sorted, disjoint (offset, length) pairs) and `_used` (offset -> length).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# The pool of a node without a GPU (tests, demos), bytes.
NO_GPU_BYTES = 10**9
SHM = Path("/dev/shm")  # the memory filesystem a pool file goes on, unless hugetlbfs


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




class HostRanges:
    size: int
    _free: list[tuple[int, int]]
    _used: dict[int, int]

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
        if nbytes <= 0 or self.free_bytes < nbytes:
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

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)
