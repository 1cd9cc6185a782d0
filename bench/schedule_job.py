#!/usr/bin/env python3
"""One job process of a randomized schedule (`bench/schedules.py`), on a model GPU.

Started (and restarted after a kill) by bench/schedules.py as
`python bench/schedule_job.py SPEC_JSON`. It uses the real client
(`TimeSliceOrchestratorClient`: `acquire`/`release`, and `serve_memory_commands`, the
path `timeslice.torch.register` takes) with a store whose "device" state is a bytearray
accounted in the model GPU's ledger (`model_gpu.ModelGpu`, `$TIMESLICE_MODEL_GPU`). Its
memory grows after its first hold as a real RL job's does: the first hold builds the
model (`ctx` + `model` bytes; the context never leaves the GPU), each generate holds a KV
cache (`kv` bytes) for its phase, the first train adds the optimizer state (`optim` bytes,
registered and moved with the model). An allocation past the GPU's total is an OOM:
logged, and the process exits with code 99 (inside a restore command the command fails
instead, as a CUDA OOM inside `resize_` would).

The state is deterministic: after train step s its bytes are `content(seed, s + 1, n)`
(a SHA-256 tiled over n bytes), so a state altered anywhere (a restore from the wrong or a
rewritten pool range, a checkpoint under a running phase) is found bitwise at the next
phase. Every GPU phase logs `begin` and `end` (monotonic seconds, comparable across
processes) to the job's event log (JSON lines, `log` in the spec), from which the harness
finds two jobs computing at once. A `SwitchFailed` is retried here and counted (until the
client retries it itself). SIGTERM ends the job cleanly (`client.close()`).

Under a transparent backend (spec `backend` other than "cooperative": `cuda` over the fake
driver of bench/fake_cuda) the job registers nothing: its state stays in its own memory and
the agent moves it behind its back. Then every GPU step (an allocation, a free, each
`TICK_SECONDS` of compute) is a call of the model GPU (`ModelGpu.call`), which waits while the
driver has the process locked or checkpointed, as CUDA calls do; a wait, or a gap between
ticks longer than `GAP_SECONDS` (the process was stopped), is logged as `paused`, so that only
the time it could compute counts towards two jobs computing at once. A phase that starts while
its state is not on the GPU (granted before its restore) is logged as altered.

Under backend `vmm` the job's state (model and optimizer) is device memory that the
timeslice-vmm shim serves (`cudaMalloc` through the shim, over the fake driver of
bench/fake_cuda/vmm, whose memory is really unmapped while checkpointed: a phase that touched
its state before its restore would end the process with SIGSEGV); the ledger holds its context
and KV caches only, and the agent's `vmm` backend moves the state through the shim behind its
back. Every compute tick reads the state.

Under backend `app` the job is also its own inference engine: before its first acquire it
serves vLLM's sleep API on 127.0.0.1 (`engine_port` in the spec; `Engine`), as
`driver/app_engine.py` documents it. `POST /sleep?level=1` copies the state to host memory and
frees it on the model GPU (the context stays), `POST /wake_up` brings it back, `GET
/is_sleeping` answers where it is; a sleep during a phase is logged as altered and fails
(HTTP 500), as does a wake that runs out of memory.

Spec keys: job, group, target, ledger, log, seed, steps, ctx, model, optim, kv (bytes),
gen_s, reward_s, train_s (seconds), declare (bytes, 0: none; exported as
`TIMESLICE_MEMORY` by the harness), register_late (open the memory-command stream after
the first hold, when the model is on the GPU, rather than at start), backend, engine_port
(backend app).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from timeslice import TimeSliceOrchestratorClient
from timeslice.errors import SwitchFailed
from timeslice.kubelet_plugin.agent.model_gpu import ModelGpu, ModelGpuOom
from timeslice.memory_commands import Ranges, pieces

OOM_EXIT = 99
ACQUIRE_TIMEOUT_SECONDS = 300.0
TICK_SECONDS = 0.01  # transparent backends: compute runs in GPU calls this long
GAP_SECONDS = 0.1  # transparent backends: a wait or a gap this long between GPU calls is logged as paused


def content(seed: int, step: int, n: int) -> bytes:
    """The job's state after `step` train steps: n bytes, a pure function of (seed, step)."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return (digest * (n // len(digest) + 1))[:n]


