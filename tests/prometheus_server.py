"""A real Prometheus for tests: Debian's `prometheus` binary (`make unit-all` installs it),
scraping every second under the scrape job `timeslice` the targets a test writes to a file.
Used by `tests/test_prometheus_scrape.py` (an orchestrator as a user runs it) and
`e2e/test_timeslicing.py` (the controllers in the local cluster)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.machine import free_port

PROMETHEUS = shutil.which("prometheus")
SCRAPE_JOB = "timeslice"
RANGE = "1m"  # $__rate_interval and $__range: Prometheus scrapes every 1 s here


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def query(base: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector; fails on a Prometheus error (bad PromQL)."""
    answer = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


@contextlib.contextmanager
def prometheus_server(work: Path) -> Iterator[tuple[str, Path]]:
    """(Prometheus' base URL, the file its scrape config reads targets from: write
    `[{"targets": ["127.0.0.1:PORT"]}]` to it); stopped at the end. Raises AssertionError
    when it is not ready within 60 s."""
    targets = work / "targets.json"
    targets.write_text("[]")
    cfg = work / "prometheus.yml"
    cfg.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                               "scrape_configs": [{"job_name": SCRAPE_JOB, "file_sd_configs": [
                                   {"files": [str(targets)], "refresh_interval": "1s"}]}]}))
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen([PROMETHEUS or "prometheus", f"--config.file={cfg}",
                             f"--storage.tsdb.path={work / 'prometheus-data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{base}/-/ready", None, 2).close()
                break
            assert proc.poll() is None, f"prometheus exited: {(work / 'prometheus.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, "prometheus not ready within 60 s"
            time.sleep(0.1)
        yield base, targets
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def as_promql(expr: str) -> str:
    """Grafana's variables as Prometheus takes them: every group and backend, ranges of `RANGE`."""
    expr = re.sub(r"\$__(rate_interval|range|interval)", RANGE, expr)
    return re.sub(r"\$\{?(group|backend)\}?", ".*", expr)


def check_dashboard(base: str, jobs: set[str], groups: set[str], unmeasured: tuple[str, ...] = ()) -> None:
    """Every panel of the Grafana dashboard evaluates on what Prometheus scraped: the
    per-job panels show one series per job of `jobs` under `timeslice_job` (Prometheus sets
    `job` to the scrape job's name and would rename a target's own `job` label to
    `exported_job`), the per-group panels one per group of `groups`; only failed switches
    (none here) and expressions naming a metric in `unmeasured` (memory readings where no
    GPU is read) may have no series."""
    from tests.test_grafana import dashboard, panels

    up = query(base, "up == 1")
    assert up and {r["metric"]["job"] for r in up} == {SCRAPE_JOB}, up
    assert query(base, '{exported_job!=""}') == []  # no label of ours was renamed
    seen: dict[str, list[dict[str, Any]]] = {}
    for panel in panels(dashboard()["panels"]):
        for t in panel.get("targets", []):
            seen[t["expr"]] = result = query(base, as_promql(t["expr"]))
            if not result and any(m in t["expr"] for m in unmeasured):
                continue
            legend = t.get("legendFormat", "")
            if "{{timeslice_job}}" in legend:
                per_job = sorted(r["metric"].get("timeslice_job", "") for r in result)
                ways = len(result) // 2 if "{{direction}}" in legend else len(result)
                assert set(per_job) == jobs and ways == len(jobs), (panel["title"], result)
            elif legend.startswith("{{group}}"):
                assert {r["metric"].get("group") for r in result} == groups, (panel["title"], result)
    empty = sorted(e for e, r in seen.items() if not r and not any(m in e for m in unmeasured))
    assert all('result="failed"' in e for e in empty), empty
