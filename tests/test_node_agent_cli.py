"""A standalone node (issue 13, item 1): `timeslice node-agent` and `timeslice orchestrator`
as real processes, the agent on a TCP address with a shared token and a pinned self-signed
certificate; jobs named by TIMESLICE_JOB in their environment (no PIDs given anywhere),
moved by the `freeze` backend on the CPU."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.names import AGENT_TLS_SERVER_NAME
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

from bench.machine import free_port
from tests.conftest import eventually
from tests.test_serve import JOB, check_hand_offs


async def start(*args: str, ready: re.Pattern[bytes], stream: str) -> tuple[asyncio.subprocess.Process, re.Match]:
    """A `timeslice` process and the first line of `stream` (stdout or stderr) that matches."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "timeslice.cli.main", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out = proc.stdout if stream == "stdout" else proc.stderr
    assert out is not None
    while True:
        line = await asyncio.wait_for(out.readline(), 60)
        assert line, f"timeslice {args[0]} ended before it was ready"
        m = ready.search(line)
        if m:
            return proc, m


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(proc.wait(), 30)


@pytest.fixture
async def node(tmp_path) -> AsyncIterator[tuple[str, Path, Path]]:
    """A node agent on 127.0.0.1 with a token and TLS: (address, token file, certificate file)."""
    token = tmp_path / "token"
    token.write_text("s3cret-shared-token\n")
    cert = tmp_path / "agent.pem"
    agent, m = await start("node-agent", "--listen", "127.0.0.1:0", "--token-file", str(token), "--tls",
                           "--certificate-file", str(cert), "--backends", "freeze,none", "--state-dir",
                           str(tmp_path / "agent-state"), ready=re.compile(rb"^ready listen=(\S+)"), stream="stdout")
    try:
        yield m.group(1).decode(), token, cert
    finally:
        await stop(agent)
    assert agent.returncode == 0


async def test_jobs_named_in_their_environment_are_moved_by_a_standalone_node_agent(node, tmp_path) -> None:
    address, token, cert = node
    config = {"listen": "127.0.0.1:0", "agent_token_file": str(token), "agent_certificates": {address: str(cert)},
              "state_file": str(tmp_path / "state.json"),
              "groups": [{"id": "g", "backend": "freeze", "agents": [address], "lease_seconds": 10}]}
    await orchestrate_jobs_a_and_b(config, tmp_path)
    check_hand_offs(tmp_path, "ab")


async def orchestrator(config: dict, tmp_path: Path) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    """`timeslice orchestrator --config` with `config` (a loopback `listen`), once it serves, and
    the environment of a job that calls it (no other TIMESLICE_ setting)."""
    (tmp_path / "orchestrator.yaml").write_text(yaml.safe_dump(config))
    orch, m = await start("orchestrator", "--config", str(tmp_path / "orchestrator.yaml"),
                          ready=re.compile(rb"orchestrator serving listen=\S+ port=(\d+)"), stream="stderr")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
    return orch, {**env, "TIMESLICE_ORCHESTRATOR": f"127.0.0.1:{m.group(1).decode()}"}


async def orchestrate_jobs_a_and_b(config: dict, tmp_path: Path) -> asyncio.subprocess.Process:
    """`orchestrator` with `config`, and jobs a and b (`TIMESLICE_JOB`, 3 rounds of
    `tests.test_serve.JOB` each) run to their exit 0 through it; returns the stopped orchestrator
    process."""
    orch, env = await orchestrator(config, tmp_path)
    try:
        jobs = [await asyncio.create_subprocess_exec(sys.executable, "-c", JOB, name, str(tmp_path), "3",
                                                     env={**env, "TIMESLICE_JOB": name}) for name in "ab"]
        for job in jobs:
            assert await asyncio.wait_for(job.wait(), 90) == 0
    finally:
        await stop(orch)
    return orch


# Holds the group, prints "granted", then ends by its own release (argv[1] "release") or waits
# for a signal (argv[1] "hold": the test kills it).
HOLDER = textwrap.dedent("""
    import signal, sys
    from timeslice import TimeSliceOrchestratorClient
    c = TimeSliceOrchestratorClient(group_id="g")
    c.acquire(timeout=60)
    print("granted", flush=True)
    if sys.argv[1] == "hold":
        signal.pause()
    c.release()
    c.close()
""")


