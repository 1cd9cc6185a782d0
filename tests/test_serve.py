"""One-box mode (issue 13, item 1): `timeslice serve` as a real process, jobs as real process
groups that name neither a job nor a PID. The job of a call is the caller's process group,
read from the unix socket's peer credentials; the node agent moves that group's marked
processes (the `freeze` backend on the CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from timeslice.cli.serve import ServeConfig, gpu_count, orchestrator_config
from timeslice.controller.peer_auth import PeerAuthenticator, PeerCaller
from timeslice.driver.errors import PermissionDenied
from timeslice.driver.peercred import PeerCredentials, PeerJobs, Scope, UnixFront, stat_fields
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

# A job: a worker (marked, so the agent moves it) that appends a timestamp to a file every
# 5 ms, and the job's client that holds the group `rounds` times around a short phase,
# recording each hold's span: the one-box CPU example. Neither names a job nor a PID.
JOB = (Path(__file__).resolve().parent.parent / "examples" / "cpu_job.py").read_text()


def check_hand_offs(out: Path, jobs: str) -> None:
    """The JOB scripts' records in `out`: never two holders at once, and at every hand-off
    the job that held was frozen (its worker wrote no tick) while the other held."""
    spans = sorted((s for name in jobs for s in json.loads((out / f"{name}.spans").read_text())), key=lambda s: s[1])
    assert len(spans) == 3 * len(jobs)
    ticks = {name: [float(t) for t in (out / f"{name}.ticks").read_text().split()] for name in jobs}
    switches = 0
    for prev, cur in itertools.pairwise(spans):
        assert cur[1] >= prev[2], spans  # never two holders at once
        if prev[0] != cur[0]:  # a hand-off: the job that held is frozen while the other holds
            switches += 1
            ran = [t for t in ticks[prev[0]] if cur[1] <= t <= cur[2]]
            assert not ran, f"{prev[0]}'s worker ran while {cur[0]} held: {ran[:3]}"
    assert switches >= 1


@contextlib.asynccontextmanager
async def serve_process(tmp_path: Path, lease_seconds: float = 10, name: str = "serve",
                        sock: Path | None = None, backend: str = "freeze", more: str = ""
                        ) -> AsyncIterator[tuple[str, int, asyncio.subprocess.Process]]:
    """A `timeslice serve` process with one group `g` on `backend` (`more`: more of its fields,
    YAML flow style, e.g. "max_hold_seconds: 2"), logging to tmp_path/<name>.log: (socket path,
    loopback port, process); stopped with SIGTERM at the end unless the test ended it."""
    (tmp_path / "groups.yaml").write_text(
        f"groups:\n  - {{id: g, backend: {backend}, lease_seconds: {lease_seconds}{', ' + more if more else ''}}}\n")
    sock = sock or tmp_path / "run" / "orchestrator.sock"
    log = tmp_path / f"{name}.log"
    with log.open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "timeslice.cli.main", "serve", "--config", str(tmp_path / "groups.yaml"),
            "--socket", str(sock), "--state-dir", str(tmp_path / "state"), stdout=asyncio.subprocess.PIPE,
            stderr=err)
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith(f"ready TIMESLICE_ORCHESTRATOR=unix://{sock} groups=g({backend})"), log.read_text()
        ports = re.findall(r"orchestrator serving listen=127.0.0.1:0 port=(\d+)", log.read_text())
        yield str(sock), int(ports[-1]), proc  # logged before `ready`
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)


@pytest.fixture
async def served(tmp_path) -> AsyncIterator[tuple[str, int]]:
    """(socket path, loopback port) of a `serve_process`; it must stop cleanly."""
    async with serve_process(tmp_path) as (sock, port, proc):
        yield sock, port
    assert proc.returncode == 0
    assert not await asyncio.to_thread(os.path.exists, sock)


async def start_jobs(code: str, args: dict[str, list[str]], env: dict[str, str]
                     ) -> dict[str, asyncio.subprocess.Process]:
    """One `python -c code *args[name]` per job name, each in its own session (its own job under
    serve), stdout and stderr piped together."""
    return {name: await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, *argv, env=env, start_new_session=True,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT) for name, argv in args.items()}


async def outputs(jobs: dict[str, asyncio.subprocess.Process], timeout: float = 90) -> dict[str, str]:
    """Each job's output once it ended (within `timeout` seconds each)."""
    return {name: (await asyncio.wait_for(p.communicate(), timeout))[0].decode() for name, p in jobs.items()}


