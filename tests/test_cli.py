"""The `timeslice` command as a user runs it: demo, status, help."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from timeslice.driver.names import install_hint

from tests.conftest import eventually, python_child


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


@pytest.mark.slow  # > 5 s: left out of `make unit`, run by `make test`
def test_demo_with_max_hold_preempts_mid_phase_and_keeps_data() -> None:
    """Phases of 1.2 s, maxHoldSeconds 0.3: each holder is frozen mid-phase while the
    other computes, and every worker's state survives."""
    r = timeslice("demo", "--jobs", "2", "--rounds", "2", "--backend", "freeze", "--gen-seconds", "1.2",
                  "--reward-seconds", "0.1", "--max-hold-seconds", "0.3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["preemptions"] >= 2 and out["max_hold_seconds"] == 0.3 and out["data_ok"] is True
    assert out["failed_switches"] == 0 and all(h >= 0 for h in (out["handoff_ms_p50"], out["handoff_ms_p99"]))


def test_demo_prints_a_timeline() -> None:
    r = timeslice("demo", "--jobs", "2", "--rounds", "2", "--backend", "none", "--gen-seconds", "0.05",
                  "--reward-seconds", "0.05")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("timeline (") and "shared-job-0 |" in lines[1] and "shared-job-1 |" in lines[2]
    assert lines[-1].startswith("summary: jobs=2, rounds=2, backend=none") and "data_ok=True" in lines[-1]


@pytest.mark.parametrize("args", [["demo", "--jobs", "0"], ["demo", "--backend", "nope"],
                                  ["serve", "--socket-mode", "999"], ["serve", "--socket-mode", "1777"]])
def test_demo_rejects_bad_flags(args: list[str]) -> None:
    r = timeslice(*args)
    assert r.returncode == 2 and "error" in r.stderr


async def test_status_against_a_running_orchestrator(make_cluster, children) -> None:
    c = await make_cluster(groups=("g",))
    holder = c.client("trainer-a", memory="20Gi")
    await holder.acquire()
    waiter = python_child(f"""
        from timeslice import TimeSliceOrchestratorClient
        TimeSliceOrchestratorClient("{c.target}", "trainer-b", "g").acquire()
    """)
    children.append(waiter)
    await eventually(lambda: _waiting(c), timeout=60, what="trainer-b waiting")  # a child process starts first
    r = await asyncio.to_thread(timeslice, "status", "--target", c.target)
    assert r.returncode == 0, r.stderr
    assert "group g  backend=none  residency=exclusive  phase=held  holder=trainer-a (epoch 1" in r.stdout
    assert "waiting #0: trainer-b priority=0" in r.stdout
    # no GPU memory report here (backend none): the declared memory shows all the same
    assert "job trainer-a: resident  declared 21.47 GB  (no GPU memory report" in r.stdout
    r = await asyncio.to_thread(timeslice, "status", "--target", c.target, "--group", "g", "--json")
    (status,) = json.loads(r.stdout)
    assert status["holder"]["job_id"] == "trainer-a"
    # numbers as numbers and zero fields present (protobuf's JSON mapping gave "21474836480" and no zeros)
    (job,) = [j for j in status["jobs"] if j["job_id"] == "trainer-a"]
    assert job["declared_bytes"] == 20 * 2**30 and status["failed_switches"] == 0 and status["lease_expiries"] == 0
    assert isinstance(status["holder"]["epoch"], int) and status["waiters"][0]["priority"] == 0
    r = await asyncio.to_thread(timeslice, "status", "--target", c.target, "--group", "missing")
    assert r.returncode == 1 and "NOT_FOUND: unknown group 'missing'" in r.stderr
    await holder.close()


async def _waiting(c) -> bool:
    return bool((await c.status()).waiters)


def test_help_lists_the_subcommands() -> None:
    r = timeslice("--help")
    assert r.returncode == 0 and all(cmd in r.stdout for cmd in ("demo", "orchestrator", "status"))


def test_the_version_is_the_installed_distributions_and_the_client_is_typed() -> None:
    """Nobody could tell what version they ran (issue 25): `timeslice --version` and
    `timeslice.__version__` report the distribution's; `py.typed` marks the client typed
    (mypy said `import-untyped` for its users)."""
    from importlib.metadata import version
    from importlib.resources import files

    import timeslice as client

    r = timeslice("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"timeslice-dra {version('timeslice-dra')}"
    assert client.__version__ == version("timeslice-dra")
    assert files("timeslice").joinpath("py.typed").is_file()


def test_kubelet_plugin_agent_auth_flags(monkeypatch, capsys) -> None:
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
    assert main(["kubelet-plugin", "--node-name", "n", "--agent-auth", "tokenreview", "--agent-allowed-users",
                 " ,"]) == 2  # one error line, no traceback
    assert "agent_allowed_users" in capsys.readouterr().err
    monkeypatch.setenv("POD_NAME", "plugin-x")
    monkeypatch.setenv("POD_NAMESPACE", "timeslice-system")
    main(["kubelet-plugin", "--node-name", "n", "--agent-tls"])
    assert not seen[0].agent_tls
    assert (seen[-1].agent_tls, seen[-1].pod_name, seen[-1].pod_namespace) == (True, "plugin-x", "timeslice-system")
    # Issue 10, item 12: the default agent is unauthenticated on a unix socket; a port needs tokenreview
    assert seen[0].agent_listen == "unix:///var/lib/kubelet/plugins/gpu.timeslice.dev/agent.sock"
    capsys.readouterr()
    for listen in ("127.0.0.1:50052", "0.0.0.0:50052"):
        assert main(["kubelet-plugin", "--node-name", "n", "--agent-listen", listen]) == 2
        assert "an unauthenticated node agent serves only a unix socket" in capsys.readouterr().err
    n = len(seen)
    main(["kubelet-plugin", "--node-name", "n", "--agent-listen", "0.0.0.0:50052", "--agent-auth", "tokenreview"])
    assert len(seen) == n + 1


def test_controller_agent_token_file_flag(monkeypatch, capsys) -> None:
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
    assert main(["controller", "--require-agent-tls", "--agent-template", "{node}:50052"]) == 2
    assert "cannot be combined with agent_template" in capsys.readouterr().err
    main(["controller", "--resync-seconds", "30"])  # issue 12, item 9: it was fixed at 300 s
    assert seen[0].resync_seconds == 300.0 and seen[-1].resync_seconds == 30.0
    assert main(["controller", "--resync-seconds", "0"]) == 2
    assert "resync_seconds" in capsys.readouterr().err


def test_bad_input_is_one_error_line(tmp_path, capsys, monkeypatch) -> None:
    from timeslice.cli.main import main
    from timeslice.driver import logs

    monkeypatch.setattr(logs, "setup", lambda level: None)  # keep pytest's log handlers and levels

    bad = tmp_path / "groups.yaml"
    for text, expected in (("groups: [", "not valid YAML"),
                           ("groups: [{id: g, backend: freeze}]", "needs at least one agent"),
                           ("groups: [{id: g, backend: freeze, agents: [/run/a.sock]}]",
                            "write a unix socket as unix:///run/a.sock"),
                           ("listen: 127.0.0.1:99999", "port must be a number in 0..65535")):
        bad.write_text(text)
        assert main(["orchestrator", "--config", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("timeslice orchestrator: error:") and expected in err and "Traceback" not in err
    assert main(["orchestrator", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "No such file" in capsys.readouterr().err


@pytest.mark.parametrize("missing, command, extra", [
    ("yaml", ["orchestrator", "--listen", "127.0.0.1:0"], "server"),
    ("kubernetes", ["controller", "--listen", "127.0.0.1:0"], "kubernetes"),
])
def test_a_missing_extra_is_named_in_one_line(missing: str, command: list[str], extra: str) -> None:
    """Issue 12, item 11: a client-only install (`pip install timeslice-dra`) running a server
    command ended in `ModuleNotFoundError` and a traceback. The module is hidden from a fresh
    interpreter here."""
    code = (f"import sys; sys.modules[{missing!r}] = None; from timeslice.cli.main import main; "
            f"sys.exit(main({command!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"timeslice {command[0]}: error: it needs the Python package {missing!r}, which is "
                                f"not installed: {install_hint(extra)}")


def test_a_command_without_a_cluster_says_so_in_one_line(tmp_path) -> None:
    """Issue 12, item 11: `timeslice controller` with no cluster ended in a traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    r = timeslice("controller", "--listen", "127.0.0.1:0", env={**env, "KUBECONFIG": str(tmp_path / "none"),
                                                               "HOME": str(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith("timeslice controller: error: no Kubernetes cluster:"), r.stderr


@pytest.mark.slow  # > 5 s: left out of `make unit`, run by `make test`
def test_demo_stopped_by_sigterm_leaves_no_process(tmp_path) -> None:
    """SIGTERM (or Ctrl-C) stops the demo: its jobs and workers (frozen ones too) are
    stopped, it says so in one line and exits 130."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    demo = subprocess.Popen([sys.executable, "-m", "timeslice.cli.main", "demo", "--rounds", "100", "--gen-seconds",
                             "0.02", "--reward-seconds", "0.02", "--verbose"],  # solo ~4 s, then shared
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    frozen = threading.Event()

    def read_stderr() -> None:
        assert demo.stderr is not None
        for line in demo.stderr:
            lines.append(line)
            if "checkpointed job=shared-job-" in line:  # the shared phase: a worker is frozen
                frozen.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert frozen.wait(120), "".join(lines[-20:])
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=30)
        reader.join(10)
        err = "".join(lines)
        assert demo.returncode == 130 and err.strip().endswith("timeslice demo: interrupted"), err[-3000:]
        deadline = time.monotonic() + 10
        while True:  # the group empties as the last processes exit
            try:
                os.killpg(demo.pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                leftovers = subprocess.run(["pgrep", "-g", str(demo.pid), "-a"], capture_output=True,
                                           text=True).stdout
                raise AssertionError(f"processes left in the demo's group: {leftovers}")
            time.sleep(0.05)
    finally:  # whatever is left (a failed run): thaw, then kill the whole group
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(demo.pid, sig)
        demo.wait()
        reader.join(10)
        if demo.stderr is not None:
            demo.stderr.close()