async def test_a_standalone_holder_killed_is_dropped_at_once_not_after_its_lease(tmp_path, short_tmp) -> None:
    """`kill -9` of a holding job on a standalone node (`node-agent` on its default unix socket +
    `orchestrator`): the waiting job stalled for the holder's whole lease. Now the orchestrator
    asks the agent about its holders at each grant and every 0.5 s (`gone_holders`), and the
    agent, having seen the job's TIMESLICE_JOB-named process, says it is gone: B, waiting with a
    60 s timeout, is granted under a lease of 300 s. (The kill waits until the agent has seen a,
    as the watch's look at a's grant makes it: one the agent never saw is unknown, not gone.)"""
    agent_sock = f"unix://{short_tmp / 'a.sock'}"
    agent, _ = await start("node-agent", "--listen", agent_sock, "--state-dir", str(tmp_path / "agent-state"),
                           ready=re.compile(rb"^ready listen="), stream="stdout")
    jobs: list[asyncio.subprocess.Process] = []
    try:
        orch, env = await orchestrator({"listen": "127.0.0.1:0", "state_file": str(tmp_path / "state.json"),
                                         "groups": [{"id": "g", "backend": "freeze", "agents": [agent_sock],
                                                     "lease_seconds": 300}]}, tmp_path)
        try:
            for name, how in (("a", "hold"), ("b", "release")):
                jobs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-c", HOLDER, how, env={**env, "TIMESLICE_JOB": name},
                    stdout=asyncio.subprocess.PIPE))
                assert jobs[-1].stdout is not None
                if name == "a":
                    assert await asyncio.wait_for(jobs[-1].stdout.readline(), 60) == b"granted\n"
                    await eventually(lambda: _agent_sees(agent_sock, "a"), timeout=30, what="the agent seeing a")
            jobs[0].kill()
            await jobs[0].wait()
            assert await asyncio.wait_for(jobs[1].stdout.readline(), 90) == b"granted\n"  # type: ignore[union-attr]
            assert await asyncio.wait_for(jobs[1].wait(), 60) == 0
        finally:
            await stop(orch)
        assert orch.stderr is not None
        log = (await orch.stderr.read()).decode()
        assert "holder gone group=g job=a" in log and "lease expired" not in log, log[-3000:]
    finally:
        for job in jobs:
            if job.returncode is None:
                job.kill()
                await job.wait()
        await stop(agent)


async def _agent_sees(target: str, job: str) -> bool:
    async with grpc.aio.insecure_channel(target) as ch:
        req = apb.GetLiveJobsRequest(jobs=[apb.SwitchStepRequest(job_id=job)])
        return job in (await apb_grpc.NodeAgentStub(ch).GetLiveJobs(req, timeout=10)).live


# Holds the group until SIGUSR1, then releases and prints "released".
HOLD_UNTIL_USR1 = textwrap.dedent("""
    import signal
    from timeslice import TimeSliceOrchestratorClient
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])  # (before any thread starts: all inherit it)
    c = TimeSliceOrchestratorClient(group_id="g")
    c.acquire(timeout=60)
    print("granted", flush=True)
    signal.sigwait([signal.SIGUSR1])
    c.release()
    print("released", flush=True)
    c.close()
""")


async def _group(target: str) -> pb.GroupStatus:
    async with grpc.aio.insecure_channel(target) as ch:
        return await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"), timeout=10)


