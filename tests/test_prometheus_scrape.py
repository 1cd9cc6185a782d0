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
import shutil
import socket
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from timeslice import AsyncTimeSliceOrchestratorClient
from timeslice.kubelet_plugin.agent.model_gpu import ModelGpu

from tests.test_grafana import dashboard, panels
from tests.test_node_agent_cli import start, stop
from tests.test_schedules import MB, fake_driver_agent, job_process

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None and os.environ.get("TIMESLICE_TEST_INTEGRATIONS") != "required",
    reason="no prometheus binary (make unit-all installs Debian's)")
SCRAPE_JOB = "timeslice"
RANGE = "1m"  # $__rate_interval and $__range: Prometheus scrapes every 1 s here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


async def query(base: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector; fails on a Prometheus error (bad PromQL)."""
    answer = await asyncio.to_thread(_get, f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


def as_promql(expr: str) -> str:
    """Grafana's variables as Prometheus takes them: every group and backend, ranges of `RANGE`."""
    expr = re.sub(r"\$__(rate_interval|range|interval)", RANGE, expr)
    return re.sub(r"\$\{?(group|backend)\}?", ".*", expr)


async def _drain(stream: asyncio.StreamReader | None) -> None:
    while stream is not None and await stream.readline():
        pass


@pytest.fixture
async def prometheus(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """(Prometheus' base URL, the file its scrape config reads targets from)."""
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                               "scrape_configs": [{"job_name": SCRAPE_JOB, "file_sd_configs": [
                                   {"files": [str(targets)], "refresh_interval": "1s"}]}]}))
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        PROMETHEUS or "prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    drain = asyncio.create_task(_drain(proc.stderr))
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # its readiness, 60 s at most
            with contextlib.suppress(OSError):
                await asyncio.to_thread(urllib.request.urlopen, f"{base}/-/ready", None, 2)
                break
            assert proc.returncode is None, "prometheus exited"
            await asyncio.sleep(0.1)
        else:
            pytest.fail("prometheus not ready within 60 s")
        yield base, targets
    finally:
        await stop(proc)  # type: ignore[arg-type]
        await drain


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
        assert [r["metric"]["job"] for r in await query(base, "up == 1")] == [SCRAPE_JOB]
        assert await query(base, '{exported_job!=""}') == []  # no label of ours was renamed
        seen: dict[str, list[dict[str, Any]]] = {}
        for panel in panels(dashboard()["panels"]):
            for t in panel.get("targets", []):
                seen[t["expr"]] = result = await query(base, as_promql(t["expr"]))
                legend = t.get("legendFormat", "")
                if "{{timeslice_job}}" in legend:
                    per_job = sorted(r["metric"].get("timeslice_job", "") for r in result)
                    ways = len(result) // 2 if "{{direction}}" in legend else len(result)
                    assert sorted(set(per_job)) == ["a", "b"] and ways == 2, (panel["title"], result)
                elif legend.startswith("{{group}}"):
                    assert {r["metric"].get("group") for r in result} == {"g"}, (panel["title"], result)
        # Only what never happened here has no series: failed switches (none failed)
        empty = sorted(e for e, r in seen.items() if not r)
        assert all('result="failed"' in e for e in empty), empty
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
