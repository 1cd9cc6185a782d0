"""Waiters whose process stops answering (issue 10, item 6), with real servers and processes.

The orchestrator pings its clients (`grpc_server.SERVER_OPTIONS`, made quicker here): a
client that does not answer loses its connection and its blocked Acquire. A stopped
process of a job that is not checkpointed leaves the queue, so nobody is granted a lease
that no one will use; a job this group froze keeps its place, is thawed in its turn, and
its client's retry receives the grant.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server
from timeslice.driver import grpc_server
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server

from tests.conftest import eventually, python_child

QUICK_MS = 300


@pytest.fixture(autouse=True)
def quick_pings(monkeypatch) -> None:
    """The servers' own keep-alive settings, each made QUICK_MS (each must be there)."""
    options = dict(grpc_server.SERVER_OPTIONS)
    for key in ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms", "grpc.http2.min_time_between_pings_ms",
                "grpc.http2.ping_timeout_ms"):
        assert key in options
        options[key] = QUICK_MS
    monkeypatch.setattr(grpc_server, "SERVER_OPTIONS", list(options.items()))


def waiter(port: int, job: str) -> str:
    """A client of `job` that acquires when it reads a line, then prints the grant's epoch."""
    return f"""
        import sys
        from timeslice import TimeSliceOrchestratorClient
        c = TimeSliceOrchestratorClient("127.0.0.1:{port}", "{job}", "g")
        print("ready", flush=True)
        sys.stdin.readline()
        print("granted", c.acquire().epoch, flush=True)
    """


def state(pid: int) -> str:
    """The process state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def start(child) -> None:
    """Wait for the child's "ready", then tell it to acquire once it reads a line."""
    assert (await asyncio.to_thread(child.stdout.readline)).strip() == "ready"


def go(child) -> None:
    child.stdin.write("go\n")
    child.stdin.close()


async def test_a_stopped_waiter_of_a_job_not_checkpointed_leaves_the_queue(children) -> None:
    orch = Orchestrator([GroupSpec(id="g", lease_seconds=300)])
    server, port = await create_server(orch, "127.0.0.1:0")
    group = orch.group("g")
    try:
        holder = await group.acquire("a", 0, "a-1", timeout=None)
        child = python_child(waiter(port, "b"), stdin=-1)
        children.append(child)
        await start(child)
        go(child)
        await eventually(lambda: len(group.queue) == 1, timeout=30)
        os.kill(child.pid, signal.SIGSTOP)
        await eventually(lambda: len(group.queue) == 0, timeout=30)  # its connection went with the pings
        group.release("a", holder.lease_id, holder.epoch)
        assert group.holder is None  # nobody granted a lease for a stopped process
    finally:
        await server.stop(0)
        await orch.close()


async def test_a_waiter_frozen_by_its_group_keeps_its_place_and_receives_the_grant(short_tmp, children) -> None:
    """Backend freeze: the waiter's own process is frozen while it waits (its job was
    switched out). Before keeping such waiters, the pings would have dropped it from the
    queue, and a job nobody waits for is never thawed: frozen for good."""
    agent_target = f"unix://{short_tmp / 'agent.sock'}"
    resolver = StaticProcessResolver()
    agent_server, _ = await create_agent_server(NodeAgent(resolver, backends=["freeze"]), agent_target)
    orch = Orchestrator([GroupSpec(id="g", backend="freeze", agents=(agent_target,), lease_seconds=300)])
    server, port = await create_server(orch, "127.0.0.1:0")
    group = orch.group("g")
    try:
        child = python_child(waiter(port, "b"), stdin=-1)
        children.append(child)
        resolver.set("b", [child.pid])
        await start(child)
        grant = await group.acquire("b", 0, "b-0", timeout=None)  # b resident
        group.release("b", grant.lease_id, grant.epoch)
        holder = await group.acquire("a", 0, "a-1", timeout=None)  # b frozen for a
        assert state(child.pid) == "T" and "b" in group.residency.checkpointed
        os.kill(child.pid, signal.SIGCONT)  # b's process asks for the GPU while b is out ...
        go(child)
        await eventually(lambda: len(group.queue) == 1, timeout=30)
        os.kill(child.pid, signal.SIGSTOP)  # ... and is frozen while it waits, as its switch-out would have
        (w,) = list(group.queue)
        await eventually(lambda: w.callers == 0, timeout=30)  # its call was cancelled: the pings went unanswered
        assert [x.job_id for x in group.queue] == ["b"]  # kept
        group.release("a", holder.lease_id, holder.epoch)  # b's turn: thawed (freeze restore), granted
        line = (await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)).split()
        assert line[0] == "granted" and group.holder is not None and group.holder.job_id == "b"
        assert int(line[1]) == group.holder.epoch  # its retry received the grant made in its turn
    finally:
        await server.stop(0)
        await orch.close()
        await agent_server.stop(0)
