"""A fake inference engine on loopback with vLLM's or SGLang's sleep/wake API (backend `app`).

Used by tests/test_app_backend.py and bench/app_switch.py as a real process (aiohttp
server): `python -m tests.fake_engine --engine vllm|sglang --name a --log FILE
--memory-dir DIR` prints `ready <port>` once it listens on 127.0.0.1. It answers as
`driver/app_engine.py` documents the upstream servers:

- vllm: `POST /sleep?level=N` (empty 200), `POST /wake_up` (empty 200), `GET /is_sleeping`
  (`{"is_sleeping": bool}`); a failure is an HTTP 500, as FastAPI answers an exception.
- sglang: `POST /release_memory_occupation`, `POST /resume_memory_occupation` (JSON body,
  `tags` optional; 200 `null`, failure 400 `{"error": {"message": ...}}`). A second
  release, or a resume while awake, fails (as SGLang's tag bookkeeping does).

The GPU memory it "holds" (`AWAKE_BYTES` or `--awake-bytes`, `ASLEEP_BYTES` asleep: the CUDA context) is
written to `<memory-dir>/<pid>.json` as `{"pid": pid, "bytes": n}` on each change: the
tests' stand-in for NVML reads it. Each completed call appends `<name> <call>` to the
log file (O_APPEND, one write per line), so tests see the order across engines.
`nvml_stand_in(memory_dir)` is the agent's NVML stand-in over those files.
Faults, set with `POST /fake/fault` and a JSON body: `{"wake": "fail"}` (every wake
fails), `{"wake": "hold"}` (a wake logs `wake-held` and waits until the fault is cleared,
then wakes), `{"sleep": "hang"}` (a sleep never answers), `{"sleep": "keep-memory"}` (it
answers but frees nothing), `{"sleep": "huge-body"}` (a sleep answers HTTP 500 with a
`HUGE_BODY_BYTES` body, control characters first, streamed; it does not sleep),
`{"is_sleeping": "lie"}` (`GET /is_sleeping` answers true, asleep or not),
`{"is_sleeping": "huge-body"}` (it answers 200 with such a body), `{"redirect": URL}` (every
call of the engine's API answers 307 to URL + the call's path and query); `"ok"` clears one.
`GET /fake/stats`: `{"hits": ["METHOD /path", ...], "body_sent": n, "body_ended": bool}`, the
API calls it got (any answer) and the bytes of the last huge body sent so far.
`POST /v1/completions` stands for a client's request (its rollouts): logged `generate` and
answered 200 while awake; while asleep logged `generate-asleep` and answered 503 (a request
to a sleeping engine fails).
`--delay S`: each sleep and wake takes S seconds (the engine's own work).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from timeslice.kubelet_plugin.agent.gpu_memory import GpuInfo

AWAKE_BYTES = 8 << 30
ASLEEP_BYTES = 512 << 20
GPU_BYTES = 141 << 30
HUGE_BODY_BYTES = 1 << 30
HUGE_HEAD = b"boom\x1b[31m\r\nX-Injected: 1\x00\xe2\x80\xae "  # terminal escape, CRLF, NUL, U+202E


def nvml_stand_in(memory_dir: Path) -> Callable[[], list[GpuInfo]]:
    """The node agent's `memory_probe` (NVML's stand-in): one fake GPU whose processes hold
    what the fake engines wrote to `memory_dir`."""
    def gpus() -> list[GpuInfo]:
        procs: dict[int, int] = {}
        for f in memory_dir.glob("*.json"):
            try:
                d = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            procs[int(d["pid"])] = int(d["bytes"])
        return [GpuInfo("fake-0", 0, GPU_BYTES, GPU_BYTES - sum(procs.values()), procs)]
    return gpus


class FakeEngine:
    def __init__(self, engine: str, name: str, log: Path | None, memory_dir: Path | None, delay: float,
                 awake_bytes: int = AWAKE_BYTES) -> None:
        self.engine = engine
        self.awake_bytes = awake_bytes
        self.name = name
        self.log = log
        self.memory_dir = memory_dir
        self.delay = delay
        self.sleeping = False
        self.faults: dict[str, str] = {}
        self.faults_changed = asyncio.Condition()
        self.hits: list[str] = []
        self.body_sent = 0
        self.body_ended = False
        self._write_memory(self.awake_bytes)

    def _write_memory(self, n: int) -> None:
        if self.memory_dir is None:
            return
        path = self.memory_dir / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "bytes": n}))
        tmp.replace(path)

    def _record(self, line: str) -> None:
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{self.name} {line}\n".encode())
            finally:
                os.close(fd)

    def _failure(self, message: str) -> web.Response:
        if self.engine == "vllm":
            return web.Response(status=500, text="Internal Server Error")
        return web.json_response({"error": {"message": message}}, status=400)

    async def _huge_body(self, request: web.Request, status: int) -> web.StreamResponse:
        """`HUGE_BODY_BYTES` of body, written as fast as the client reads them; stops when
        it goes away (`body_sent`, `body_ended`)."""
        self.body_sent, self.body_ended = 0, False
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/plain"})
        resp.content_length = HUGE_BODY_BYTES
        await resp.prepare(request)
        chunk = 64 << 10
        try:
            while self.body_sent < HUGE_BODY_BYTES:
                head = HUGE_HEAD if self.body_sent == 0 else b""
                await resp.write(head + b"x" * (min(chunk, HUGE_BODY_BYTES - self.body_sent) - len(head)))
                self.body_sent += chunk
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client closed the connection
        finally:
            self.body_ended = True
        return resp

    async def sleep(self, request: web.Request) -> web.StreamResponse:
        if self.engine == "sglang":
            await request.json()  # FastAPI parses the body model
        if self.faults.get("sleep") == "huge-body":
            return await self._huge_body(request, 500)
        if self.faults.get("sleep") == "hang":
            self._record("sleep-hung")
            await asyncio.Event().wait()
        if self.engine == "sglang" and self.sleeping:
            return self._failure("memory is already released")
        await asyncio.sleep(self.delay)
        self.sleeping = True
        if self.faults.get("sleep") != "keep-memory":
            self._write_memory(min(ASLEEP_BYTES, self.awake_bytes))
        level = request.query.get("level", "")
        self._record("sleep" + (f" level={level}" if level else ""))
        return self._ok()

    async def wake(self, request: web.Request) -> web.Response:
        if self.engine == "sglang":
            await request.json()
        if self.faults.get("wake") == "hold":
            self._record("wake-held")
            async with self.faults_changed:
                await self.faults_changed.wait_for(lambda: self.faults.get("wake") != "hold")
        await asyncio.sleep(self.delay)
        if self.faults.get("wake") == "fail":
            self._record("wake-failed")
            return self._failure("injected wake failure")
        if self.engine == "sglang" and not self.sleeping:
            return self._failure("memory is not released")
        self.sleeping = False
        self._write_memory(self.awake_bytes)
        self._record("wake")
        return self._ok()

    async def generate(self, request: web.Request) -> web.Response:
        if self.sleeping:
            self._record("generate-asleep")
            return web.Response(status=503, text="the engine is sleeping")
        self._record("generate")
        return web.json_response({"choices": [{"text": "ok"}]})

    def _ok(self) -> web.Response:
        return web.Response(status=200) if self.engine == "vllm" else web.json_response(None)

    async def is_sleeping(self, request: web.Request) -> web.StreamResponse:
        if self.faults.get("is_sleeping") == "huge-body":
            return await self._huge_body(request, 200)
        return web.json_response({"is_sleeping": self.sleeping or self.faults.get("is_sleeping") == "lie"})

    @web.middleware
    async def api(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """Records each call of the engine's API; answers it with a redirect under that fault."""
        if request.path.startswith("/fake/"):
            return await handler(request)
        self.hits.append(f"{request.method} {request.path}")
        if "redirect" in self.faults:
            raise web.HTTPTemporaryRedirect(self.faults["redirect"] + request.path_qs)
        return await handler(request)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"hits": self.hits, "body_sent": self.body_sent, "body_ended": self.body_ended})

    async def fault(self, request: web.Request) -> web.Response:
        for k, v in (await request.json()).items():
            if v == "ok":
                self.faults.pop(k, None)
            else:
                self.faults[k] = v
        async with self.faults_changed:
            self.faults_changed.notify_all()
        return web.json_response(self.faults)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.api])
        if self.engine == "vllm":
            app.router.add_post("/sleep", self.sleep)
            app.router.add_post("/wake_up", self.wake)
            app.router.add_get("/is_sleeping", self.is_sleeping)
        else:
            app.router.add_post("/release_memory_occupation", self.sleep)
            app.router.add_post("/resume_memory_occupation", self.wake)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/fake/fault", self.fault)
        app.router.add_get("/fake/stats", self.stats)
        return app


async def serve(args: argparse.Namespace) -> None:
    engine = FakeEngine(args.engine, args.name, args.log, args.memory_dir, args.delay, args.awake_bytes)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"ready {port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    p.add_argument("--name", default="engine")
    p.add_argument("--log", type=Path)
    p.add_argument("--memory-dir", type=Path)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--awake-bytes", type=int, default=AWAKE_BYTES, help="the memory it holds awake")
    try:
        asyncio.run(serve(p.parse_args()))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
