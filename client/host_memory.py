"""The host memory a copy of GPU state may take: `MemAvailable` of /proc/meminfo, less a reserve.

Shared by the node agent (a `cuda` checkpoint is refused before anything is touched when the
host lacks memory for it) and `timeslice.torch` (a cooperative checkpoint that the pinned pool
cannot take goes to its process's own buffer only when the host has room for it): past
`MemAvailable` the kernel's OOM killer ends the job instead (H100 host, 3 x 57 GB:
bench/results/rl-grpo-b-serve-cooperative-hugepages-h100.json). `MemAvailable`: the kernel's
estimate of memory available for new allocations without swapping (proc(5)).
"""

from __future__ import annotations

import logging

log = logging.getLogger("timeslice.host_memory")
# Bytes kept for the host (its own processes, page cache the jobs need) beyond what a copy takes.
RESERVE_BYTES = 2 << 30


def available_bytes() -> int:
    """`MemAvailable` of /proc/meminfo, bytes (0 when unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as err:
        log.warning("cannot read /proc/meminfo: %s", err)
    return 0
