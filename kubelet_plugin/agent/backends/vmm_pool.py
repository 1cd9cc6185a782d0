"""VmmPool: the node's pinned host memory that `vmm` checkpoints are copied into.

Owned by the node agent's `VmmBackend`. The pool is a memfd (memfd_create(2), no file name, no
mount): the agent hands its descriptor to each job process's shim over the shim's socket
(SCM_RIGHTS, unix(7)), and the shim maps it and registers it with CUDA once, in the background,
from the first time the agent sees the process (a memory report or a step). A checkpoint then
copies into memory already pinned: registering fresh host memory on the switch's path was most of
a checkpoint's time (H200: 50 GB out in 1.83-2.05 s, 11.4 s for a process's first, against 1.0 s
in; bench/results/vmm-switch-50gb-d3c0a95-h200.json). Only processes the agent hands it to can
reach it, and it hands it only to processes of its own user: no other user's job can read a state
in it (a root agent's jobs of other users checkpoint into host memory of their own). It lives
while the agent or a process maps it; a restarted agent makes a new one, and a process
checkpointed in the old one restores from it.

Its pages are taken when the first shim registers it (never before: an agent with no `vmm` job
costs nothing) and stay taken: pinned memory is not reclaimable. Huge pages (MFD_HUGETLB) when the
host has reserved enough that no mapping has claimed (`huge_pages.free_pages`, as for the
cooperative pool; registering them was ~7x faster on the H200 host), else regular shared memory.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field

from timeslice.driver import huge_pages
from timeslice.driver.host_ranges import HostRanges

log = logging.getLogger("timeslice.agent")
SIZE_ENV = "TIMESLICE_VMM_POOL_BYTES"  # the pool's size in bytes (0: none); default host_ranges.default_size


@dataclass
class VmmPool(HostRanges):
    """`size` bytes of a memfd `fd` (huge pages when `huge`). Raises OSError (memfd_create or
    ftruncate refused) from `create`."""

    size: int
    fd: int
    huge: bool = False
    _free: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), sorted, disjoint
    _used: dict[int, int] = field(default_factory=dict)  # offset -> length

    @classmethod
    def create(cls, size: int) -> VmmPool:
        if size <= 0:
            raise ValueError(f"vmm pool size must be > 0 bytes, got {size}")
        page = huge_pages.default_page_size()
        huge = page > 0 and huge_pages.free_pages(page) * page >= size
        if huge:
            size = -(-size // page) * page
        fd = os.memfd_create("timeslice-vmm-pool", os.MFD_CLOEXEC | (os.MFD_HUGETLB if huge else 0))
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            raise
        log.info("vmm pool bytes=%d huge_pages=%s: registered by each job process's shim as it is first seen", size,
                 huge)
        pool = cls(size, fd, huge, [(0, size)])
        weakref.finalize(pool, os.close, fd)  # the agent's reference goes with the pool object
        return pool

    @property
    def inode(self) -> int:
        """Names this pool to a shim, which may still map an older one (`checkpoint pool=<inode> ...`)."""
        return os.fstat(self.fd).st_ino

    def populated_free(self) -> int:
        """Free bytes of the pool whose memory is taken already, so that the host's MemAvailable no
        longer counts them (a regular pool's pages are taken as its first shim registers it; a
        huge-page one's were reserved by the host beforehand)."""
        if self.huge:
            return self.free_bytes
        taken = os.fstat(self.fd).st_blocks * 512
        return max(0, self.free_bytes - (self.size - taken))