async def kill_left(jobs: dict[str, asyncio.subprocess.Process]) -> None:
    """Kill the jobs that have not ended (a test that failed)."""
    for p in jobs.values():
        if p.returncode is None:
            p.kill()
            await p.wait()


def env_for(sock: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
    return {**env, "TIMESLICE_ORCHESTRATOR": f"unix://{sock}", **extra}


@pytest.mark.parametrize("worker", ["in-group", "setsid", "daemon"])
async def test_two_jobs_in_their_own_process_groups_share_the_group_and_the_other_is_frozen(served, tmp_path,
                                                                                          worker: str) -> None:
    """Each job's worker is frozen while the other job holds, also a worker that left its
    job's process group with `setsid`, or its process tree too by a double fork (issue 23:
    each kept running, an escaped job)."""
    sock, _ = served
    assert os.stat(sock).st_mode & 0o777 == 0o600
    jobs = [await asyncio.create_subprocess_exec(sys.executable, "-c", JOB, name, str(tmp_path), "3", worker,
                                                 env=env_for(sock), start_new_session=True) for name in "ab"]
    for job in jobs:
        assert await asyncio.wait_for(job.wait(), 90) == 0
    check_hand_offs(tmp_path, "ab")
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        status = await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"))
    assert status.switches >= 1 and status.failed_switches == 0
    pgids = {f"pgid-{job.pid}" for job in jobs}  # each job leads its own session, hence its group
    assert {r.to_job_id for r in status.recent_switches} == pgids


async def test_callers_that_bypass_the_socket_or_share_a_process_group_are_refused(served) -> None:
    sock, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:  # the loopback port, not the socket
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.OrchestratorStub(ch).Acquire(pb.AcquireRequest(group_id="g", job_id="x"))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "unix socket" in str(err.value.details())
    # one process group acting for two jobs: the second is refused (freezing one would freeze both)
    script = ("import sys\nfrom timeslice import TimeSliceOrchestratorClient\n"
              "c = TimeSliceOrchestratorClient(group_id='g', job_id=sys.argv[1])\n"
              "try:\n  c.acquire(timeout=30); c.release(); print('ok')\n"
              "except Exception as e:\n  print(type(e).__name__, e)\nc.close()")
    run = [await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script, job], env=env_for(sock),
                                   capture_output=True, text=True, timeout=60)
           for job in ("first", "second")]  # both in this test's process group
    assert run[0].stdout.strip() == "ok", run[0]
    assert run[1].stdout.startswith("AccessDenied"), run[1]
    assert "belongs to job 'first'" in run[1].stdout and "own process group" in run[1].stdout, run[1]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
async def test_another_users_process_cannot_call(served) -> None:
    sock, _ = served
    probe = "import os, socket, sys\nos.setgid(65534)\nos.setuid(65534)\ns = socket.socket(socket.AF_UNIX)\n" \
            "try:\n  s.connect(sys.argv[1])\nexcept PermissionError:\n  print('refused')"  # as user nobody
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", probe, sock], capture_output=True,
                                  text=True, timeout=30)
    assert out.stdout.strip() == "refused", out


