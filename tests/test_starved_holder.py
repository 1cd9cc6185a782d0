"""Waiting, not dying (issue 21, item 4), with a real orchestrator, real clients and real processes.

- A holder whose keep-alives are starved past its lease (its process stopped with SIGSTOP,
  as a process pinning tens of GB stalls its keep-alive thread) is never told to move its
  state mid-phase and never costs anyone an acquire: on `cooperative` it keeps the lock
  while its memory command stream is open; on a backend that stops processes it leaves the
  GPUs for the waiter and its late keep-alive queues it again under its lease.
- `acquire()` asks again after a failed switch, within its timeout; `JobFailed` (the job's
  state is lost) is raised once and not retried.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from timeslice import AcquireTimeout, JobFailed, SwitchFailed, TimeSliceOrchestratorClient
from timeslice.controller.orchestrator import cooperative_processes
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server
from timeslice.v1 import orchestrator_pb2 as pb

from tests.conftest import eventually

LEASE = 1.0  # seconds: short, so that a stopped holder lapses quickly

# A holder process: acquires group g as `job` inside `on_accelerators` (a lost lease raises
# LeaseLost at the end of the block), says "held <epoch>", releases when it reads a line,
# says "released", and exits when it reads another. With COOPERATIVE it first registers a
# state that prints each memory command it obeys.
HOLDER = """
import sys
from timeslice import TimeSliceOrchestratorClient

class Store:
    on_gpu = True
    def nbytes(self): return 4096
    def use_pool(self, pool): pass
    def checkpoint(self, ranges):
        print("checkpoint", flush=True)
        self.on_gpu = False
        return 4096, False
    def restore(self, ranges):
        if self.on_gpu:
            return 0
        print("restore", flush=True)
        self.on_gpu = True
        return 4096

client = TimeSliceOrchestratorClient(sys.argv[1], sys.argv[2], "g")
if sys.argv[3] == "cooperative":
    loop = client.serve_memory_commands(Store())
    assert loop.connected.wait(30)
with client.on_accelerators():
    print("held", client.holding().epoch, flush=True)
    sys.stdin.readline()
print("released", flush=True)
sys.stdin.readline()
client.close()
"""


class Holder:
    """A holder process (`HOLDER`) and what it printed."""

    def __init__(self, target: str, job: str, backend: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), target, job, backend],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []

    async def line(self) -> str:
        text = (await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 30)).strip()  # type: ignore
        self.lines.append(text)
        return text

    def tell(self) -> None:
        self.proc.stdin.write("go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    async def exit_status(self) -> tuple[int, str]:
        self.tell()
        _, err = await asyncio.to_thread(self.proc.communicate, timeout=30)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def holders() -> AsyncIterator[Callable[..., Holder]]:
    made: list[Holder] = []

    def make(target: str, job: str = "a", backend: str = "cuda") -> Holder:
        made.append(Holder(target, job, backend))
        return made[-1]

    yield make  # type: ignore[misc]
    for h in made:
        h.kill()


# -- transparent backends: a lapsed holder leaves the GPUs, and its late keep-alive queues it again --


async def test_a_stopped_holder_leaves_for_the_waiter_and_is_queued_again_by_its_late_keep_alive(
        make_cluster, holders) -> None:
    c = await make_cluster(backend="cuda", lease_seconds=LEASE)
    a = holders(c.target)
    assert await a.line() == "held 1"
    b = c.client("b", retry_failed_switches=False)  # a failed switch would raise here
    waiting = asyncio.create_task(b.acquire(timeout=60))
    await eventually(lambda: _waiters(c, "b"))
    a.stop()  # its keep-alives stop: the lease lapses while it is inside its phase
    grant_b = await asyncio.wait_for(waiting, 30)
    a_pids = tuple(c.resolvers["node-0"]._jobs["a"])
    assert ("node-0", "checkpoint", a_pids) in c.calls  # a left the GPUs before b was granted
    assert (await c.status()).lease_expiries == 1 and grant_b.epoch == 2
    a.cont()  # its keep-alive comes late: a is queued again under its lease
    await eventually(lambda: _waiters(c, "a"), timeout=20, what="a queued again")
    await b.release()
    await eventually(lambda: _holder(c, "a"), timeout=20, what="a granted again")
    assert ("node-0", "restore", a_pids) in c.calls  # back on the GPUs, invisibly to its code
    a.tell()  # a ends its phase: its release under its old lease is accepted (no LeaseLost)
    assert await a.line() == "released"
    code, err = await a.exit_status()
    assert code == 0, err
    status = await c.status()
    assert status.phase == "idle" and status.lease_expiries == 1
    await b.close()


async def test_a_holder_starved_past_its_lease_with_nobody_waiting_holds_on(make_cluster, holders) -> None:
    """Its late keep-alive finds it still on the GPUs: it holds again at once, nothing moves;
    a waiter that comes then is granted after its release."""
    c = await make_cluster(backend="cuda", lease_seconds=LEASE)
    a = holders(c.target)
    assert await a.line() == "held 1"
    a.stop()
    await eventually(lambda: _expiries(c, 1), timeout=20, what="the lease to lapse")
    a.cont()
    await eventually(lambda: _holder(c, "a"), timeout=20, what="a holding again")
    assert c.calls == []  # nothing was moved
    b = c.client("b", retry_failed_switches=False)
    waiting = asyncio.create_task(b.acquire(timeout=60))
    await eventually(lambda: _waiters(c, "b"))
    assert not waiting.done()
    a.tell()
    assert await a.line() == "released"
    await asyncio.wait_for(waiting, 30)
    code, err = await a.exit_status()
    assert code == 0, err
    await b.close()


# -- cooperative: a holder whose stream is open keeps the lock ----------------------------------


class Store:
    """A waiter's registered state (it is never moved in these tests while it holds)."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def nbytes(self) -> int:
        return 4096

    def use_pool(self, pool: object) -> None:
        pass

    def checkpoint(self, ranges: list[tuple[int, int]]) -> tuple[int, bool]:
        self.commands.append("checkpoint")
        return 4096, False

    def restore(self, ranges: list[tuple[int, int]]) -> int:
        self.commands.append("restore")
        return 0


