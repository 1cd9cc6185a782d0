"""The Grafana dashboard against a real Prometheus scrape (issue 24, item 3).

`timeslice node-agent` (model GPU of 100 MB, `cuda` backend over the fake driver) and
`timeslice orchestrator --config` with `metrics_listen`, as a user runs them; jobs a and b
(real processes, named by TIMESLICE_JOB) need 60 MB each, so every hand-off switches. A real
Prometheus (Debian's `prometheus`, `make unit-all` installs it) scrapes the orchestrator
every second under the scrape job `timeslice`; every panel's expression then runs through its
HTTP API: each one must parse and evaluate, the per-job panels must show one series per job
under `timeslice_job` (Prometheus sets `job` to the scrape job's name and would rename a
target's own `job` label to `exported_job`), and the per-group panels one series per group."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from timeslice import AsyncTimeSliceOrchestratorClient
from timeslice.kubelet_plugin.agent.model_gpu import ModelGpu

from tests import prometheus_server
from tests.prometheus_server import PROMETHEUS, RANGE, check_dashboard
from tests.test_node_agent_cli import start, stop
from tests.test_schedules import MB, fake_driver_agent, job_process

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None and os.environ.get("TIMESLICE_TEST_INTEGRATIONS") != "required",
    reason="no prometheus binary (make unit-all installs Debian's)")


async def query(base: str, expr: str) -> list[dict[str, Any]]:
    return await asyncio.to_thread(prometheus_server.query, base, expr)


async def _drain(stream: asyncio.StreamReader | None) -> None:
    while stream is not None and await stream.readline():
        pass


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(Prometheus' base URL, the file its scrape config reads targets from)."""
    with prometheus_server.prometheus_server(tmp_path) as running:
        yield running


async def _hand_offs(target: str, gpu: ModelGpu, pids: dict[str, int], done: asyncio.Event) -> None:
    """a and b take turns (each takes its 60 MB in its first hold) until `done`."""
    clients = {job: AsyncTimeSliceOrchestratorClient(target, job, "g") for job in pids}
    loaded: set[str] = set()
    try:
        while not done.is_set():
            for job, client in clients.items():
                await client.acquire(timeout=60, memory=60 * MB)
                if job not in loaded:
                    gpu.alloc(pids[job], 60 * MB, "model")
                    loaded.add(job)
                await asyncio.sleep(0.05)  # workload: its GPU phase
                await client.release()
    finally:
        for client in clients.values():
            await client.close()


async def test_every_dashboard_panel_shows_one_series_per_job_from_a_real_scrape(
        short_tmp: Path, monkeypatch, prometheus) -> None:
    base, targets = prometheus
    gpu = ModelGpu.create(short_tmp / "gpu.json", 100 * MB)
    jobs = {job: job_process(job) for job in ("a", "b")}
    agent, agent_target = await fake_driver_agent(short_tmp, monkeypatch, gpu)
    cfg = short_tmp / "orch.json"
    cfg.write_text(json.dumps({"listen": f"unix://{short_tmp / 'orch.sock'}", "metrics_listen": "127.0.0.1:0",
                               "state_file": str(short_tmp / "state.json"),
                               "groups": [{"id": "g", "backend": "cuda", "agents": [agent_target]}]}))
    orch, m = await start("orchestrator", "--config", str(cfg), ready=re.compile(rb"metrics serving .* port=(\d+)"),
                          stream="stderr")
    drains = [asyncio.create_task(_drain(s)) for s in (orch.stderr, orch.stdout, agent.stderr, agent.stdout)]
    done = asyncio.Event()
    work = asyncio.create_task(_hand_offs(f"unix://{short_tmp / 'orch.sock'}", gpu,
                                          {j: p.pid for j, p in jobs.items()}, done))
    try:
        targets.write_text(json.dumps([{"targets": [f"127.0.0.1:{m.group(1).decode()}"]}]))
        for _ in range(600):  # three scrapes with switches done: every rate has two samples or more
            got = await query(base, f"count_over_time(timeslice_group_switches_total[{RANGE}]) >= 3 "
                                    "and timeslice_group_switches_total >= 2")
            if got:
                break
            assert not work.done(), work
            await asyncio.sleep(0.1)
        else:
            pytest.fail("no three scrapes of two switches within 60 s")
        await asyncio.to_thread(check_dashboard, base, {"a", "b"}, {"g"})
    finally:
        done.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(work, 30)
        await stop(orch)
        await stop(agent)
        await asyncio.gather(*drains)
        for p in jobs.values():
            p.kill()
            p.wait()
