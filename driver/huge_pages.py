"""Huge pages for the node's pinned pool: which hugetlbfs mount can hold it.

Every cooperative job process registers the parts of the pool it checkpoints into with CUDA
(`cudaHostRegister`) on its first switches, on the switch's path. On the H200 host a file in
2 MiB huge pages was registered ~7x faster than one on /dev/shm in 4 KiB pages: 16 GB by a
second process in 0.33 s (48.8 GB/s) against 2.7 s (5.9 GB/s), the copies through either at
55 GB/s (bench/results/pin-probe-h200.json); shape b's first checkpoints spent 5.2-6.5 s of
their 6.1-7.5 s registering 47 GB (bench/results/rl-grpo-b-serve-cooperative-6c19413-h200.json).

A pool goes on a hugetlbfs mount only when the host has reserved enough huge pages that no
mapping has claimed yet (`vm.nr_hugepages`; the counters of `/sys/kernel/mm/hugepages/`, Linux
Documentation/admin-guide/mm/hugetlbpage.rst): surplus pages (`nr_overcommit_hugepages`) come
from free memory at allocation and may not be found once it is fragmented. Else /dev/shm.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTS = Path("/proc/self/mounts")
MEMINFO = Path("/proc/meminfo")
SYSFS = Path("/sys/kernel/mm/hugepages")
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class HugeMount:
    """A hugetlbfs mount: `path`, its `page_size` (bytes) and `free`: bytes of reserved huge
    pages of that size not used nor promised to a mapping (bounded by the mount's own `size=`)."""

    path: Path
    page_size: int
    free: int


def _mount_table() -> list[tuple[Path, str]]:
    """(mount point, filesystem type) of each line of `MOUNTS` (whose spaces and tabs are octal
    escapes: proc(5)); [] when unreadable."""
    try:
        lines = MOUNTS.read_text().splitlines()
    except OSError:
        return []
    table = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            table.append((Path(_OCTAL.sub(lambda m: chr(int(m[1], 8)), fields[1])), fields[2]))
    return table


def mounts() -> list[HugeMount]:
    """This process's hugetlbfs mounts with their free huge pages."""
    found = []
    for point, kind in _mount_table():
        if kind != "hugetlbfs":
            continue
        try:
            st = os.statvfs(point)
        except OSError:
            continue
        page = st.f_bsize
        free = free_pages(page) * page
        if st.f_blocks:  # mounted with size=: its own bound too
            free = min(free, st.f_bavail * page)
        found.append(HugeMount(point, page, free))
    return found


def free_pages(page_size: int) -> int:
    """Huge pages of `page_size` bytes reserved and neither used nor promised (free - resv); 0
    when the kernel has none of that size."""
    folder = SYSFS / f"hugepages-{page_size // 1024}kB"
    try:
        return max(0, int((folder / "free_hugepages").read_text()) - int((folder / "resv_hugepages").read_text()))
    except (OSError, ValueError):
        return 0


def default_page_size() -> int:
    """The default huge page size in bytes, the one MFD_HUGETLB takes (`Hugepagesize` of
    /proc/meminfo, Documentation/admin-guide/mm/hugetlbpage.rst); 0 when the kernel has none."""
    try:
        with MEMINFO.open() as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("Hugepagesize:")), 0)
    except (OSError, ValueError, IndexError):
        return 0


def mount_for(size: int) -> HugeMount | None:
    """The hugetlbfs mount with the most free huge pages that holds a pool of `size` bytes (rounded
    down to its page size) and in which this user may create a folder; None when none does."""
    fit = [m for m in mounts()
           if 0 < size // m.page_size * m.page_size <= m.free and os.access(m.path, os.W_OK | os.X_OK)]
    return max(fit, key=lambda m: m.free, default=None)


def page_size_of(path: Path) -> int | None:
    """The huge page size (bytes) of the hugetlbfs mount `path` lies on; None when it lies on
    another filesystem (the mount is the longest mount point above it; the last of equals)."""
    real = Path(os.path.realpath(path))
    best: tuple[Path, str] | None = None
    for point, kind in _mount_table():
        if (point == real or point in real.parents) and (best is None or len(point.parts) >= len(best[0].parts)):
            best = (point, kind)
    if best is None or best[1] != "hugetlbfs":
        return None
    return os.statvfs(best[0]).f_bsize