@pytest.fixture
async def coop_target(short_tmp: Path) -> AsyncIterator[tuple[Orchestrator, str]]:
    agent_target = f"unix://{short_tmp / 'agent.sock'}"
    agent_server, _ = await create_agent_server(NodeAgent(StaticProcessResolver()), agent_target)
    orch = Orchestrator([GroupSpec(id="g", backend="cooperative", agents=(agent_target,), lease_seconds=LEASE,
                                   residency="exclusive")])
    server, port = await create_orchestrator_server(orch, "127.0.0.1:0")
    yield orch, f"127.0.0.1:{port}"
    await server.stop(0)
    await orch.close()
    await agent_server.stop(0)


async def waiter_b(target: str) -> TimeSliceOrchestratorClient:
    b = TimeSliceOrchestratorClient(target, "b", "g", retry_failed_switches=False)  # a failed switch raises
    loop = b.serve_memory_commands(Store())
    assert await asyncio.to_thread(loop.connected.wait, 30)
    return b


async def test_a_cooperative_holder_starved_past_its_lease_keeps_the_lock_while_its_stream_is_open(
        coop_target, holders, caplog) -> None:
    """On the H200 (issue 21): a 10 s lease lapsed inside a 3.5 s generate while its process
    pinned the pool; both waiters got SwitchFailed ("inside its GPU phase") and died, and the
    holder got LeaseLost."""
    caplog.set_level(logging.WARNING, "timeslice.orchestrator")
    orch, target = coop_target
    a = holders(target, backend="cooperative")
    assert await a.line() == "held 1"
    b = await waiter_b(target)
    try:
        waiting = asyncio.create_task(asyncio.to_thread(b.acquire, timeout=60))
        await eventually(lambda: orch.group("g").queue.head() is not None)
        a.stop()
        await eventually(lambda: "keeps the lock" in caplog.text, timeout=20, what="a's lease past its deadline")
        view = orch.group("g").view()
        assert view.holder is not None and view.holder.job_id == "a" and view.counters.lease_expiries == 0
        assert not waiting.done()
        a.cont()
        await eventually(lambda: orch.group("g").view().lease_remaining_seconds > 0, timeout=20,
                         what="a's keep-alives again")
        a.tell()  # a ends its phase and releases; only then is its state moved, and b granted
        assert await a.line() == "released"
        await asyncio.wait_for(waiting, 30)
        assert await a.line() == "checkpoint"  # after its release, never inside its phase
        assert a.lines == ["held 1", "released", "checkpoint"]
        code, err = await a.exit_status()
        assert code == 0, err
        assert orch.group("g").view().counters.lease_expiries == 0
        await asyncio.to_thread(b.release)
    finally:
        await asyncio.to_thread(b.close)


