"""A model GPU for tests: a file-backed ledger of device memory that stands in for NVML.

Owned by the node agent's memory source (`gpu_memory.gpus`), which reads it instead of
NVML when `$TIMESLICE_MODEL_GPU` names a ledger file (tests only: the randomized
schedules of `bench/schedules.py` run `timeslice node-agent` with it); written by the
test's job processes, which allocate and free device bytes in it. One GPU per ledger.

The ledger is a JSON file `{"uuid", "total", "procs": {pid: {"bytes", "start"}}}` (bytes;
`start`: the process's start time in clock ticks, /proc/<pid>/stat field 22, so that a
reused PID is not taken for the process that held the memory). Every read and write
holds an exclusive `flock` on the file. A process that ended (gone, or a zombie) holds
nothing once the driver has torn down its context: with `exit_seconds` (a ledger field, 0
by default) its device bytes stay taken that long after an access first found it ended, as
on the H200, where a job's process still held its GPU memory 1.4-9.6 s after its last
line (bench/results/rl-grpo-b-serve-cooperative-declared-66b7230-h200.json, `exit_seconds`);
NVML lists it meanwhile under its PID, which no job owns any more. An allocation that
would take the GPU past its total is an OOM: it changes nothing, appends one JSON line
to `<ledger>.ooms` (who asked for what, and what every process held then) and raises
`ModelGpuOom`.

Tests of the transparent backends also need what the CUDA driver's checkpoint API does to a
process (CUDA Driver API, "CUDA Checkpointing": RUNNING -lock-> LOCKED -checkpoint->
CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING). An entry may carry `cuda` (its state;
absent: running), `host` (bytes its checkpoint moved off the GPU) and `busy` (inside a GPU
call: a lock waits for it, as the driver waits for the work it has queued). The test's job
processes make every GPU step inside `call`, which waits while they are locked or
checkpointed; the fake driver of `bench/fake_cuda` moves their bytes (`cuda_*`). A
checkpointed process is absent from `read`, as NVML lists only live contexts.
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
RUNNING, LOCKED, CHECKPOINTED = "running", "locked", "checkpointed"
CALL_POLL_SECONDS = 0.002  # how often a GPU call or a lock looks again while it waits


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
    def create(cls, path: str | Path, total: int, uuid: str = "GPU-model-0", exit_seconds: float = 0.0) -> ModelGpu:
        """A new empty GPU of `total` bytes at `path` (replacing any ledger there); an ended
        process's device bytes are freed `exit_seconds` after it was found ended. Raises
        ValueError for a total that is not positive or a negative `exit_seconds`, OSError."""
        if total <= 0:
            raise ValueError(f"model GPU total must be > 0 bytes, got {total}")
        if exit_seconds < 0:
            raise ValueError(f"model GPU exit_seconds must be >= 0, got {exit_seconds}")
        Path(path).write_text(json.dumps({"uuid": uuid, "total": total, "procs": {}, "exit_seconds": exit_seconds}))
        return cls(path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The ledger, its dead processes dropped, written back when the block ends: in one
        `pwrite`, padded with spaces to the old length, then truncated, so that a writer killed
        between the two leaves valid JSON (none schedules seed 937: a job process killed there
        left a shorter ledger over the tail of the old one, and every process after it failed
        to read it)."""
        with open(self.path, "rb+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            raw = f.read()
            state = json.loads(raw)
            state["procs"] = _live_or_exiting(state["procs"], float(state.get("exit_seconds", 0.0)))
            yield state
            data = json.dumps(state).encode()
            os.pwrite(f.fileno(), data.ljust(len(raw)), 0)
            os.ftruncate(f.fileno(), len(data))

    def alloc(self, pid: int, nbytes: int, what: str = "") -> None:
        """Take `nbytes` for process `pid`. Raises ModelGpuOom (the ledger unchanged, the OOM
        logged) when they do not fit, ValueError for a negative size or a process that is gone."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        start = start_time(pid)
        if start is None:
            raise ValueError(f"process {pid} is gone")
        with self._locked() as state:
            free = state["total"] - sum(e["bytes"] for e in state["procs"].values())
            if nbytes > free:
                self._oom(state, pid, nbytes, what, free)
            entry = state["procs"].setdefault(str(pid), {"bytes": 0, "start": start})
            entry["bytes"] += nbytes

    def _oom(self, state: dict[str, Any], pid: int, want: int, what: str, free: int) -> None:
        """Log an allocation that does not fit and raise ModelGpuOom."""
        record = {"pid": pid, "want": want, "what": what, "free": free, "total": state["total"],
                  "held": {int(p): e["bytes"] for p, e in state["procs"].items()}, "time": time.monotonic()}
        with open(self.oom_log, "a") as log:
            log.write(json.dumps(record) + "\n")
        raise ModelGpuOom(record)

    def free(self, pid: int, nbytes: int) -> None:
        """Give back `nbytes` of process `pid` (at most what it holds)."""
        with self._locked() as state:
            entry = state["procs"].get(str(pid))
            if entry is not None:
                entry["bytes"] = max(0, entry["bytes"] - nbytes)
                _drop_if_idle(state, pid)

    def held(self, pid: int) -> int:
        """Bytes `pid` holds now."""
        with self._locked() as state:
            return int(state["procs"].get(str(pid), {}).get("bytes", 0))

    def read(self) -> GpuInfo:
        """The GPU as NVML would report it: total, free, bytes per process with a context
        (live, or ended and still being torn down)."""
        with self._locked() as state:
            procs = {int(p): int(e["bytes"]) for p, e in state["procs"].items()
                     if e.get("cuda", RUNNING) != CHECKPOINTED}
            return GpuInfo(state["uuid"], 0, int(state["total"]), int(state["total"]) - sum(procs.values()), procs)

    # -- the CUDA checkpoint states (see the module docstring) --------------------------------
    @contextlib.contextmanager
    def call(self, pid: int) -> Iterator[float]:
        """One GPU call of process `pid` (its own): waits while the process is locked or
        checkpointed, then runs the block as busy (a lock waits for it). Yields the seconds it
        waited."""
        start, t0 = start_time(pid), time.monotonic()
        while True:
            with self._locked() as state:
                entry = state["procs"].setdefault(str(pid), {"bytes": 0, "start": start})
                if entry.get("cuda", RUNNING) == RUNNING:
                    entry["busy"] = True
                    break
            time.sleep(CALL_POLL_SECONDS)
        try:
            yield time.monotonic() - t0
        finally:
            with self._locked() as state:
                entry = state["procs"].get(str(pid))
                if entry is not None:
                    entry.pop("busy", None)
                    _drop_if_idle(state, pid)

    def cuda_state(self, pid: int) -> str | None:
        """`pid`'s CUDA state; None when it has no context here (it never allocated). Raises
        ProcessLookupError when the process is gone."""
        if start_time(pid) is None:
            raise ProcessLookupError(pid)
        with self._locked() as state:
            entry = state["procs"].get(str(pid))
            return None if entry is None else str(entry.get("cuda", RUNNING))

    def cuda_lock(self, pid: int, timeout: float) -> bool:
        """RUNNING -> LOCKED once no GPU call of `pid` runs; False when one still ran after
        `timeout` seconds (nothing changed). Raises ValueError in another state."""
        deadline = time.monotonic() + timeout
        while True:
            with self._locked() as state:
                entry = self._entry(state, pid, RUNNING)
                if not entry.get("busy"):
                    entry["cuda"] = LOCKED
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(CALL_POLL_SECONDS)

    def cuda_checkpoint(self, pid: int) -> int:
        """LOCKED -> CHECKPOINTED: its bytes leave the GPU. Returns them."""
        with self._locked() as state:
            entry = self._entry(state, pid, LOCKED)
            entry["host"], entry["bytes"], entry["cuda"] = entry["bytes"], 0, CHECKPOINTED
            return int(entry["host"])

    def cuda_restore(self, pid: int) -> int:
        """CHECKPOINTED -> LOCKED: its bytes come back. Raises ModelGpuOom (nothing changed)
        when they do not fit."""
        with self._locked() as state:
            entry = self._entry(state, pid, CHECKPOINTED)
            want = int(entry.get("host", 0))
            free = state["total"] - sum(e["bytes"] for e in state["procs"].values())
            if want > free:
                self._oom(state, pid, want, "restore", free)
            entry["bytes"], entry["host"], entry["cuda"] = want, 0, LOCKED
            return want

    def cuda_unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING."""
        with self._locked() as state:
            self._entry(state, pid, LOCKED)["cuda"] = RUNNING

    @staticmethod
    def _entry(state: dict[str, Any], pid: int, want: str) -> dict[str, Any]:
        entry = state["procs"].get(str(pid))
        now = None if entry is None else entry.get("cuda", RUNNING)
        if now != want:
            raise ValueError(f"process {pid} is {now or 'without a context'}, not {want}")
        return entry  # type: ignore[return-value]

    def ooms(self) -> list[dict[str, Any]]:
        """Every OOM so far, oldest first."""
        try:
            return [json.loads(line) for line in self.oom_log.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []


def _live_or_exiting(procs: dict[str, dict[str, Any]], exit_seconds: float) -> dict[str, dict[str, Any]]:
    """`procs` less the processes that ended, except those whose device bytes are still being
    freed: an ended process that holds device bytes is marked `ended` (CLOCK_MONOTONIC seconds,
    system-wide) at the first access that finds it so, and dropped `exit_seconds` after."""
    now, out = time.monotonic(), {}
    for pid, e in procs.items():
        if "ended" not in e and start_time(int(pid)) == e["start"]:
            out[pid] = e
        elif exit_seconds and e["bytes"] and e.get("cuda", RUNNING) != CHECKPOINTED:
            e.setdefault("ended", now)
            if now < e["ended"] + exit_seconds:
                out[pid] = e
    return out


def _drop_if_idle(state: dict[str, Any], pid: int) -> None:
    """Forget `pid`'s entry when it holds nothing, runs (not locked or checkpointed) and is in
    no GPU call."""
    entry = state["procs"][str(pid)]
    if not entry["bytes"] and entry.get("cuda", RUNNING) == RUNNING and not entry.get("busy"):
        del state["procs"][str(pid)]


def from_env() -> ModelGpu | None:
    """The ledger named by `$TIMESLICE_MODEL_GPU`, None when unset."""
    path = os.environ.get(ENV)
    return ModelGpu(path) if path else None