class EventLog:
    """Appends one JSON line per event (O_APPEND: whole lines even if the process dies)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def __call__(self, ev: str, **fields: Any) -> None:
        os.write(self._fd, (json.dumps({"ev": ev, "t": time.monotonic(), "pid": os.getpid(), **fields}) + "\n")
                 .encode())


class ModelStore:
    """The registered state (model, then optimizer) on the model GPU: `device` is its bytes
    while on the GPU, None before the first hold and while checkpointed."""

    def __init__(self, gpu: ModelGpu, log: EventLog) -> None:
        self.gpu, self.log, self.pid = gpu, log, os.getpid()
        self.lock = threading.Lock()
        self.device: bytearray | None = None
        self.moved = False
        self.computing = ""  # the phase running now ("" between phases)
        self.pool: mmap.mmap | None = None
        self.own: bytes | None = None
        self.ranges: Ranges = []
        self.size = 0  # registered bytes

    def nbytes(self) -> int:
        return self.size

    def use_pool(self, pool: mmap.mmap) -> None:
        self.pool = pool

    def checkpoint(self, ranges: Ranges) -> tuple[int, bool]:
        with self.lock:
            if self.computing:  # the client's own check should have refused it
                self.log("altered", why=f"checkpoint command during the {self.computing} phase")
                raise RuntimeError(f"checkpoint during the {self.computing} phase")
            if self.moved or self.device is None:
                return (self.size if self.moved else 0), self.own is None and self.moved
            n = len(self.device)
            in_pool = self.pool is not None and n <= sum(k for _, k in ranges)
            if in_pool:
                for off, src, k in pieces(ranges, 0, n):
                    self.pool[off:off + k] = self.device[src:src + k]  # type: ignore[index]
                self.ranges, self.own = ranges, None
            else:
                self.own = bytes(self.device)
            self.device, self.moved = None, True
            self.gpu.free(self.pid, n)
            self.log("checkpointed", bytes=n, pool=in_pool)
            return n, in_pool

    def restore(self, ranges: Ranges) -> int:
        with self.lock:
            if not self.moved:
                return 0
            n = self.size
            try:
                self.gpu.alloc(self.pid, n, "restore")
            except ModelGpuOom as err:
                self.log("oom", what="restore", want=n, record=err.record)
                raise
            if self.own is not None:
                self.device = bytearray(self.own)
            else:
                ranges = ranges or self.ranges
                dev = bytearray(n)
                for off, src, k in pieces(ranges, 0, n):
                    dev[src:src + k] = self.pool[off:off + k]  # type: ignore[index]
                self.device = dev
            self.moved, self.own = False, None
            self.log("restored", bytes=n)
            return n


class Engine(BaseHTTPRequestHandler):
    """vLLM's sleep API over the job's `ModelStore` (backend `app`; module docstring)."""

    store: ModelStore  # set on the subclass `serve_engine` makes

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path not in ("/sleep", "/wake_up"):
            self._answer(404, b"")
            return
        try:
            if path == "/sleep":
                self.store.checkpoint([])
            else:
                self.store.restore([])
        except Exception as err:  # an exception in the engine: FastAPI answers 500
            self._answer(500, json.dumps({"detail": f"{type(err).__name__}: {err}"}).encode())
            return
        self._answer(200, b"")

    def do_GET(self) -> None:
        if urlsplit(self.path).path != "/is_sleeping":
            self._answer(404, b"")
            return
        self._answer(200, json.dumps({"is_sleeping": self.store.moved}).encode())

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_engine(store: ModelStore, port: int) -> None:
    """Serve `Engine` over `store` on 127.0.0.1:`port` in a daemon thread."""
    handler = type("StoreEngine", (Engine,), {"store": store})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)  # reuses the address: a restarted job binds again
    threading.Thread(target=server.serve_forever, daemon=True, name="engine").start()


class Job:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.log = EventLog(spec["log"])
        self.gpu = ModelGpu(spec["ledger"])
        self.store = ModelStore(self.gpu, self.log)
        self.client = TimeSliceOrchestratorClient(spec["target"], spec["job"], spec["group"])
        self.step = 0  # train steps done
        self.loaded = False
        self.transparent = spec.get("backend", "cooperative") != "cooperative"
        self.vmm = spec.get("backend") == "vmm"
        self.vmm_buffer = 0  # backend vmm: the address of the state's device memory (model and optimizer)
        self.pid = os.getpid()

    def state_bytes(self, data: bytes) -> bytearray | memoryview:
        """The state's device bytes holding `data`: a bytearray, or under backend vmm a view of
        its device memory (the shim's), allocated at the first call for the state's largest size."""
        if not self.vmm:
            return bytearray(data)
        if not self.vmm_buffer:
            ptr, size = ctypes.c_void_p(), max(1, self.spec["model"] + self.spec["optim"])
            if ctypes.CDLL(None).cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) != 0:
                self.log("oom", what="state", want=size, record={})
                os._exit(OOM_EXIT)
            self.vmm_buffer = ptr.value or 0
        ctypes.memmove(self.vmm_buffer, data, len(data))
        return memoryview((ctypes.c_char * len(data)).from_address(self.vmm_buffer)).cast("B")

    @contextlib.contextmanager
    def gpu_call(self) -> Iterator[None]:
        """One GPU step: under a transparent backend a call of the model GPU (it waits while the
        process is locked or checkpointed; a wait is logged as paused)."""
        if not self.transparent:
            yield
            return
        t0 = time.monotonic()
        with self.gpu.call(self.pid) as waited:
            if waited >= GAP_SECONDS:
                self.log("paused", start=t0, until=t0 + waited)
            yield

    def alloc(self, n: int, what: str) -> None:
        try:
            with self.gpu_call():
                self.gpu.alloc(self.pid, n, what)
        except ModelGpuOom as err:
            self.log("oom", what=what, want=n, record=err.record)
            os._exit(OOM_EXIT)  # a CUDA OOM: the job dies inside its phase

    def free(self, n: int) -> None:
        with self.gpu_call():
            self.gpu.free(self.pid, n)

    def compute(self, seconds: float) -> None:
        """`seconds` of compute; under a transparent backend in GPU calls of `TICK_SECONDS`,
        a gap between them longer than `GAP_SECONDS` logged as paused."""
        if not self.transparent:
            time.sleep(seconds)
            return
        left, last = seconds, time.monotonic()
        while left > 0:
            with self.gpu_call():
                t = time.monotonic()
                if t - last >= GAP_SECONDS:  # stopped between two calls (SIGSTOP, a freeze)
                    self.log("paused", start=last, until=t)
                if self.vmm and self.store.device is not None:
                    self.store.device[0]  # (a state that is not back faults here)
                time.sleep(min(TICK_SECONDS, left))
                last = time.monotonic()
                left -= last - t

    def hold(self, kind: str, work: Any) -> None:
        group = self.spec["group"]
        retries = 0
        while True:
            self.log("acquire", kind=kind, step=self.step)
            try:
                self.client.acquire(group, timeout=ACQUIRE_TIMEOUT_SECONDS)
                break
            except SwitchFailed as err:  # until the client retries it itself (helper `client-retry`)
                retries += 1
                self.log("switch_failed", kind=kind, step=self.step, error=str(err))
                time.sleep(min(0.05 * retries, 0.5))
        self.log("granted", kind=kind, step=self.step)
        try:
            work()
        finally:
            # a phase cut short (SIGTERM) stopped computing here, before the release lets another job in
            self.log("releasing", kind=kind, step=self.step)
            self.client.release(group)
            self.log("released", kind=kind, step=self.step)

    def _check(self, where: str) -> None:
        """The state must be on the GPU and equal to what the steps done make (under the lock)."""
        s = self.store
        if s.device is None:
            self.log("altered", why=f"state not on the GPU {where} (step {self.step})")
            return
        cuda = self.gpu.cuda_state(self.pid) if self.transparent else None
        if cuda not in (None, "running"):
            self.log("altered", why=f"state not on the GPU {where} (step {self.step}): the process is {cuda}")
        if bytes(s.device) != content(self.spec["seed"], self.step, len(s.device)):
            zero = not any(s.device)
            self.log("altered", why=f"state bytes differ {where} (step {self.step}){' (all zero)' if zero else ''}",
                     zero=zero)

    def phase(self, kind: str, seconds: float, extra: int = 0) -> None:
        spec, s = self.spec, self.store
        if not self.loaded:  # the model is built on the GPU inside the first hold
            self.alloc(spec["ctx"] + (0 if self.vmm else spec["model"]), "model")
            with s.lock:
                s.device, s.size = self.state_bytes(content(spec["seed"], 0, spec["model"])), spec["model"]
            self.loaded = True
        if extra:
            self.alloc(extra, kind)
        with s.lock:
            self._check(f"at the start of {kind}")
            s.computing = kind
        self.log("begin", kind=kind, step=self.step)
        self.compute(seconds)
        self.log("end", kind=kind, step=self.step)
        with s.lock:
            s.computing = ""
            self._check(f"at the end of {kind}")
        if extra:
            self.free(extra)
        if kind == "train":
            if self.step == 0 and spec["optim"] and not self.vmm:
                self.alloc(spec["optim"], "optimizer")  # optimizer state appears at the first step
            n = spec["model"] + spec["optim"]
            with s.lock:
                s.device, s.size = self.state_bytes(content(spec["seed"], self.step + 1, n)), n
            self.step += 1

    def register(self) -> None:
        """Open the memory-command stream (`timeslice.torch.register`'s path)."""
        loop = self.client.serve_memory_commands(self.store, self.spec["group"])
        if not loop.ready.wait(60) or loop.error:
            self.log("error", error=f"memory commands not connected: {loop.error}")
            sys.exit(1)

    def run(self) -> None:
        spec = self.spec
        self.log("start", job=spec["job"])
        late = spec.get("register_late", False)
        if spec.get("backend") == "app":
            serve_engine(self.store, spec["engine_port"])
        if not late and not self.transparent:  # registered before the model is on the GPU (0 bytes then)
            self.register()
        try:
            while self.step < spec["steps"]:
                self.hold("generate", lambda: self.phase("generate", spec["gen_s"], spec["kv"]))
                if late and self.step == 0 and not self.transparent:  # once the model is on the GPU (README)
                    late = False
                    self.register()
                time.sleep(spec["reward_s"])  # the reward, on the CPU, outside any hold
                self.hold("train", lambda: self.phase("train", spec["train_s"]))
            self.log("done", steps=self.step)
        finally:
            self.client.close()


def main() -> None:
    spec = json.loads(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a clean end: close() runs
    job = Job(spec)
    try:
        job.run()
    except SystemExit:
        raise
    except BaseException as err:
        job.log("error", error=f"{type(err).__name__}: {err}")
        raise


if __name__ == "__main__":
    main()
