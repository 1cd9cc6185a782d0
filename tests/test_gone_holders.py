"""Holders whose processes are gone (controller/orchestrator/gone_holders.py): what a node agent
answers about a job's processes (`GetLiveJobs`), with real processes, and the rule that drops a
holder. The whole path through `timeslice node-agent` + `timeslice orchestrator`:
tests/test_node_agent_cli.py; through `timeslice serve`: tests/test_serve_faults.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from timeslice.controller.orchestrator.gone_holders import gone
from timeslice.kubelet_plugin.agent.host_processes import EnvironProcessResolver
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.steps import JobRef


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


def sleeper(job: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_JOB"}
    if job is not None:
        env["TIMESLICE_JOB"] = job
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)


async def test_a_standalone_agent_tells_a_job_gone_only_once_it_saw_a_named_process_of_it_end() -> None:
    """A job's processes on a standalone node are those TIMESLICE_JOB names (any of them, a GPU
    context or not): live while one runs; gone once this agent saw one and none is left; a job
    never seen here, or named by claims (a cluster's pods, not looked at), is neither."""
    agent = NodeAgent(EnvironProcessResolver(), backends=["none"])
    jobs = [JobRef("train"), JobRef("never"), JobRef("pod-job", claims=[("ns", "claim")])]
    first, second, unnamed = sleeper("train"), sleeper("train"), sleeper(None)
    try:
        assert await agent.live_jobs(jobs) == (["train"], [])
        first.kill()
        first.wait()
        assert await agent.live_jobs(jobs) == (["train"], [])  # its second process lives
        second.kill()
        second.wait()
        assert await agent.live_jobs(jobs) == ([], ["train"])
        fresh = NodeAgent(EnvironProcessResolver(), backends=["none"])
        assert await fresh.live_jobs(jobs) == ([], [])  # (never saw it)
    finally:
        for p in (first, second, unnamed):
            p.kill()
            p.wait()


async def test_a_job_whose_pids_were_told_is_gone_once_they_all_ended() -> None:
    worker = sleeper(None)
    resolver = StaticProcessResolver({"told": [worker.pid]})
    agent = NodeAgent(resolver, backends=["none"])
    try:
        assert await agent.live_jobs([JobRef("told"), JobRef("untold")]) == (["told"], [])
    finally:
        worker.kill()
        worker.wait()
    assert await NodeAgent(resolver, backends=["none"]).live_jobs([JobRef("told")]) == ([], ["told"])