async def test_an_orchestrator_restarted_with_its_defaults_keeps_the_holder_and_grants_nobody_beside_it(
        tmp_path, short_tmp) -> None:
    """A helper's attack on a standalone node: `kill -9` of the orchestrator while job a held and
    b waited frozen, then the same command again: with no state file (the default then), the new
    orchestrator knew only that b was checkpointed, thawed and granted it while a computed (3.4 s
    of double compute), and a lost its lease. The default is now a state file in the state dir
    ($XDG_STATE_HOME here): the restart keeps a as the holder, and b is granted only after a
    releases."""
    agent_sock = f"unix://{short_tmp / 'a.sock'}"
    agent, _ = await start("node-agent", "--listen", agent_sock, "--state-dir", str(tmp_path / "agent-state"),
                           ready=re.compile(rb"^ready listen="), stream="stdout")
    (tmp_path / "orchestrator.yaml").write_text(yaml.safe_dump(
        {"listen": f"127.0.0.1:{free_port()}", "groups": [{"id": "g", "backend": "freeze", "agents": [agent_sock]}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state-home")
    argv = [sys.executable, "-m", "timeslice.cli.main", "orchestrator", "--config", str(tmp_path / "orchestrator.yaml")]
    orchs: list[asyncio.subprocess.Process] = []
    jobs: list[asyncio.subprocess.Process] = []
    drains: list[asyncio.Future[bytes]] = []

    async def orchestrator_of_the_defaults() -> str:
        orchs.append(await asyncio.create_subprocess_exec(*argv, env=env, stderr=asyncio.subprocess.PIPE))
        while True:
            line = await asyncio.wait_for(orchs[-1].stderr.readline(), 60)  # type: ignore[union-attr]
            assert line, "the orchestrator ended before it was ready"
            if m := re.search(rb"orchestrator serving listen=(\S+) port=(\d+)", line):
                drains.append(asyncio.ensure_future(orchs[-1].stderr.read()))  # type: ignore[union-attr]
                return f"127.0.0.1:{m.group(2).decode()}"

    try:
        target = await orchestrator_of_the_defaults()
        job_env = {**env, "TIMESLICE_ORCHESTRATOR": target}
        for name, code in (("a", HOLD_UNTIL_USR1), ("b", HOLDER)):
            jobs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, *(["release"] if name == "b" else []), stdout=asyncio.subprocess.PIPE,
                env={**job_env, "TIMESLICE_JOB": name, "TIMESLICE_ACCELERATOR_PROCESS": "1"}))
            if name == "a":
                assert await asyncio.wait_for(jobs[0].stdout.readline(), 60) == b"granted\n"  # type: ignore[union-attr]
        await eventually(lambda: _waits(target, "b"), timeout=60, what="b waiting")
        orchs[0].kill()
        await orchs[0].wait()
        await orchestrator_of_the_defaults()  # the same command again
        await eventually(lambda: _waits(target, "b"), timeout=60, what="b waiting at the restarted orchestrator")
        status = await _group(target)
        assert status.holder.job_id == "a", status
        jobs[0].send_signal(signal.SIGUSR1)
        assert await asyncio.wait_for(jobs[0].stdout.readline(), 60) == b"released\n"  # type: ignore[union-attr]
        assert await asyncio.wait_for(jobs[1].stdout.readline(), 60) == b"granted\n"  # type: ignore[union-attr]
        assert await asyncio.wait_for(jobs[0].wait(), 60) == 0 and await asyncio.wait_for(jobs[1].wait(), 60) == 0
        assert (tmp_path / "state-home" / "timeslice" / "orchestrator" / "state.json").exists()
    finally:
        for p in [*jobs, *orchs]:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await stop(agent)


async def _waits(target: str, job: str) -> bool:
    try:
        return any(w.job_id == job for w in (await _group(target)).waiters)
    except grpc.aio.AioRpcError:  # (not serving yet)
        return False


async def test_the_node_agent_wants_its_token_over_its_pinned_certificate(node) -> None:
    address, _, cert = node
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with grpc.aio.secure_channel(address, creds,
                                       options=(("grpc.ssl_target_name_override", AGENT_TLS_SERVER_NAME),)) as ch:
        stub = apb_grpc.NodeAgentStub(ch)
        for metadata, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", "Bearer wrong"),), grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListJobs(apb.ListJobsRequest(), metadata=metadata)
            assert err.value.code() == code, err.value
        await stub.ListJobs(apb.ListJobsRequest(), metadata=(("authorization", "Bearer s3cret-shared-token"),))


async def test_a_network_address_without_a_token_is_refused_at_start(tmp_path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "timeslice.cli.main", "node-agent", "--listen", "127.0.0.1:0", "--state-dir",
        str(tmp_path), stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"needs --token-file" in err and b"Traceback" not in err


async def test_the_default_backends_serve_on_a_unix_socket(tmp_path, short_tmp) -> None:
    """Found by a new-user try: the default --backends named one the agent refuses."""
    agent, m = await start("node-agent", "--listen", f"unix://{short_tmp / 'a.sock'}", "--state-dir",
                           str(tmp_path), ready=re.compile(rb"^ready listen=(\S+)"), stream="stdout")
    try:
        assert m.group(1).decode() == f"unix://{short_tmp / 'a.sock'}"
        assert (short_tmp / "a.sock").stat().st_mode & 0o777 == 0o600
    finally:
        await stop(agent)
    assert agent.returncode == 0


async def test_a_second_node_agent_on_the_same_socket_or_state_dir_is_refused_and_the_first_serves_on(
        tmp_path, short_tmp) -> None:
    """A helper's attack: a second `timeslice node-agent` (defaults) took the first one's socket
    over and removed it on exit: the first agent could no longer be reached, and a restarted
    orchestrator then waited for its records forever. Now the second exits 2, touching nothing."""
    sock = f"unix://{short_tmp / 'a.sock'}"
    agent, _ = await start("node-agent", "--listen", sock, "--state-dir", str(tmp_path / "s1"),
                           ready=re.compile(rb"^ready listen="), stream="stdout")
    try:
        for state_dir, why in ((tmp_path / "s1", b"another timeslice node-agent uses this state dir"),
                               (tmp_path / "s2", b"another server is listening there")):
            second = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "timeslice.cli.main", "node-agent", "--listen", sock, "--state-dir",
                str(state_dir), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(second.communicate(), 60)
            assert second.returncode == 2 and why in err and b"ready" not in out, err
        async with grpc.aio.insecure_channel(sock) as ch:  # the first one serves on, on its socket
            await apb_grpc.NodeAgentStub(ch).ListJobs(apb.ListJobsRequest(), timeout=10)
    finally:
        await stop(agent)
    assert agent.returncode == 0


async def test_a_restarted_agent_keeps_the_certificate_the_orchestrator_pins(tmp_path) -> None:
    """Found by a new-user try: each start made a new certificate, and the orchestrator's pin
    then refused every call (a frozen job there could not be restored)."""
    token = tmp_path / "token"
    token.write_text("t\n")
    pems = []
    for n in range(2):
        cert = tmp_path / f"agent-{n}.pem"
        agent, _ = await start("node-agent", "--listen", "127.0.0.1:0", "--token-file", str(token), "--tls",
                               "--certificate-file", str(cert), "--backends", "freeze,none", "--state-dir",
                               str(tmp_path / "state"), ready=re.compile(rb"^ready listen="), stream="stdout")
        await stop(agent)
        pems.append(cert.read_bytes())
    assert pems[0] == pems[1] and pems[0].startswith(b"-----BEGIN CERTIFICATE-----")
    assert (tmp_path / "state" / "agent-key.pem").stat().st_mode & 0o777 == 0o600
