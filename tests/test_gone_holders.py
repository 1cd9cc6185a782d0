"""Holders whose processes are gone (controller/orchestrator/gone_holders.py): what a node agent
answers about a job's processes (`GetLiveJobs`), with real processes, and the rule that drops a
holder. The whole path through `timeslice node-agent` + `timeslice orchestrator`:
tests/test_node_agent_cli.py; through `timeslice serve`: tests/test_serve_faults.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.gone_holders import GoneHolders, drop_gone, gone
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.group_model import GroupEvent, Hold, SwitchRecord
from timeslice.driver.app_engine import AppEngine
from timeslice.kubelet_plugin.agent.host_processes import EnvironProcessResolver
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.steps import JobRef

from tests.conftest import eventually


@pytest.mark.parametrize(("answers", "want"), [
    ([(set(), {"a"})], True),
    ([(set(), {"a"}), (set(), set())], True),  # another node never had it
    ([(set(), {"a"}), ({"a"}, set())], False),  # a process of it lives on another node
    ([(set(), {"a"}), None], False),  # an agent that did not answer
    ([(set(), set())], False),  # never seen anywhere: its lease decides
    ([({"a"}, set())], False),
    ([], False),
])
def test_a_holder_is_gone_once_every_agent_answered_none_has_it_live_and_one_had_it(answers, want) -> None:
    assert gone("a", answers) is want


@pytest.mark.parametrize(("answers", "want"), [
    ([(set(), set(), {"a"})], True),
    ([(set(), {"a"}, set()), (set(), set(), {"a"})], True),  # its engine runs on another node
    ([(set(), set(), {"a"}), ({"a"}, set(), set())], False),  # a client of it lives on another node
    ([(set(), set(), {"a"}), None], False),
])
def test_a_holder_is_clientless_once_every_agent_answered_none_has_it_live_and_one_has_only_its_engine(
        answers, want) -> None:
    assert gone("a", answers, 2) is want


# A stand-in inference engine: listens on a loopback port, with a worker process of its own;
# prints "<port> <worker pid>".
ENGINE = ("import socket, signal, subprocess, sys\n"
          "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
          "w = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
          "print(s.getsockname()[1], w.pid, flush=True)\n"
          "signal.pause()\n")


async def test_a_job_whose_live_processes_all_serve_its_engine_is_clientless_once_its_client_was_seen(
        tmp_path: Path) -> None:
    """Backend app: job a's client is a process of its own beside its engine (which listens on
    the engine's port, with a worker); once the client is killed, a is clientless, neither
    live nor gone, also to an agent started again (a helper's attack: a client killed while
    the agent restarted left a holder reported live for good, 13 of 13). A job whose client is
    its engine's own process (`inproc`) is never so, and a job looked at without its engine is
    live while any process of it runs."""
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    client = sleeper(None)
    try:
        port, worker = map(int, engine.stdout.readline().split())  # type: ignore[union-attr]
        app = AppEngine(engine="vllm", url=f"http://127.0.0.1:{port}")
        told = {"a": [engine.pid, worker, client.pid], "inproc": [engine.pid, worker]}
        records = tmp_path / "agent.json"
        agent = NodeAgent(StaticProcessResolver(told), backends=["none"], records_path=records)
        jobs, engines = [JobRef("a"), JobRef("inproc")], {"a": app, "inproc": app}
        assert await agent.live_jobs(jobs, engines) == (["a", "inproc"], [], [])
        client.kill()
        client.wait()
        assert await agent.live_jobs(jobs, engines) == (["inproc"], [], ["a"])
        assert await agent.live_jobs(jobs) == (["a", "inproc"], [], [])
        again = NodeAgent(StaticProcessResolver(told), backends=["none"], records_path=records)
        assert await again.live_jobs(jobs, engines) == (["inproc"], [], ["a"])
    finally:
        for p in (engine, client):
            p.kill()
            p.wait()
        engine.stdout.close()  # type: ignore[union-attr]
        os.kill(worker, 9)


LATE_ENGINE = ("import signal, socket, sys\n"
               "s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1], flush=True)\n"
               "sys.stdin.readline(); s.listen(); print('listening', flush=True)\n"
               "signal.pause()\n")


async def test_a_job_whose_engine_is_its_client_and_listened_only_later_is_never_clientless() -> None:
    """A review's finding: an in-process engine seen before it listened (its first hold ran
    first) was taken for a client, and once it listened, for an engine whose client was gone:
    its job, alive, was dropped. A client seen is gone only once no process seen as one is left."""
    proc = subprocess.Popen([sys.executable, "-c", LATE_ENGINE], stdin=subprocess.PIPE,  # noqa: ASYNC220
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=["none"])
        jobs, engines = [JobRef("a")], {"a": AppEngine(engine="vllm", url=f"http://127.0.0.1:{port}")}
        assert await agent.live_jobs(jobs, engines) == (["a"], [], [])  # (not listening: its client)
        proc.stdin.write("listen\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert proc.stdout.readline() == "listening\n"  # type: ignore[union-attr]
        assert await agent.live_jobs(jobs, engines) == (["a"], [], [])
    finally:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            f.close()  # type: ignore[union-attr]


def sleeper(job: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_JOB"}
    if job is not None:
        env["TIMESLICE_JOB"] = job
    return subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], env=env)  # (until killed)


async def test_a_standalone_agent_tells_a_job_gone_only_once_it_saw_a_named_process_of_it_end() -> None:
    """A job's processes on a standalone node are those TIMESLICE_JOB names (any of them, a GPU
    context or not): live while one runs; gone once this agent saw one and none is left; a job
    never seen here, or named by claims (a cluster's pods, not looked at), is neither."""
    agent = NodeAgent(EnvironProcessResolver(), backends=["none"])
    jobs = [JobRef("train"), JobRef("never"), JobRef("pod-job", claims=[("ns", "claim")])]
    first, second, unnamed = sleeper("train"), sleeper("train"), sleeper(None)
    try:
        assert await agent.live_jobs(jobs) == (["train"], [], [])
        first.kill()
        first.wait()
        assert await agent.live_jobs(jobs) == (["train"], [], [])  # its second process lives
        second.kill()
        second.wait()
        assert await agent.live_jobs(jobs) == ([], ["train"], [])
        fresh = NodeAgent(EnvironProcessResolver(), backends=["none"])
        assert await fresh.live_jobs(jobs) == ([], [], [])  # (never saw it)
    finally:
        for p in (first, second, unnamed):
            p.kill()
            p.wait()


async def test_a_job_whose_pids_were_told_is_gone_once_they_all_ended() -> None:
    worker = sleeper(None)
    resolver = StaticProcessResolver({"told": [worker.pid]})
    agent = NodeAgent(resolver, backends=["none"])
    try:
        assert await agent.live_jobs([JobRef("told"), JobRef("untold")]) == (["told"], [], [])
    finally:
        worker.kill()
        worker.wait()
    assert await NodeAgent(resolver, backends=["none"]).live_jobs([JobRef("told")]) == ([], ["told"], [])


async def test_a_grant_wakes_the_watch_before_its_period() -> None:
    """A holder killed at once after its grant is gone only if an agent saw it: the watch looks
    at each grant, not only every `CHECK_SECONDS`."""
    asked: list[list[str]] = []

    class Agent:
        async def live_jobs(self, jobs):
            asked.append([j for j, _, _ in jobs])
            return {j for j, _, _ in jobs}, set(), set()

    group = LockGroup(GroupSpec(id="g", agents=("unix:///agent.sock",)), switcher=None)  # type: ignore[arg-type]
    group.holder = Hold("x", "lease", 1, 0.0, 10.0, {"r"}, False, 0.0)
    holders = GoneHolders(lambda: [group], lambda _: Agent(), every=3600)
    watch = asyncio.get_running_loop().create_task(holders.watch())
    try:
        await eventually(lambda: asked == [["x"]], timeout=30, what="the first round")  # (then it waits an hour)
        group.holder = Hold("a", "lease", 2, 0.0, 10.0, {"r"}, False, 0.0)
        holders.observe(group, GroupEvent("granted", "g", "a", 2))
        await eventually(lambda: ["a"] in asked, timeout=30, what="a look at the grant")
    finally:
        watch.cancel()


async def test_a_grant_looks_at_the_groups_granted_not_at_every_group() -> None:
    """The look at a grant asks about the groups granted since the last look; every group is
    asked about only each period (a round over every group at each grant cost 22% of an
    orchestrator's CPU at 1000 groups)."""
    asked: list[list[str]] = []

    class Agent:
        async def live_jobs(self, jobs):
            asked.append(sorted(j for j, _, _ in jobs))
            return {j for j, _, _ in jobs}, set(), set()

    groups = [LockGroup(GroupSpec(id=g, agents=("unix:///agent.sock",)), switcher=None)  # type: ignore[arg-type]
              for g in ("g1", "g2", "g3")]
    for i, group in enumerate(groups):
        group.holder = Hold(f"x{i}", "lease", 1, 0.0, 10.0, {"r"}, False, 0.0)
    holders = GoneHolders(lambda: groups, lambda _: Agent(), every=3600)
    watch = asyncio.get_running_loop().create_task(holders.watch())
    try:
        await eventually(lambda: asked == [["x0", "x1", "x2"]], timeout=30, what="the first round, of every group")
        groups[1].holder = Hold("b", "lease", 2, 0.0, 10.0, {"r"}, False, 0.0)
        holders.observe(groups[1], GroupEvent("granted", "g2", "b", 2))
        await eventually(lambda: len(asked) == 2, timeout=30, what="a look at the grant")
        assert asked[1] == ["b"]
    finally:
        watch.cancel()


class ClientlessAgent:
    """An agent that answers every job clientless (its engine's processes alone are left)."""

    async def live_jobs(self, jobs):  # type: ignore[no-untyped-def]
        return set(), set(), {j for j, _, _ in jobs}


def clientless_app_group(now: list[float]) -> LockGroup:
    """Group g on `app` (job a's engine named, a 10 s lease) on the clock `now[0]`."""
    async def switcher(spec, evict, incoming, restore):  # type: ignore[no-untyped-def]
        return SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict))

    return LockGroup(GroupSpec(id="g", backend="app", agents=("unix:///agent.sock",), lease_seconds=10,
                               apps={"a": AppEngine(engine="vllm", url="http://127.0.0.1:1")}),
                     switcher, clock=lambda: now[0])


