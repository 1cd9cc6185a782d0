"""bench/rl_grpo.py end to end on the CPU: the product's own `timeslice serve` as a subprocess, two tiny
GRPO-shaped jobs (bench/rl_job.py --device cpu) of two steps each, solo then shared on a `freeze` group
(the transparent backend without a GPU): no job lost, parameters bitwise equal to the solo runs, the
servers stopped, the commands and logs recorded. A job killed by the bench's --job-timeout is reported
lost (exit code, the tail of its stderr) and makes the bench exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TINY = ["--size", "tiny", "--device", "cpu", "--jobs", "2", "--steps", "2", "--batch", "8", "--new-tokens", "8",
        "--reward-seconds", "0.2", "--modes", "serve", "--backends", "freeze"]


def bench(*args: str, timeout: float = 1100) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "rl_grpo.py"), *TINY, *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    out = [a for a in args if a.startswith("--out=")]
    return r, json.loads(Path(out[0].removeprefix("--out=")).read_text()) if out else []


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], dict[str, Any]]:
    """Solo runs measured and saved, then one shared run through `timeslice serve`."""
    d = tmp_path_factory.mktemp("rl-grpo")
    r, results = bench(f"--save-solo={d / 'solo.json'}", f"--logs={d / 'logs'}", f"--out={d / 'out.json'}")
    assert len(results) == 1, r.stderr[-3000:]
    return d, r, results[0]


def test_shared_run_through_serve_loses_no_job_and_matches_solo_bitwise(first: Any) -> None:
    d, r, result = first
    assert r.returncode == 0, r.stderr[-3000:]
    assert result["mode"] == "serve" and result["backend"] == "freeze"
    assert result["jobs_lost"] == [] and result["jobs_finished"] == 2
    assert result["bitwise_equal"] and result["extra_ok"]
    solo = json.loads((d / "solo.json").read_text())
    assert result["param_hash_shared"] == {str(s["seed"]): s["param_hash"] for s in solo}  # JSON keys are strings
    assert len(set(result["param_hash_shared"].values())) == 2  # two seeds, two models
    # every hold went through the served group: init, 2 x (generate, train), hash per job
    [group] = result["status"]
    assert group["group_id"] == "gpu" and group["backend"] == "freeze" and int(group["grants"]) == 12
    assert result["switches"] == len(result["switch_records"]) and result["switch_records_complete"]
    assert result["group_config"] == {"groups": [{"id": "gpu", "backend": "freeze"}]}  # product defaults
    names = [c["name"] for c in result["commands"]]
    assert names == ["serve", "job-0", "job-1", "status"]
    serve_argv = result["commands"][0]["argv"]
    assert " serve --config " in serve_argv and "lease" not in serve_argv
    for job in result["commands"][1:3]:
        assert job["env"]["TIMESLICE_ORCHESTRATOR"].startswith("unix://") and job["env"]["TIMESLICE_GROUP"] == "gpu"
        assert "TIMESLICE_JOB" not in job["env"] and "TIMESLICE_MEMORY" not in job["env"]
        assert result["job_ids"][f"pgid-{job['pid']}"] == job["name"]  # each job its own process group
    [server] = result["servers"]
    assert server["exit_code"] == 0 and not server["killed"]  # stopped by SIGTERM
    assert "ready TIMESLICE_ORCHESTRATOR=unix://" in Path(server["log"]).read_text()
    assert all(Path(p).is_file() for p in result["logs"].values())
    assert result["machine"]["cpus"] >= 1


def test_a_job_killed_by_the_timeout_is_lost_and_the_bench_exits_1(first: Any, tmp_path: Path) -> None:
    d, _, _ = first
    r, [result] = bench(f"--solo-json={d / 'solo.json'}", "--job-timeout=0.5", f"--logs={tmp_path / 'logs'}",
                        f"--out={tmp_path / 'out.json'}", "--declare-memory-gb=2")
    assert r.returncode == 1, r.stderr[-3000:]
    assert [j["job"] for j in result["jobs_lost"]] == ["job-0", "job-1"]
    assert all(j["exit_code"] == -9 and j["why"].startswith("killed after") for j in result["jobs_lost"])
    assert not result["bitwise_equal"] and result["jobs_finished"] == 0
    assert [c["env"]["TIMESLICE_MEMORY"] for c in result["commands"][1:3]] == ["2000000000B"] * 2
    [server] = result["servers"]
    assert server["exit_code"] == 0  # the servers still stopped cleanly
