"""Fixtures: real gRPC servers on loopback / unix sockets, real child processes.

Fakes sit only at seams: `FakeBackend` implements the node agent's `Backend`
interface and records calls, so switch tests can fail any step on purpose; the kubelet
plugin's fakes and its `serve_plugin` fixture live in `kubelet_fakes.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
import pytest
from timeslice import AsyncTimeSliceOrchestratorClient
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server
from timeslice.driver.errors import BackendError
from timeslice.kubelet_plugin.agent.backends.base import CHECKPOINTED, RUNNING, Backend, ProcState
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

from tests.fake_apiserver import FakeApiServer
from tests.kubelet_fakes import serve_plugin  # noqa: F401  (fixture: a kubelet plugin on temp sockets)

# The `vmm` backend's pinned pool on these GPU-less nodes (node agents of this process and of those it
# starts): 64 MiB holds several fake jobs' states (tests/test_vmm.py) where the default would be 1 GB
# per agent, populated by the first shim that registers it.
os.environ.setdefault("TIMESLICE_VMM_POOL_BYTES", str(64 << 20))
# Default state dirs (`timeslice serve`, `timeslice orchestrator`'s state file) of this process and of
# those it starts: a folder of this run's, never the machine's /var/lib/timeslice or the user's own.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="timeslice-test-state-")


@dataclass
class FakeBackend(Backend):
    """Records (node, step, pids); fails a step when `fail` names it: "checkpoint", "restore",
    or "<step>:<pid>" for one job's step only; `fail_once` likewise, once for each name."""

    node: str
    calls: list[tuple[str, str, tuple[int, ...]]]
    name: str = "cuda"
    fail: set[str] = field(default_factory=set)
    delay: float = 0.0
    fail_once: set[str] = field(default_factory=set)
    started: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # steps begun (before `delay`)
    # "<step>:<pid>" -> an event that step waits for (a backend call that hangs until it is set)
    hang: dict[str, asyncio.Event] = field(default_factory=dict)

    async def _step(self, what: str, pids: Sequence[int], state: str) -> list[ProcState]:
        self.started.append((what, tuple(pids)))
        await asyncio.sleep(self.delay)
        gate = self.hang.get(f"{what}:{pids[0]}")
        if gate is not None:
            await gate.wait()
        self.calls.append((self.node, what, tuple(pids)))
        once = {what, f"{what}:{pids[0]}"} & self.fail_once
        self.fail_once -= once
        if once or what in self.fail or f"{what}:{pids[0]}" in self.fail:
            raise BackendError(f"injected {what} failure on {self.node}")
        return [ProcState(p, state, 1000) for p in pids]

    async def checkpoint(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return await self._step("checkpoint", pids, CHECKPOINTED)

    async def restore(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return await self._step("restore", pids, RUNNING)

    async def state(self, pids: Sequence[int]) -> list[ProcState]:
        return [ProcState(p, RUNNING) for p in pids]


@dataclass
class Cluster:
    """An orchestrator server and node-agent servers, all real, in this event loop."""

    orchestrator: Orchestrator
    target: str
    stub: pb_grpc.OrchestratorStub
    agents: dict[str, NodeAgent]
    resolvers: dict[str, StaticProcessResolver]
    backends: dict[str, FakeBackend]
    calls: list[tuple[str, str, tuple[int, ...]]]

    def client(self, job: str, group: str = "g", **kw: object) -> AsyncTimeSliceOrchestratorClient:
        return AsyncTimeSliceOrchestratorClient(self.target, job, group, **kw)  # type: ignore[arg-type]

    async def status(self, group: str = "g") -> pb.GroupStatus:
        return await self.stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id=group))


