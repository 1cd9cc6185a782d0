"""MemorySnapshot: a group's GPU and host memory as its node agents reported it (`GetMemory`, NVML), merged.

Terms. A *device* is one GPU of one node, keyed `"<agent target>/<GPU uuid>"` (`agent_of`). A `MemorySnapshot`
merges the node agents' reports: per device its total and free bytes, per job its bytes on each device (and the
most it held since the last report, sampled by the agent every 100 ms) and the size of its checkpoint. It is
made by `MemoryReports.memory` (memory_reports.py) and read by the placement functions (placement.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int


@dataclass
class MemorySnapshot:
    """The group's memory as its node agents reported it; bytes; `taken_at` monotonic seconds (when asked).
    `host_available`: per agent target, host bytes a checkpoint may use; `pool_free`: per agent target, the
    free bytes of the node's pinned pool (cooperative): a checkpoint goes wholly into the pool when its free
    ranges hold it, else wholly into its process's host memory (`timeslice.torch`), never split."""

    devices: dict[str, DeviceMemory] = field(default_factory=dict)
    device_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> device -> bytes
    checkpointed_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    # job -> device -> bytes a checkpoint frees, where less than what it holds (cooperative:
    # only the registered state leaves; the CUDA context and the rest stay)
    movable_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    host_available: dict[str, int] = field(default_factory=dict)
    pool_free: dict[str, int] = field(default_factory=dict)
    # job -> device -> the most it held since the agent's previous report (sampled every
    # 100 ms while the orchestrator watches a hold); at least device_bytes
    peak_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    unseen: set[str] = field(default_factory=set)  # jobs whose device bytes are what they registered, not NVML's
    unanswered: set[str] = field(default_factory=set)  # agent targets whose report failed
    incarnations: dict[str, str] = field(default_factory=dict)  # agent target -> the run that answered
    # job -> its processes the bytes were counted from, "<agent target>/<pid>:<start time>"
    processes: dict[str, set[str]] = field(default_factory=dict)
    exiting_bytes: dict[str, int] = field(default_factory=dict)  # device -> what ended processes still hold
    busy: set[str] = field(default_factory=set)  # jobs with a step in flight on an agent (`AgentMemory.busy`)
    taken_at: float = field(default_factory=time.monotonic)

    def on_device(self, job: str) -> dict[str, int]:
        return self.device_bytes.get(job, {})


def agent_of(device: str) -> str:
    """The agent target of a device key `"<target>/<uuid>"` (targets may hold slashes)."""
    return device.rsplit("/", 1)[0]
