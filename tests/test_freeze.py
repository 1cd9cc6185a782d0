"""The `freeze` backend and the node agent on real child processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import grpc
import grpc.aio
import pytest
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.errors import FailedPrecondition, InvalidArgument, ProcessGone
from timeslice.driver.peercred import environ
from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
from timeslice.kubelet_plugin.agent.host_processes import EnvironProcessResolver
from timeslice.kubelet_plugin.agent.node_agent import JobRef, NodeAgent, StepRequest
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.procfs import proc_state
from timeslice.kubelet_plugin.agent.server import create_server

from tests.conftest import eventually, python_child

SPIN = """
    import time
    print("ready", flush=True)
    n = 0
    while True:
        n += 1
        if n % 100000 == 0:
            print(n, flush=True)
"""


def spinner(children):
    p = python_child(SPIN)
    children.append(p)
    assert p.stdout.readline() == "ready\n"
    return p


async def test_freeze_stops_and_thaw_resumes_real_processes(children) -> None:
    procs = [spinner(children) for _ in range(2)]
    pids = [p.pid for p in procs]
    b = FreezeBackend()
    states = await b.checkpoint(pids, timeout=5)
    assert [s.state for s in states] == ["stopped", "stopped"]
    assert all(proc_state(pid) == "T" for pid in pids)
    assert [s.state for s in await b.state(pids)] == ["stopped", "stopped"]
    await b.restore(pids, timeout=5)
    assert all(proc_state(pid) in "RS" for pid in pids)
    assert procs[0].stdout.readline().strip().isdigit()  # it computes again


async def test_a_process_gone_during_the_step_is_reported_gone_and_the_others_move(children) -> None:
    """Issue 10, item 10: a target that ended during the step failed the whole step (and its
    job stayed "resident"); it has nothing left to move: it is reported `gone`."""
    alive = spinner(children)
    dead = python_child("pass")
    dead.wait()
    dead.stdout.close()
    backend = FreezeBackend()
    states = {p.pid: p.state for p in await backend.checkpoint([alive.pid, dead.pid], timeout=5)}
    assert states == {alive.pid: "stopped", dead.pid: "gone"} and proc_state(alive.pid) == "T"
    states = {p.pid: p.state for p in await backend.restore([alive.pid, dead.pid], timeout=5)}
    assert states[dead.pid] == "gone" and proc_state(alive.pid) in "RS"


# A process that cannot stop yet: vfork()'s parent waits, killable but not stoppable (state D),
# until its child execs or exits, and this child waits for a signal.
VFORKED = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    print("vforking", flush=True)
    if libc.vfork() == 0:
        libc.pause()
        libc._exit(0)
"""