def _reap(p: subprocess.Popen[bytes]) -> None:
    p.kill()
    p.wait()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path: unix socket paths must stay under 108 bytes,
    and pytest's tmp_path grows with the run counter and the test name."""
    path = Path(tempfile.mkdtemp(prefix="ts-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def make_cluster(short_tmp: Path) -> AsyncIterator[Callable[..., object]]:
    """`await make_cluster(backend="cuda", nodes=1, lease_seconds=10, jobs={job: pids}, memory_probe=...)`
    (`memory_probe`: the agents' NVML stand-in, `NodeAgent(memory_probe=...)`; `spec`: more
    `GroupSpec` fields, e.g. `{"apps": {...}}`)."""
    closers: list[Callable[[], object]] = []

    async def make(backend: str = "none", nodes: int = 1, lease_seconds: float = 10.0,
                   jobs: dict[str, list[int]] | None = None, groups: Sequence[str] = ("g",),
                   real_backend: bool = False, memory_probe: Callable[[], list] | None = None,
                   spec: dict[str, object] | None = None) -> Cluster:
        calls: list[tuple[str, str, tuple[int, ...]]] = []
        agents, resolvers, fakes, targets = {}, {}, {}, []
        if backend != "none":
            for i in range(nodes):
                node = f"node-{i}"
                if jobs is None:  # one real sleeping process per job and node
                    sleepers = {j: subprocess.Popen(["sleep", "600"]) for j in ("a", "b", "c")}  # noqa: ASYNC220
                    closers.extend(functools.partial(_reap, p) for p in sleepers.values())
                    pids = {j: [p.pid] for j, p in sleepers.items()}
                resolvers[node] = StaticProcessResolver(jobs or pids)
                fakes[node] = FakeBackend(node, calls, name=backend)
                agents[node] = NodeAgent(resolvers[node], backends=[backend if real_backend else fakes[node]],
                                         **({"memory_probe": memory_probe} if memory_probe else {}))
                target = f"unix://{short_tmp / (node + '.sock')}"
                server, _ = await create_agent_server(agents[node], target)
                closers.append(lambda s=server: s.stop(0))
                targets.append(target)
        orch = Orchestrator([GroupSpec(id=g, backend=backend, agents=tuple(targets), lease_seconds=lease_seconds,
                                       **(spec or {}))  # type: ignore[arg-type]
                             for g in groups])
        server, port = await create_orchestrator_server(orch, "127.0.0.1:0")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        closers.extend([lambda: server.stop(0), orch.close, channel.close])
        return Cluster(orch, f"127.0.0.1:{port}", pb_grpc.OrchestratorStub(channel), agents, resolvers, fakes,
                       calls)

    yield make
    for close in reversed(closers):
        with contextlib.suppress(Exception):
            result = close()
            if asyncio.iscoroutine(result):
                await result


@pytest.fixture
async def token_api() -> AsyncIterator[tuple[FakeApiServer, object]]:
    """(fake API server answering TokenReviews, a real kubernetes.aio AuthenticationV1Api on it)."""
    from kubernetes.aio import client as k8s

    server = FakeApiServer()
    await server.start()
    api = k8s.ApiClient(k8s.Configuration(host=server.url))
    yield server, k8s.AuthenticationV1Api(api)
    await api.close()
    await server.stop()


async def eventually(check: Callable[[], object], timeout: float = 5.0, interval: float = 0.01,
                     what: str = "condition") -> None:
    """Wait until `check()` is truthy (an async check is awaited); fail after `timeout` s,
    naming `what` waited for."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        await asyncio.sleep(interval)


def python_child(code: str, **kw: object) -> subprocess.Popen[str]:
    """Start `python -c code` (dedented) with stdout piped as text."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                            **kw)  # type: ignore[call-overload]


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Child processes to kill at teardown (SIGCONT first, in case a test froze them)."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(18)  # SIGCONT
            p.kill()
        p.wait()
        if p.stdout:
            p.stdout.close()


@pytest.fixture
async def target() -> AsyncIterator[str]:
    """A real orchestrator server with one static group `g` (backend none): its address."""
    orch = Orchestrator([GroupSpec(id="g", backend="none")])
    server, port = await create_orchestrator_server(orch, "127.0.0.1:0")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
        await orch.close()
