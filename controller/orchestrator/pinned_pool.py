"""PinnedPool: one node's pinned host memory for cooperative checkpoints, shared by its jobs.

Owned by the orchestrator (one-box mode: `timeslice orchestrator`, the demo, the RL
benchmark). The pool is a file on a memory filesystem (e.g. `/dev/shm`) that every
cooperative job process of the node maps and registers with CUDA once
(`cudaHostRegister`, CUDA Runtime API), so copies run at the link's pinned speed
(reference/checkpoint-h200.md: ~51 GB/s each way on the H200) while the host holds
only what is checkpointed now, not a buffer per job. Its size is the node's bound on
pinned memory: a job whose state does not fit in the largest free range falls back to
its own pageable memory (slower, with a warning), it does not fail.

This class only hands out byte ranges (first fit over sorted free ranges, merged on
free); the bytes are written by the job processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class PinnedPool:
    """`path`: the pool file (mode 0600); `size` in bytes; `populate`: allocate its memory now
    (`posix_fallocate`; raises OSError when the filesystem lacks the room) rather than page by
    page at the first checkpoints."""

    path: Path
    size: int
    populate: bool = False
    _free: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), sorted, disjoint
    _used: dict[int, int] = field(default_factory=dict)  # offset -> length

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"pinned pool size must be > 0 bytes, got {self.size}")
        self.path = Path(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, self.size)
            if self.populate:
                os.posix_fallocate(fd, 0, self.size)  # the node's memory is taken once, here, not mid-switch
        finally:
            os.close(fd)
        self._free = [(0, self.size)]

    def take_largest(self) -> tuple[int, int]:
        """Reserve the largest free range; returns (offset, length), length 0 when full."""
        if not self._free:
            return 0, 0
        i = max(range(len(self._free)), key=lambda k: self._free[k][1])
        off, length = self._free.pop(i)
        self._used[off] = length
        return off, length

    def shrink(self, offset: int, used: int) -> None:
        """Keep only the first `used` bytes of the range at `offset` (0: give it all back)."""
        length = self._used.pop(offset)
        used = max(0, min(used, length))
        if used:
            self._used[offset] = used
        if used < length:
            self._give_back(offset + used, length - used)

    def release(self, offset: int) -> None:
        """Give back the range at `offset` (a no-op for an unknown offset)."""
        length = self._used.pop(offset, None)
        if length:
            self._give_back(offset, length)

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