def test_serve_without_groups_or_gpus_says_what_to_do(tmp_path) -> None:
    if gpu_count():
        pytest.skip("a GPU is here: the default groups would be made from it")
    out = subprocess.run([sys.executable, "-m", "timeslice.cli.main", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no NVIDIA GPU found" in out.stderr and "--config" in out.stderr, out
    assert "Traceback" not in out.stderr
    assert Path(tmp_path / "s.sock").exists() is False


@pytest.mark.parametrize(("text", "error"), [
    ("groups: [gpu0]", "a list of mappings"),
    ("groups: {id: g, backend: freeze}", "a list of mappings"),
    ("groups: []", "no groups"),
    ("groups: [{id: g, backend: cooperative, memory_headroom: lots}]", "memory headroom 'lots'"),
    ("groups: [{id: g, backend: app}]", "apps: {<job>: {engine: vllm|sglang, url: http://127.0.0.1:PORT}} (name"),
    ("groups: [{id: g, backend: app, apps: {j: {engine: vllm, url: 'http://127.0.0.1:1', timeoutSeconds: 5}}}]",
     "apps.j.timeoutSeconds: a group in this file names it timeout_seconds"),
])
def test_a_config_file_that_is_not_a_list_of_groups_says_so(tmp_path, text: str, error: str) -> None:
    """A new user's mistakes (issue 21's trial): a list of names or one mapping read as "no
    groups"; the app backend's example printed doubled braces."""
    (tmp_path / "groups.yaml").write_text(text)
    cfg = ServeConfig(socket=tmp_path / "s.sock", groups_file=tmp_path / "groups.yaml")
    with pytest.raises(ValueError, match=re.escape(error)):
        orchestrator_config(cfg, "unix:///agent.sock", tmp_path)


def test_a_config_with_several_bad_fields_is_one_line_per_field_naming_it(tmp_path) -> None:
    """Config errors were pydantic's text (a count, the field on one line, the message on the
    next, a URL on a third): now one line per bad field, its path and the value given."""
    (tmp_path / "groups.yaml").write_text("groups: [{id: g, backend: freez, lease_seconds: -1}]\n")
    out = subprocess.run([sys.executable, "-m", "timeslice.cli.main", "serve", "--config",
                          str(tmp_path / "groups.yaml"), "--socket", str(tmp_path / "s.sock"), "--state-dir",
                          str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    prefix = f"timeslice serve: error: --config {tmp_path / 'groups.yaml'}: groups[0]."
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"{prefix}backend: Input should be 'cuda', 'cuda-checkpoint', 'vmm', 'freeze', 'cooperative', 'app' or 'none' "
        "(got 'freez')",
        f"{prefix}lease_seconds: Input should be greater than 0 (got -1)"], out.stderr


def test_a_config_file_in_timeslice_configs_names_is_told_the_static_ones(tmp_path) -> None:
    """The docs name the residency settings as TimeSliceConfig does (`memoryHeadroom`);
    `serve --config` said only "Extra inputs are not permitted". One style per file format:
    snake_case here, and the error names the field to use."""
    (tmp_path / "groups.yaml").write_text("groups: [{id: g, backend: cooperative, memoryHeadroom: 8Gi}]")
    cfg = ServeConfig(socket=tmp_path / "s.sock", groups_file=tmp_path / "groups.yaml")
    with pytest.raises(ValueError, match="memoryHeadroom: a group in this file names it memory_headroom"):
        orchestrator_config(cfg, "unix:///agent.sock", tmp_path)
    (tmp_path / "groups.yaml").write_text("groups: [{id: g, backend: cooperative, memory_headroom: 8Gi, "
                                          "resident_first_seconds: 5, lease_seconds: 3}]")
    (g,) = orchestrator_config(cfg, "unix:///agent.sock", tmp_path).groups
    assert (g.memory_headroom, g.resident_first_seconds, g.lease_seconds) == ("8Gi", 5.0, 3.0)
    (tmp_path / "groups.yaml").write_text("groups: [{id: g, backend: app, apps: {j: {engine: vllm, url: "
                                          "'http://127.0.0.1:1', timeout_seconds: 5}}}]")
    (g,) = orchestrator_config(cfg, "unix:///agent.sock", tmp_path).groups
    assert g.apps["j"].timeoutSeconds == 5.0  # the file's style for the engine's keys too


def test_a_process_groups_members_follow_a_setsid_child_unless_it_joined_another_jobs_group() -> None:
    from timeslice.driver.peercred import members

    parent = subprocess.Popen(["sh", "-c", "setsid sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())  # soon in its own session and group, still sh's child
        deadline = time.monotonic() + 30
        while os.getpgid(child) != child:  # setsid(2) runs in the child after sh printed its pid
            assert time.monotonic() < deadline, "the child never called setsid"
            time.sleep(0.01)
        group = Scope("process-group", str(parent.pid))
        assert child in members(group, os.getuid()) and parent.pid in members(group, os.getuid())
        assert child not in members(group, os.getuid(), elsewhere=lambda s: s.key == str(child))
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        if child:
            subprocess.run(["pkill", "-KILL", "-s", str(child)], check=False)  # its own session
        parent.wait()
        parent.stdout.close()  # type: ignore[union-attr]


def test_a_process_group_number_reused_by_another_users_process_is_bound_afresh() -> None:
    """With `--socket-mode 660`, another user's process group bound job `pgid-N`; after it
    ended, a victim's new group got the number N, and its calls joined that binding (still
    the other uid's): the agent then moved only that uid's processes, never the victim's. A
    binding remembers its group leader's start time; a leader born since is a new group.
    (Real PID reuse cannot be forced: the recorded birth is set to an earlier one here.)"""
    leader = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        jobs, scope, job = PeerJobs(), Scope("process-group", str(leader.pid)), f"pgid-{leader.pid}"
        jobs.bind(job, PeerCredentials(pid=leader.pid, uid=1001, gid=1001), scope)
        assert jobs.scopes(job) == [(scope, 1001)]
        jobs._born[scope] -= 1  # the group it was bound for was led by an older process of that number
        jobs.bind(job, PeerCredentials(pid=leader.pid, uid=1002, gid=1002), scope)  # the victim's call
        assert jobs.scopes(job) == [(scope, 1002)]
    finally:
        leader.kill()
        leader.wait()


def test_job_bindings_are_read_by_the_agents_threads_while_the_loop_binds() -> None:
    """A helper's finding (12 times in one serve log while 14 jobs started): a bind on the event
    loop forgot ended scopes while the node agent resolved a job's processes in a worker
    thread, and the resolver raised "dictionary changed size during iteration" (its memory
    report failed; a switch step resolves the same way)."""
    import threading

    jobs, me, errors = PeerJobs(), PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid()), []
    done = threading.Event()

    def resolve() -> None:
        while not done.is_set():
            try:
                jobs.scopes("other")  # (forgets the ended scopes too)
            except Exception as err:  # the race, as the agent's resolver met it
                errors.append(err)
                return

    reader = threading.Thread(target=resolve)
    reader.start()
    try:
        for i in range(3000):  # process groups that ended at once (no such group): each bind forgets the last
            jobs.bind(f"j{i % 50}", me, Scope("process-group", str(4_190_000 + i)))
    finally:
        done.set()
        reader.join()
    assert errors == []


def test_job_bindings_kept_in_the_state_dir_say_after_a_restart_which_jobs_are_gone(tmp_path, caplog) -> None:
    """`timeslice serve` keeps its bindings in its state dir: a restarted server knows that an
    adopted holder's processes are gone (its group ended, or its number now leads a newer
    process) and that a live one is not; a job it never bound is not called gone. An
    unreadable file is logged and ignored."""
    leader = subprocess.Popen(["sleep", "600"], start_new_session=True)
    ended = subprocess.Popen(["true"], start_new_session=True)
    ended.wait()
    try:
        path = tmp_path / "jobs.json"
        jobs = PeerJobs(path)
        for p in (leader, ended):
            jobs.bind(f"pgid-{p.pid}", PeerCredentials(pid=p.pid, uid=os.getuid(), gid=os.getgid()),
                      Scope("process-group", str(p.pid)))
        again = PeerJobs(path)
        assert again.gone(f"pgid-{ended.pid}") and not again.gone(f"pgid-{leader.pid}") and not again.gone("other")
        assert again.scopes(f"pgid-{leader.pid}") == [(Scope("process-group", str(leader.pid)), os.getuid())]
        path.write_text("{not json")
        assert not PeerJobs(path).gone(f"pgid-{ended.pid}") and "job bindings" in caplog.text
    finally:
        leader.kill()
        leader.wait()


def test_a_job_whose_bound_process_group_ended_is_not_gone_while_a_process_it_names_lives() -> None:
    """A new user's trial of the dead-holder drop: the job's bound process group ended while a
    worker it started (in a session of its own, or another process group of a job named by
    TIMESLICE_JOB) still computed; serve dropped the job as gone, and the agent, finding none
    of its processes, let the worker compute beside the next holder. A job's processes are one
    set (`PeerJobs.processes`), which the agent moves and `gone` reads, also after another
    job's bind forgot the ended group."""
    me = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    client = subprocess.Popen(["sleep", "600"], start_new_session=True)
    worker = subprocess.Popen(["sleep", "600"], start_new_session=True, env={**os.environ, "TIMESLICE_JOB": "train"})
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        jobs = PeerJobs()
        jobs.bind("train", me, Scope("process-group", str(client.pid)))
        assert jobs.processes("train") == sorted([client.pid, worker.pid]) and not jobs.gone("train")
        client.kill()
        client.wait()
        jobs.bind("other", me, Scope("process-group", str(other.pid)))  # (forgets train's ended group)
        assert jobs.scopes("train") == [] and jobs.processes("train") == [worker.pid]
        assert not jobs.gone("train")
        worker.kill()
        worker.wait()
        assert jobs.gone("train") and not jobs.gone("other") and not jobs.gone("never-bound")
    finally:
        for p in (client, worker, other):
            p.kill()
            p.wait()


def test_a_process_group_left_with_only_unreaped_zombies_is_gone() -> None:
    """A job killed with its process group (`kill -9 -- -PGID`) while whoever started it has
    not reaped it yet (a launcher that waits for its jobs one after the other): its leader is a
    zombie, which `killpg(pgid, 0)` still finds. Nothing of it can compute, so the job is gone
    at once (serve drops the holder), not after its lease; a live member keeps the group."""
    me = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    leader = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
    try:
        jobs = PeerJobs()
        jobs.bind("train", me, Scope("process-group", str(leader.pid)))
        deadline = time.monotonic() + 30
        while len(jobs.processes("train")) < 2:  # (the shell and its sleep)
            assert time.monotonic() < deadline, "the job's sleep never started"
            time.sleep(0.01)
        child = max(p for p in jobs.processes("train") if p != leader.pid)
        os.kill(leader.pid, signal.SIGKILL)  # the leader alone: a zombie (unreaped), its sleep lives on
        while stat_fields(leader.pid)[0] != b"Z":
            assert time.monotonic() < deadline, "the leader never became a zombie"
            time.sleep(0.01)
        assert jobs.processes("train") == [child] and not jobs.gone("train")
        os.kill(child, signal.SIGKILL)  # (reaped by init: the group is its zombie leader alone)
        while jobs.processes("train"):
            assert time.monotonic() < deadline, "the sleep never ended"
            time.sleep(0.01)
        assert jobs.gone("train")
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_a_job_belongs_to_the_uid_that_first_acted_for_it_and_a_scope_to_one_job() -> None:
    jobs = PeerJobs()
    group = Scope("process-group", str(os.getpgrp()))  # a live group, so that it is not forgotten
    jobs.bind("j", PeerCredentials(pid=1, uid=1000, gid=1000), group)
    with pytest.raises(PermissionDenied, match="belongs to uid 1000"):
        jobs.bind("j", PeerCredentials(pid=2, uid=1001, gid=1001), Scope("cgroup", "/"))
    with pytest.raises(PermissionDenied, match="belongs to job 'j'"):
        jobs.bind("k", PeerCredentials(pid=3, uid=1000, gid=1000), group)
    jobs.bind("j", PeerCredentials(pid=4, uid=0, gid=0), Scope("cgroup", "/"))  # root may act for any job
    assert sorted(str(s) for s, _ in jobs.scopes("j")) == ["cgroup /", f"process-group {os.getpgrp()}"]
    assert {uid for _, uid in jobs.scopes("j")} == {1000}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_on_a_shared_socket_no_user_takes_a_job_name_before_its_owner() -> None:
    """Issue 23: with `--socket-mode 660`, another user could name a job first ('train', or
    `pgid-<N>` of the serving user's group), and the owner's job of that name was refused."""
    sessions = [subprocess.Popen(["sleep", "60"], start_new_session=True, user=uid) for uid in (65534, 0)]
    try:
        auth = PeerAuthenticator(UnixFront(Path("/nonexistent/sock")), PeerJobs())
        other, own = (PeerCaller(PeerCredentials(p.pid, uid, uid), Scope("process-group", str(p.pid)),
                                 f"pgid-{p.pid}", serving_uid=0) for p, uid in zip(sessions, (65534, 0), strict=True))
        assert other.job_for("train") == "uid65534/train" and own.job_for("train") == "train"
        assert other.job_for("uid65534/train") == "uid65534/train"  # idempotent
        assert other.job_for("uid0/train") == "uid65534/uid0/train"  # never another user's name
        auth.admit(other, None, other.job_for("train"))
        auth.admit(own, None, own.job_for("train"))  # its own 'train', not refused
        with pytest.raises(PermissionDenied, match="serve gives that name"):
            auth.admit(other, None, f"pgid-{own.scope.key}")  # the serving user's group's name
        with pytest.raises(PermissionDenied, match="serve gives that name"):
            auth.admit(own, None, "uid65534/later")  # user 65534's name, before it named it (root too)
    finally:
        for p in sessions:
            p.kill()
            p.wait()
