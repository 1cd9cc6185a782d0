"""The `timeslice` command as a user runs it: demo, status, help."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.conftest import python_child


def timeslice(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "timeslice.cli.main", *args], capture_output=True, text=True,
                          timeout=120, **kw)  # type: ignore[call-overload]


def test_demo_json_runs_real_processes_and_keeps_data() -> None:
    r = timeslice("demo", "--jobs", "2", "--rounds", "3", "--backend", "freeze", "--gen-seconds", "0.1",
                  "--reward-seconds", "0.1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("jobs", "rounds", "switches", "duty_cycle_solo", "duty_cycle_shared", "handoff_ms_p50",
                "handoff_ms_p99", "data_ok"):
        assert key in out
    assert out["data_ok"] is True and out["backend"] == "freeze" and out["failed_switches"] == 0
    assert out["switches"] >= 2 and len(out["timeline"]) == 6
    assert r.stderr == ""  # no warnings


def test_demo_prints_a_timeline() -> None:
    r = timeslice("demo", "--jobs", "2", "--rounds", "2", "--backend", "none", "--gen-seconds", "0.05",
                  "--reward-seconds", "0.05")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("timeline (") and "shared-job-0 |" in lines[1] and "shared-job-1 |" in lines[2]
    assert lines[-1].startswith("summary: jobs=2, rounds=2, backend=none") and "data_ok=True" in lines[-1]


@pytest.mark.parametrize("args", [["demo", "--jobs", "0"], ["demo", "--backend", "nope"]])
def test_demo_rejects_bad_flags(args: list[str]) -> None:
    r = timeslice(*args)
    assert r.returncode == 2 and "error" in r.stderr


async def test_status_against_a_running_orchestrator(make_cluster, children) -> None:
    c = await make_cluster(groups=("g",))
    holder = c.client("trainer-a")
    await holder.acquire()
    waiter = python_child(f"""
        from timeslice import TimeSliceOrchestratorClient
        TimeSliceOrchestratorClient("{c.target}", "trainer-b", "g").acquire()
    """)
    children.append(waiter)
    for _ in range(200):
        if (await c.status()).waiters:
            break
        await asyncio.sleep(0.02)
    r = await asyncio.to_thread(timeslice, "status", "--target", c.target)
    assert r.returncode == 0, r.stderr
    assert "group g  backend=none  phase=held  holder=trainer-a (epoch 1" in r.stdout
    assert "waiting #0: trainer-b priority=0" in r.stdout
    r = await asyncio.to_thread(timeslice, "status", "--target", c.target, "--group", "g", "--json")
    assert json.loads(r.stdout)[0]["holder"]["job_id"] == "trainer-a"
    r = await asyncio.to_thread(timeslice, "status", "--target", c.target, "--group", "missing")
    assert r.returncode == 1 and "NOT_FOUND: unknown group 'missing'" in r.stderr
    await holder.close()


def test_help_lists_the_subcommands() -> None:
    r = timeslice("--help")
    assert r.returncode == 0 and all(cmd in r.stdout for cmd in ("demo", "orchestrator", "status"))


def test_kubelet_plugin_agent_auth_flags(monkeypatch) -> None:
    from timeslice.cli.main import main
    from timeslice.driver import logs
    from timeslice.kubelet_plugin import app

    seen = []

    async def run(cfg: app.KubeletPluginConfig) -> None:
        seen.append(cfg)

    monkeypatch.setattr(app, "run", run)
    monkeypatch.setattr(logs, "setup", lambda level: None)  # keep pytest's log handlers
    main(["kubelet-plugin", "--node-name", "n"])
    main(["kubelet-plugin", "--node-name", "n", "--agent-auth", "tokenreview", "--agent-allowed-users",
          "system:serviceaccount:a:b, system:serviceaccount:c:d,"])
    assert (seen[0].agent_auth, seen[0].agent_allowed_users) == (
        "none", ("system:serviceaccount:timeslice-system:timeslice-controller",))
    assert (seen[1].agent_auth, seen[1].agent_allowed_users) == (
        "tokenreview", ("system:serviceaccount:a:b", "system:serviceaccount:c:d"))
    with pytest.raises(ValueError, match="at least 1 item"):
        main(["kubelet-plugin", "--node-name", "n", "--agent-auth", "tokenreview", "--agent-allowed-users", " ,"])
    monkeypatch.setenv("POD_NAME", "plugin-x")
    monkeypatch.setenv("POD_NAMESPACE", "timeslice-system")
    main(["kubelet-plugin", "--node-name", "n", "--agent-tls"])
    assert not seen[0].agent_tls
    assert (seen[-1].agent_tls, seen[-1].pod_name, seen[-1].pod_namespace) == (True, "plugin-x", "timeslice-system")


def test_controller_agent_token_file_flag(monkeypatch) -> None:
    from pathlib import Path

    from timeslice.cli.main import main
    from timeslice.controller import app
    from timeslice.driver import logs

    seen = []

    async def run(cfg: app.ControllerConfig) -> None:
        seen.append(cfg)

    monkeypatch.setattr(app, "run", run)
    monkeypatch.setattr(logs, "setup", lambda level: None)
    main(["controller"])
    main(["controller", "--agent-token-file", "/var/run/secrets/timeslice.dev/node-agent/token"])
    assert seen[0].agent_token_file is None
    assert seen[1].agent_token_file == Path("/var/run/secrets/timeslice.dev/node-agent/token")
    main(["controller", "--require-agent-tls"])
    assert not seen[0].require_agent_tls and seen[2].require_agent_tls
    with pytest.raises(ValueError, match="cannot be combined with agent_template"):
        main(["controller", "--require-agent-tls", "--agent-template", "{node}:50052"])