async def test_an_overdue_cooperative_holder_whose_stream_closes_lapses_at_once(coop_target, holders, caplog,
                                                                                 monkeypatch) -> None:
    """Killed while overdue: its stream closes, its lease lapses then (not at its next lease
    timer), and the waiter is granted without a failed switch."""
    monkeypatch.setattr(cooperative_processes, "RECONNECT_GRACE_SECONDS", 0.5)  # its memory is gone with it
    caplog.set_level(logging.WARNING, "timeslice.orchestrator")
    orch, target = coop_target
    a = holders(target, backend="cooperative")
    assert await a.line() == "held 1"
    b = await waiter_b(target)
    try:
        waiting = asyncio.create_task(asyncio.to_thread(b.acquire, timeout=60))
        await eventually(lambda: orch.group("g").queue.head() is not None)
        a.stop()
        await eventually(lambda: "keeps the lock" in caplog.text, timeout=20, what="a's lease past its deadline")
        a.proc.kill()  # kill -9: its command stream closes
        grant = await asyncio.wait_for(waiting, 30)
        assert grant.epoch == 2 and orch.group("g").view().counters.lease_expiries == 1
        await asyncio.to_thread(b.release)
    finally:
        await asyncio.to_thread(b.close)


# -- failed switches are asked again; a failed job is not ------------------------------------------


async def test_a_switch_that_fails_once_is_asked_again_and_the_acquire_succeeds(make_cluster, caplog) -> None:
    caplog.set_level(logging.WARNING, "timeslice.client")
    c = await make_cluster(backend="cuda")
    c.backends["node-0"].fail_once.add("checkpoint")  # the switch a -> b fails once, then works
    a, b = c.client("a"), c.client("b")
    await a.acquire()
    await a.release()
    grant = await asyncio.wait_for(b.acquire(timeout=60), 30)
    status = await c.status()
    assert status.holder.job_id == "b" and grant.epoch == 2
    assert status.failed_switches == 1 and status.switches == 1
    a_pids = tuple(c.resolvers["node-0"]._jobs["a"])
    assert [call for call in c.calls if call[1] == "checkpoint"] == [("node-0", "checkpoint", a_pids)] * 2
    said = [r.getMessage() for r in caplog.records if r.name == "timeslice.client"]
    assert len(said) == 2, said  # the reason once, then the grant
    assert re.fullmatch(r"acquire g: ABORTED: group g: checkpoint of a failed \(.*injected checkpoint failure on "
                        r"node-0\); rolled back; asking again until the acquire's timeout \(logged once per "
                        r"acquire\)", said[0]), said[0]
    assert said[1] == "acquire g: granted after 1 failed switch(es)"
    await b.release()
    for client in (a, b):
        await client.close()


async def test_a_switch_that_keeps_failing_times_out_naming_it(make_cluster, caplog) -> None:
    caplog.set_level(logging.WARNING, "timeslice.client")
    c = await make_cluster(backend="cuda")
    c.backends["node-0"].fail.add("checkpoint")
    a, b = c.client("a"), c.client("b")
    await a.acquire()
    await a.release()
    with pytest.raises(AcquireTimeout, match=r"switch\(es\) to this job failed meanwhile; the last: .*injected "
                                             "checkpoint failure") as err:
        await b.acquire(timeout=2.0)
    assert isinstance(err.value.__cause__, SwitchFailed)
    assert sum("asking again" in r.getMessage() for r in caplog.records) == 1  # once, not per try
    status = await c.status()
    assert status.failed_switches >= 2 and status.resident_job_id == "a" and not status.waiters
    assert not (await a.acquire(timeout=10)).restored  # a never left
    await a.release()
    for client in (a, b):
        await client.close()


async def test_a_job_whose_restore_keeps_failing_gets_job_failed_once_and_it_is_not_retried(make_cluster) -> None:
    from timeslice.controller.orchestrator.switch_outcome import MAX_RESTORE_FAILURES, RESTORE_FAILURE_SECONDS

    c = await make_cluster(backend="cuda")
    a, b = c.client("a"), c.client("b")
    await a.acquire()
    await a.release()
    await b.acquire()  # a checkpointed for b
    await b.release()
    a_pid = c.resolvers["node-0"]._jobs["a"][0]
    c.backends["node-0"].fail.add(f"restore:{a_pid}")  # a's checkpoint cannot come back

    def restores() -> int:
        return sum(1 for _, step, pids in c.calls if step == "restore" and pids[0] == a_pid)

    with pytest.raises(JobFailed, match=r"job a failed: \d+ restores in a row failed over \d+\.\d s") as err:
        await asyncio.wait_for(a.acquire(timeout=120), 60)  # (its client asked again, backing off, for ~13 s)
    tries = restores()
    assert tries >= MAX_RESTORE_FAILURES and f"{tries} restores in a row" in str(err.value)
    assert float(str(err.value).split(" over ")[1].split(" s")[0]) >= RESTORE_FAILURE_SECONDS
    with pytest.raises(JobFailed):  # refused at once, nothing attempted, not retried
        await a.acquire(timeout=120)
    assert restores() == tries
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the wire: ABORTED with the reason in the trailing metadata
        await c.stub.Acquire(pb.AcquireRequest(job_id="a", group_id="g", request_id="raw"))
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert ("timeslice-error-reason", pb.ErrorReason.Name(pb.JOB_FAILED)) in tuple(err.value.trailing_metadata())
    grant = await b.acquire(timeout=30)  # the group serves the others
    assert not grant.restored
    await b.release()
    for client in (a, b):
        await client.close()


