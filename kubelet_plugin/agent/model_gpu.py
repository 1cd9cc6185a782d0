"""A model GPU for tests: a file-backed ledger of device memory that stands in for NVML.

Owned by the node agent's memory source (`gpu_memory.gpus`), which reads it instead of
NVML when `$TIMESLICE_MODEL_GPU` names a ledger file (tests only: the randomized
schedules of `bench/schedules.py` run `timeslice node-agent` with it); written by the
test's job processes, which allocate and free device bytes in it. One GPU per ledger.

The ledger is a JSON file `{"uuid", "total", "procs": {pid: {"bytes", "start"}}}` (bytes;
`start`: the process's start time in clock ticks, /proc/<pid>/stat field 22, so that a
reused PID is not taken for the process that held the memory). Every read and write
holds an exclusive `flock` on the file. As a GPU driver does, a process that ended (gone,
or a zombie) holds nothing: its entry is dropped at the next access. An allocation that
would take the GPU past its total is an OOM: it changes nothing, appends one JSON line
to `<ledger>.ooms` (who asked for what, and what every process held then) and raises
`ModelGpuOom`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from timeslice.driver.peercred import start_time
from timeslice.kubelet_plugin.agent.gpu_info import GpuInfo

ENV = "TIMESLICE_MODEL_GPU"


class ModelGpuOom(MemoryError):
    """An allocation that did not fit: `record` is what was appended to the OOM log."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(f"model GPU out of memory: pid {record['pid']} asked for {record['want']} bytes "
                         f"({record['what']}), {record['free']} of {record['total']} free")
        self.record = record


class ModelGpu:
    """The ledger at `path` (made by `create`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.oom_log = self.path.with_name(self.path.name + ".ooms")

    @classmethod
    def create(cls, path: str | Path, total: int, uuid: str = "GPU-model-0") -> ModelGpu:
        """A new empty GPU of `total` bytes at `path` (replacing any ledger there). Raises
        ValueError for a total that is not positive, OSError."""
        if total <= 0:
            raise ValueError(f"model GPU total must be > 0 bytes, got {total}")
        Path(path).write_text(json.dumps({"uuid": uuid, "total": total, "procs": {}}))
        return cls(path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The ledger, its dead processes dropped, written back when the block ends."""
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            state = json.loads(f.read())
            state["procs"] = {pid: e for pid, e in state["procs"].items() if start_time(int(pid)) == e["start"]}
            yield state
            f.seek(0)
            f.write(json.dumps(state))
            f.truncate()

    def alloc(self, pid: int, nbytes: int, what: str = "") -> None:
        """Take `nbytes` for process `pid`. Raises ModelGpuOom (the ledger unchanged, the OOM
        logged) when they do not fit, ValueError for a negative size or a process that is gone."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        start = start_time(pid)
        if start is None:
            raise ValueError(f"process {pid} is gone")
        with self._locked() as state:
            used = {int(p): e["bytes"] for p, e in state["procs"].items()}
            free = state["total"] - sum(used.values())
            if nbytes > free:
                record = {"pid": pid, "want": nbytes, "what": what, "free": free, "total": state["total"],
                          "held": used, "time": time.monotonic()}
                with open(self.oom_log, "a") as log:
                    log.write(json.dumps(record) + "\n")
                raise ModelGpuOom(record)
            entry = state["procs"].setdefault(str(pid), {"bytes": 0, "start": start})
            entry["bytes"] += nbytes

    def free(self, pid: int, nbytes: int) -> None:
        """Give back `nbytes` of process `pid` (at most what it holds)."""
        with self._locked() as state:
            entry = state["procs"].get(str(pid))
            if entry is not None:
                entry["bytes"] = max(0, entry["bytes"] - nbytes)
                if not entry["bytes"]:
                    del state["procs"][str(pid)]

    def held(self, pid: int) -> int:
        """Bytes `pid` holds now."""
        with self._locked() as state:
            return int(state["procs"].get(str(pid), {}).get("bytes", 0))

    def read(self) -> GpuInfo:
        """The GPU as NVML would report it: total, free, bytes per live process."""
        with self._locked() as state:
            procs = {int(p): int(e["bytes"]) for p, e in state["procs"].items()}
            return GpuInfo(state["uuid"], 0, int(state["total"]), int(state["total"]) - sum(procs.values()), procs)

    def ooms(self) -> list[dict[str, Any]]:
        """Every OOM so far, oldest first."""
        try:
            return [json.loads(line) for line in self.oom_log.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []


def from_env() -> ModelGpu | None:
    """The ledger named by `$TIMESLICE_MODEL_GPU`, None when unset."""
    path = os.environ.get(ENV)
    return ModelGpu(path) if path else None