def _stop_pending(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    pending = next(line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:"))
    return bool(int(pending, 16) & (1 << (signal.SIGSTOP - 1)))


def _first_child(pid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])


async def test_a_process_that_exits_before_its_sigstop_takes_effect_is_gone_at_once(children) -> None:
    """A helper's attack on `timeslice serve`: a job forking short-lived children had one exit
    after the freeze's SIGSTOP was sent and before it took effect. It stays a zombie (its parent
    is stopped and cannot reap it), and the step waited for it to stop until the step timeout
    (300 s): the group stalled for 5 minutes. A process found a zombie while the step waits is
    gone. Here the process is held off stopping by a vfork() (state D, SIGSTOP pending), then
    killed: a zombie, since this test does not reap it until the end."""
    proc = python_child(VFORKED)
    children.append(proc)
    assert proc.stdout.readline() == "vforking\n"
    await eventually(lambda: proc_state(proc.pid) == "D", 30, what="the vfork parent waiting (state D)")
    child = _first_child(proc.pid)
    try:
        step = asyncio.ensure_future(FreezeBackend().checkpoint([proc.pid], timeout=60))
        await eventually(lambda: _stop_pending(proc.pid), 30, what="the SIGSTOP sent and pending")
        assert not step.done()
        proc.kill()
        await eventually(lambda: proc_state(proc.pid) == "Z", 30, what="the process a zombie")
        assert [s.state for s in await asyncio.wait_for(step, 30)] == ["gone"]
    finally:
        os.kill(child, signal.SIGKILL)


# A job's marked worker that forks a child every 2 ms, up to 200; each child lives on, waiting
# for a signal (it runs, in state S, unless stopped), and so does the worker after its forks.
FORKING = """
    import os, signal, time
    print("ready", flush=True)
    for _ in range(200):
        if os.fork() == 0:
            signal.pause()
        time.sleep(0.002)
    signal.pause()
"""


def _running(job: str) -> list[int]:
    """The processes of `job` (TIMESLICE_JOB) that are neither stopped nor ended."""
    running = []
    for pid in (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()):
        with contextlib.suppress(ProcessGone):
            if f"TIMESLICE_JOB={job}".encode() in environ(pid) and proc_state(pid) not in "TtZ":
                running.append(pid)
    return running


async def test_processes_forked_during_a_freeze_are_stopped_with_their_job(children, tmp_path) -> None:
    """A helper's attack on `timeslice serve`: a frozen job's marked worker forked a child
    between the listing of the job's processes and its SIGSTOP; the child was never stopped and
    computed beside the holder for its whole life (7 of 9 phases). After every freeze while the
    worker forks, no process of the job runs; the children forked meanwhile are thawed with it."""
    job = f"forky-{tmp_path.name}"
    env = {**os.environ, "TIMESLICE_JOB": job, "TIMESLICE_ACCELERATOR_PROCESS": "1"}
    worker = python_child(FORKING, env=env)
    children.append(worker)
    assert worker.stdout.readline() == "ready\n"
    agent = NodeAgent(EnvironProcessResolver(gpu_uuids=set), backends=["freeze"])
    step = StepRequest(JobRef(job), "freeze", "g", timeout=30)
    try:
        for _ in range(10):
            await agent.checkpoint(step)
            assert await asyncio.to_thread(_running, job) == []
            await agent.restore(step)
            assert proc_state(worker.pid) in "RS"
    finally:
        worker.kill()
        for pid in await asyncio.to_thread(_running, job):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_agent_over_grpc_checkpoints_jobs_and_reports_errors(children, tmp_path, short_tmp) -> None:
    proc = spinner(children)
    resolver = StaticProcessResolver({"job-a": [proc.pid]})
    agent = NodeAgent(resolver, backends=["freeze"], records_path=tmp_path / "records.json")
    server, _ = await create_server(agent, f"unix://{short_tmp / 'agent.sock'}")
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp / 'agent.sock'}") as ch:
            stub = apb_grpc.NodeAgentStub(ch)
            r = await stub.Checkpoint(apb.SwitchStepRequest(job_id="job-a", backend="freeze", group_id="g"))
            assert [p.state for p in r.processes] == ["stopped"] and proc_state(proc.pid) == "T"
            assert "job-a" in (tmp_path / "records.json").read_text()
            jobs = (await stub.ListJobs(apb.ListJobsRequest())).jobs
            assert [j.job_id for j in jobs] == ["job-a"]
            st = await stub.GetJobState(apb.GetJobStateRequest(job_id="job-a", backend="freeze"))
            assert st.state == "checkpointed"
            # a restarted agent finds the record, so restore knows the PIDs
            again = NodeAgent(StaticProcessResolver(), backends=["freeze"], records_path=tmp_path / "records.json")
            assert list(again.records.jobs["job-a"].pids) == [proc.pid]
            await stub.Restore(apb.SwitchStepRequest(job_id="job-a", backend="freeze"))
            assert proc_state(proc.pid) in "RS"
            # a job with no processes here (not started yet, or exited) has nothing to move: it says so
            nothing = await stub.Checkpoint(apb.SwitchStepRequest(job_id="nobody", backend="freeze"))
            assert list(nothing.processes) == [] and nothing.bytes == 0
            nothing = await stub.Restore(apb.SwitchStepRequest(job_id="nobody", backend="freeze"))
            assert list(nothing.processes) == [] and nothing.bytes == 0
            for req, code, text in [
                (apb.SwitchStepRequest(job_id="x" * 254, backend="freeze"), grpc.StatusCode.INVALID_ARGUMENT,
                 "at most 253"),
                (apb.SwitchStepRequest(job_id="job-a", backend="cuda"), grpc.StatusCode.INVALID_ARGUMENT,
                 "not offered"),
                (apb.SwitchStepRequest(job_id="job-a", backend=""), grpc.StatusCode.INVALID_ARGUMENT, "required"),
                (apb.SwitchStepRequest(job_id="", backend="freeze"), grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
                (apb.SwitchStepRequest(job_id="job-a", backend="freeze", timeout_seconds=-2),
                 grpc.StatusCode.INVALID_ARGUMENT, "timeout_seconds"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Checkpoint(req)
                assert err.value.code() == code and text in err.value.details()
            assert proc_state(proc.pid) in "RS"  # bad calls touched nothing
    finally:
        await server.stop(0)


async def test_switch_with_freeze_skips_an_outgoing_job_whose_processes_are_gone(make_cluster, children) -> None:
    holder = spinner(children)
    waiter = spinner(children)
    c = await make_cluster(backend="freeze", real_backend=True, jobs={"a": [holder.pid], "b": [waiter.pid]})
    a, b = c.client("a"), c.client("b")
    await a.acquire()
    await a.release()
    holder.kill()
    holder.wait()
    await b.acquire(timeout=5)  # a's processes are gone: nothing to checkpoint, b is granted
    status = await c.status()
    assert status.holder.job_id == "b" and status.failed_switches == 0
    # and a is forgotten: no later hand-off tries to move it (a new user's trial of `serve`: a job
    # killed with its client stayed resident, "nothing to restore" at every switch, for good)
    assert "a" not in [*status.resident_job_ids, *status.checkpointed_job_ids], status
    switches = status.switches
    await b.release()
    await b.acquire(timeout=5)
    assert (await c.status()).switches == switches
    for cl in (a, b):
        await cl.close()


async def test_a_job_with_no_process_is_a_valid_member_hand_off_after_hand_off(make_cluster, children) -> None:
    """Issue 10, item 8: a job that takes the lock before starting its workers. The first
    hand-off worked, the second failed with `restore ... NOT_FOUND`, and every later acquire
    of the group failed."""
    worker = spinner(children)
    c = await make_cluster(backend="freeze", real_backend=True, jobs={"a": [], "b": [worker.pid]})
    a, b = c.client("a"), c.client("b")
    for _ in range(3):
        await a.acquire()
        await a.release()
        await b.acquire()
        assert proc_state(worker.pid) in "RS"
        await b.release()
    status = await c.status()
    assert status.failed_switches == 0 and status.switches >= 5
    await a.close()
    await b.close()


async def test_a_restore_with_another_backend_than_the_checkpoint_is_refused(tmp_path, children) -> None:
    """Issue 10, item 9: freeze, then a restore naming `none`, was reported running, deleted the
    record and left the process stopped."""
    proc = spinner(children)
    agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=["freeze", "none"],
                      records_path=tmp_path / "records.json")
    await agent.checkpoint(StepRequest(JobRef("a"), "freeze", "g", 5))
    assert proc_state(proc.pid) == "T"
    with pytest.raises(FailedPrecondition, match="checkpointed by backend freeze: restore it with that backend"):
        await agent.restore(StepRequest(JobRef("a"), "none", "g", 5))
    assert proc_state(proc.pid) == "T" and "a" in agent.records.jobs  # untouched: the right restore still works
    await agent.restore(StepRequest(JobRef("a"), "freeze", "g", 5))
    assert proc_state(proc.pid) in "RS" and "a" not in agent.records.jobs


async def frozen_by_an_earlier_run(tmp_path, children, group: str = "g") -> tuple[int, object]:
    """A spinner frozen by an agent offering `freeze` (its record in tmp_path/records.json), as a
    killed run leaves it: (its pid, the records' path)."""
    proc = spinner(children)
    records = tmp_path / "records.json"
    agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=["freeze"], records_path=records)
    await agent.checkpoint(StepRequest(JobRef("a"), "freeze", group, 5))
    assert proc_state(proc.pid) == "T"
    return proc.pid, records


async def test_a_record_whose_backend_is_no_longer_offered_is_put_back_at_start(tmp_path, children, caplog) -> None:
    """Found by an attacker: an agent restarted without `freeze` kept a frozen job's record
    without checking it ("cannot check the processes ... (record kept)"), and nothing could
    thaw the job any more (a restore naming another backend is refused). Now its own backend,
    built for that only, puts it back at start; steps still refuse the backend."""
    pid, records = await frozen_by_an_earlier_run(tmp_path, children)
    again = NodeAgent(StaticProcessResolver({"a": [pid]}), backends=["none"], records_path=records)
    await again.recover()
    assert proc_state(pid) in "RS" and again.records.jobs == {}
    assert "job=a group=g was left frozen by backend freeze and backend freeze is not offered" in caplog.text
    with pytest.raises(InvalidArgument, match="not offered"):
        await again.checkpoint(StepRequest(JobRef("a"), "freeze", "g", 5))
    assert proc_state(pid) in "RS"


async def test_a_kept_record_of_a_backend_no_longer_offered_is_restored_by_a_step_naming_it(tmp_path,
                                                                                           children) -> None:
    """A record put back at start failed to be (an `app` engine not answering yet): a restore
    step naming its backend still puts it back, with that backend built for it."""
    pid, records = await frozen_by_an_earlier_run(tmp_path, children)
    again = NodeAgent(StaticProcessResolver({"a": [pid]}), backends=["none"], records_path=records)
    await again.restore(StepRequest(JobRef("a"), "freeze", "g", 5))  # (no recover: as if it had failed)
    assert proc_state(pid) in "RS" and again.records.jobs == {}


async def test_a_record_that_cannot_be_put_back_is_kept_with_an_error_naming_the_way_out(tmp_path, children,
                                                                                          caplog) -> None:
    """Backend `app` with no engine recorded cannot be built to put a record back: the record
    stays, and an error line names the job and what to do."""
    from timeslice.kubelet_plugin.agent.records import JobRecord, JobRecords

    pid = spinner(children).pid
    JobRecords(tmp_path / "records.json").put("a", JobRecord("app", "g", {pid: 0}))
    again = NodeAgent(StaticProcessResolver(), backends=["none"], records_path=tmp_path / "records.json")
    await again.recover()
    assert "a" in again.records.jobs
    assert f"job=a pids=[{pid}] stays checkpointed by backend app, and nobody will restore it" in caplog.text
    assert "Put group g back on backend app" in caplog.text


@pytest.mark.parametrize(("groups", "thawed"), [({"g": "freeze"}, False), ({"g": "none"}, True),
                                                ({"h": "freeze"}, True)])
async def test_serve_s_agent_puts_back_at_start_what_no_group_of_its_config_restores(tmp_path, children, groups,
                                                                                    thawed: bool) -> None:
    """`timeslice serve` names its groups (its orchestrator starts and stops with the agent):
    a record of a group now on another backend, or gone, is put back at start, although its
    backend is still offered (another group's); one its group restores is kept, stopped."""
    pid, records = await frozen_by_an_earlier_run(tmp_path, children)
    again = NodeAgent(StaticProcessResolver({"a": [pid]}), backends=["freeze", "none"], records_path=records,
                      groups=groups)
    await again.recover()
    assert (proc_state(pid) in "RS") == thawed and ("a" in again.records.jobs) != thawed


async def test_job_ids_leave_no_state_behind(tmp_path) -> None:
    """Issue 10, item 11: the agent kept a lock per distinct job id, also for calls that failed
    (ids over 253 characters are refused: the RPC table in the test above)."""
    import gc

    agent = NodeAgent(StaticProcessResolver(), backends=["freeze"])
    for i in range(200):
        await agent.checkpoint(StepRequest(JobRef(f"job-{i}-" + "x" * 200), "freeze", "g", 1))
    gc.collect()
    assert len(agent._job_locks) == 0


async def test_a_frozen_job_continued_by_someone_else_is_stopped_again_until_its_restore(children, tmp_path, short_tmp,
                                                                                        caplog) -> None:
    """A SIGSTOP is undone by anyone's SIGCONT (a shell's `fg` after Ctrl-Z): a helper's attack
    on `timeslice serve` had a holder frozen at its lapsed lease and then continued by its user
    compute 1.6 s beside the next holder. The agent stops it again (`FrozenWatch`), and leaves
    it running once its restore thawed it."""
    proc = spinner(children)
    agent = NodeAgent(StaticProcessResolver({"job-a": [proc.pid]}), backends=["freeze"],
                      records_path=tmp_path / "records.json")
    server, _ = await create_server(agent, f"unix://{short_tmp / 'agent.sock'}")
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp / 'agent.sock'}") as ch:
            stub = apb_grpc.NodeAgentStub(ch)
            await stub.Checkpoint(apb.SwitchStepRequest(job_id="job-a", backend="freeze", group_id="g"))
            assert proc_state(proc.pid) == "T"
            for _ in range(2):
                os.kill(proc.pid, signal.SIGCONT)
                assert proc.stdout.readline().strip().isdigit()  # it computes: continued
                await eventually(lambda: proc_state(proc.pid) == "T", what="the continued job stopped again")
            assert f"frozen job=job-a: processes [{proc.pid}] were continued by someone else" in caplog.text
            await stub.Restore(apb.SwitchStepRequest(job_id="job-a", backend="freeze"))
            await eventually(lambda: not agent.frozen_watch.watching, what="the watch ended with no job frozen")
            assert proc_state(proc.pid) in "RS"
    finally:
        await server.stop(0)


@pytest.mark.parametrize("damage", ["garbage", "directory"])
async def test_a_damaged_records_file_is_kept_aside_and_names_the_way_out(tmp_path, children, caplog,
                                                                          damage: str) -> None:
    """A tester's case: serve's `agent.json` damaged while a job was frozen: the agent ignored it
    and its next save overwrote it, so nothing said which processes stayed stopped (a directory
    in its place stopped serve with a bare `[Errno 21] Is a directory`). Now the agent starts,
    keeps the file aside and its error line says what to do."""
    path = tmp_path / "agent.json"
    if damage == "garbage":
        path.write_text('{"this is: not json')
    else:
        path.mkdir()
    agent = NodeAgent(StaticProcessResolver(), backends=["freeze"], records_path=path)
    await agent.recover()
    aside = list(tmp_path.glob("agent.json.damaged-*"))
    assert len(aside) == 1 and not path.exists(), list(tmp_path.iterdir())
    assert f"kept as {aside[0]}" in caplog.text and "`kill -CONT` a frozen one" in caplog.text