async def test_the_sync_client_asks_again_after_a_failed_switch(make_cluster) -> None:
    """The same retry in the synchronous client (the one `on_accelerators` and the
    integrations use), from a thread that waits while the event loop serves."""
    c = await make_cluster(backend="cuda")
    c.backends["node-0"].fail_once.add("checkpoint")
    a = c.client("a")
    await a.acquire()
    b = TimeSliceOrchestratorClient(c.target, "b", "g")
    entered = threading.Event()

    def phase() -> int:
        with b.on_accelerators(timeout=60):
            entered.set()
            return b.holding().epoch  # type: ignore[union-attr]

    task = asyncio.create_task(asyncio.to_thread(phase))
    await eventually(lambda: _waiters(c, "b"))
    await a.release()
    assert await asyncio.wait_for(task, 30) == 2 and entered.is_set()
    assert (await c.status()).failed_switches == 1
    await asyncio.to_thread(b.close)
    await a.close()


async def _waiters(c, job: str) -> bool:
    return job in [w.job_id for w in (await c.status()).waiters]


async def _holder(c, job: str) -> bool:
    return (await c.status()).holder.job_id == job


async def _expiries(c, n: int) -> bool:
    return (await c.status()).lease_expiries == n


# A job's process: holds, keeps its part alive at least once ("kept"), then waits to be killed.
KEPT_THEN_KILLED = textwrap.dedent("""
    import signal, sys, time
    from timeslice import TimeSliceOrchestratorClient
    c = TimeSliceOrchestratorClient(sys.argv[1], "a", "g")
    grant = c.acquire(timeout=30)
    time.sleep(grant.lease_seconds)  # (keep-alives every third of it)
    print("kept", flush=True)
    signal.pause()
""")
# The job's next process, started at once under the same name: short phases for a long while.
PHASES = textwrap.dedent("""
    import sys, time
    from timeslice import TimeSliceOrchestratorClient
    c = TimeSliceOrchestratorClient(sys.argv[1], "a", "g")
    for _ in range(600):
        c.acquire(timeout=120)
        time.sleep(0.05)
        c.release()
    print("done", flush=True)
""")
B_ONCE = textwrap.dedent("""
    import sys
    from timeslice import TimeSliceOrchestratorClient
    c = TimeSliceOrchestratorClient(sys.argv[1], "b", "g")
    c.acquire(timeout=60)
    print("granted", flush=True)
    c.release()
""")


async def test_a_job_started_again_at_once_does_not_keep_its_killed_process_part_and_starve_the_others() -> None:
    """A helper's attack on a standalone node: a holding job killed and started again at once
    under its name joined the hold its killed process still had a part of; every release left
    that part, every join renewed the job's lease, and the waiting job got nothing until the
    new process ended. A part whose caller kept it alive and then stopped for the lease's length
    ends now (`Callers.prune_parts`): B is granted while A's new process still runs its phases."""
    orch = Orchestrator([GroupSpec(id="g", backend="none", lease_seconds=2)])
    server, port = await create_orchestrator_server(orch, "127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen[str]] = []

    def start(code: str) -> subprocess.Popen[str]:
        procs.append(subprocess.Popen([sys.executable, "-c", code, target], stdout=subprocess.PIPE, text=True))
        return procs[-1]

    async def line(p: subprocess.Popen[str], seconds: float) -> str:
        assert p.stdout is not None
        return (await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), seconds)).strip()

    try:
        first = start(KEPT_THEN_KILLED)
        assert await line(first, 60) == "kept"
        b = start(B_ONCE)
        await eventually(lambda: any(w.job_id == "b" for w in orch.group("g").queue), timeout=30, what="b waiting")
        first.kill()
        first.wait()
        again = start(PHASES)
        assert await line(b, 60) == "granted"
        assert again.poll() is None, "B was granted only once A's new process had ended"
        assert await line(again, 180) == "done"
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        await server.stop(0)
        await orch.close()