async def test_a_clientless_holder_is_dropped_only_once_no_keep_alive_came_for_half_its_lease() -> None:
    """An agent cannot always tell a client from its engine (an in-process engine that listened
    only after its first hold looked like a client that later died: a review's finding). A
    client that renews is alive whatever /proc says: a clientless holder is dropped only once
    no keep-alive came for half its lease."""
    now = [0.0]
    group = clientless_app_group(now)
    group.holder = Hold("a", "lease", 1, 0.0, 10.0, {"r"}, False, 0.0)
    try:
        now[0] = 4.9  # its grant (or last keep-alive) 4.9 s ago, of a 10 s lease
        assert await drop_gone([group], lambda _: ClientlessAgent()) == [] and group.holder is not None
        now[0] = 5.0
        assert await drop_gone([group], lambda _: ClientlessAgent()) == [("g", "a")]
        assert group.holder is None
    finally:
        await group.close()


async def test_a_clientless_unreleased_job_is_dropped_only_once_no_client_of_it_called_for_half_a_lease() -> None:
    """An `app` job whose hold ended unreleased (its lease revoked, its engine kept awake for its
    client) and that its agents report clientless is dropped, its engine kept, once no client of
    it called for half a lease: a client whose lease was lost goes on saying that it lives
    (`KeepAliveRequest.lost`), and one the agent took for the engine's (a review's finding) keeps
    its engine awake for as long as it does."""
    now = [0.0]
    group = clientless_app_group(now)
    group.residency.held("a")
    group.awake.lapsed("a", None, "its lease was revoked")
    try:
        assert group.awake.unreleased() == ["a"]
        now[0] = 4.0
        assert group.keep_alive("a", "lost-lease", 1, lost=True) == 0.0  # its client lives
        now[0] = 8.9
        assert await drop_gone([group], lambda _: ClientlessAgent()) == [] and group.awake.unreleased() == ["a"]
        now[0] = 9.0
        assert await drop_gone([group], lambda _: ClientlessAgent()) == [("g", "a")]
        assert group.awake.unreleased() == []
    finally:
        await group.close()
