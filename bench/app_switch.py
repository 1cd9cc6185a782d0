#!/usr/bin/env python3
"""Overhead of backend `app` per switch, over the engines' own sleep and wake.

Two fake engines (`tests/fake_engine.py`, one vLLM-like and one SGLang-like, real
processes on loopback, each sleep and wake taking `--delay` seconds of "engine work"), one
process serving the orchestrator and a node agent with backend `app` (the agent verifies
each sleep against its NVML stand-in, the engines' memory files), and this process
running the two jobs as real clients. Every round the holder releases and the other job's
acquire returns after a switch: the holder's engine sleeps, the other's wakes.

- `switch_ms`: from the holder's `release()` call to the other job's `acquire()` return
  (CLOCK_MONOTONIC), a switch out and in;
- `engine_ms`: the same sleep + wake sent straight to the engines (aiohttp, one session:
  the cheapest client), the engines' own cost;
- `overhead_ms` = median(switch_ms) - median(engine_ms): what the product adds (target
  <= 50 ms).

    python bench/app_switch.py --rounds 200 --out bench/results/app-switch-2core.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import emit  # noqa: E402

GROUP = "g"


async def serve(c: dict[str, Any]) -> None:
    """The orchestrator and one node agent (backend app), as the bench's server process;
    `c`: the JSON config `main` wrote."""
    from timeslice.controller.orchestrator.config import GroupSpec
    from timeslice.controller.orchestrator.orchestrator import Orchestrator
    from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server
    from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
    from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
    from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server

    from tests.fake_engine import nvml_stand_in

    agent = NodeAgent(StaticProcessResolver(c["pids"]), backends=["app"],
                      memory_probe=nvml_stand_in(Path(c["memory_dir"])))
    agent_server, _ = await create_agent_server(agent, c["agent"])
    orch = Orchestrator([GroupSpec(id=GROUP, backend="app", agents=(c["agent"],), apps=c["apps"],
                                   residency="exclusive")])
    server, port = await create_orchestrator_server(orch, "127.0.0.1:0")
    print(f"ready {port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop(0)
        await agent_server.stop(0)


def start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("ready "):
        raise SystemExit(f"{args[:3]} did not start: {line!r}")
    return p, line.split()[1]


async def engine_only(urls: dict[str, str], rounds: int) -> list[float]:
    """Sleep of one engine + wake of the other, sent straight to them; ms per pair."""
    import aiohttp

    calls = {"a": ("/sleep?level=1", "/wake_up", None), "b": ("/release_memory_occupation",
                                                                "/resume_memory_occupation", {})}
    out = []
    async with aiohttp.ClientSession() as s:
        async with s.post(urls["b"] + calls["b"][0], json={}) as r:  # b starts asleep
            assert r.status == 200
        holder, other = "a", "b"
        for _ in range(rounds):
            t0 = time.monotonic()
            async with s.post(urls[holder] + calls[holder][0], json=calls[holder][2]) as r:
                assert r.status == 200, await r.text()
            async with s.post(urls[other] + calls[other][1], json=calls[other][2]) as r:
                assert r.status == 200, await r.text()
            out.append((time.monotonic() - t0) * 1000)
            holder, other = other, holder
        async with s.post(urls[holder] + calls[holder][0], json=calls[holder][2]) as r:  # both asleep
            assert r.status == 200
        for job in ("a", "b"):  # both awake again, as the product run starts
            async with s.post(urls[job] + calls[job][1], json=calls[job][2]) as r:
                assert r.status == 200
    return out


async def through_product(target: str, rounds: int) -> list[float]:
    """Hand-offs between the two jobs through the orchestrator; ms from release to the next grant."""
    from timeslice import AsyncTimeSliceOrchestratorClient

    clients = {j: AsyncTimeSliceOrchestratorClient(target, j, GROUP) for j in ("a", "b")}
    out = []
    try:
        await clients["a"].acquire(timeout=30)
        await clients["a"].release()
        await clients["b"].acquire(timeout=30)  # a sleeps; from here every hand-off sleeps one and wakes one
        holder, other = "b", "a"
        for _ in range(rounds):
            waiting = asyncio.ensure_future(clients[other].acquire(timeout=60))
            await asyncio.sleep(0.005)  # the other job waits before the release (no timing: not measured)
            t0 = time.monotonic()
            await clients[holder].release()
            await waiting
            out.append((time.monotonic() - t0) * 1000)
            holder, other = other, holder
        await clients[holder].release()
    finally:
        for c in clients.values():
            await c.close()
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--delay", type=float, default=0.0, help="seconds each fake sleep and wake takes")
    p.add_argument("--out")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        asyncio.run(serve(json.loads(a.serve.read_text())))
        return
    procs = []
    with tempfile.TemporaryDirectory(prefix="ts-app-") as tmp:
        d = Path(tmp)
        (d / "memory").mkdir()
        try:
            urls, pids = {}, {}
            for job, kind in (("a", "vllm"), ("b", "sglang")):
                proc, port = start(["-m", "tests.fake_engine", "--engine", kind, "--name", job, "--memory-dir",
                                    str(d / "memory"), "--delay", str(a.delay)])
                procs.append(proc)
                urls[job], pids[job] = f"http://127.0.0.1:{port}", [proc.pid]
            engine_ms = asyncio.run(engine_only(urls, a.rounds))
            config = d / "serve.json"
            config.write_text(json.dumps({"pids": pids, "memory_dir": str(d / "memory"),
                                          "agent": f"unix://{d / 'agent.sock'}",
                                          "apps": {"a": {"engine": "vllm", "url": urls["a"]},
                                                   "b": {"engine": "sglang", "url": urls["b"]}}}))
            server, port = start([str(Path(__file__).resolve()), "--serve", str(config)])
            procs.append(server)
            switch_ms = asyncio.run(through_product(f"127.0.0.1:{port}", a.rounds))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    med_switch, med_engine = statistics.median(switch_ms), statistics.median(engine_ms)
    emit({"bench": "app_switch", "rounds": a.rounds, "engine_delay_seconds": a.delay,
          "engines": {"a": "vllm-like", "b": "sglang-like"},
          "switch_ms": {"median": round(med_switch, 3), "p90": round(pct(switch_ms, 0.9), 3),
                        "max": round(max(switch_ms), 3)},
          "engine_ms": {"median": round(med_engine, 3), "p90": round(pct(engine_ms, 0.9), 3)},
          "overhead_ms": round(med_switch - med_engine, 3), "target_overhead_ms": 50,
          "note": "one switch = the holder's engine sleeps, the waiter's wakes; the agent's NVML check reads the "
                  "fake engines' memory files (tests/fake_engine.py nvml_stand_in)"}, a.out)


if __name__ == "__main__":
    main()
