"""Leader election when the leader's API server connection hangs (issue 24, item 1).

Two `timeslice controller --leader-election` processes, each reaching tests/fake_apiserver.py
through a TCP proxy of its own. The leader's proxy is made a black hole: it accepts and reads
but forwards nothing, either way (a partition its TCP connections do not notice). The leader
must stop serving before its Lease can lapse, so before the standby takes it: never two
replicas serving. Before, its Lease calls waited for the client's default of 300 s, the
library's renew deadline was never checked, and both served (measured: 21.5 of 30 s)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from tests.cluster_objects import World
from tests.conftest import eventually
from tests.fake_apiserver import FakeApiServer

LEASE, RENEW, RETRY = 6, 3.0, 1.0  # seconds: --lease-duration, --renew-deadline, --retry-period
DEADLINE = 60.0  # seconds any one step may take on a loaded machine


class Proxy:
    """A TCP proxy on 127.0.0.1 to `port`; after `hang()` nothing more is forwarded, either
    way, on old or new connections, and none is closed (until `stop()`)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def hang(self) -> None:
        self._flowing.clear()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        self._writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._port)
        self._writers.append(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                await self._flowing.wait()
                dst.write(data)
                await dst.drain()
        dst.close()


class Replica:
    """One `timeslice controller --leader-election` process; its log lines in `lines`."""

    def __init__(self, name: str, proxy: Proxy, tmp: Path) -> None:
        self.name, self.proxy, self.tmp = name, proxy, tmp
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        kubeconfig = self.tmp / f"kubeconfig-{self.name}"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.proxy.url}}],
            "users": [{"name": "fake", "user": {"token": "controller"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env.update(KUBECONFIG=str(kubeconfig), POD_NAME=self.name, POD_NAMESPACE="timeslice-system")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "timeslice.cli.main", "controller", "--leader-election",
            "--lease-duration", str(LEASE), "--renew-deadline", str(RENEW), "--retry-period", str(RETRY),
            "--listen", f"unix://{self.tmp / (self.name + '.sock')}", "--default-backend", "none",
            env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.lines.append(line.decode(errors="replace").rstrip())

    def at(self, text: str) -> datetime.datetime | None:
        """When the first log line containing `text` was written (its timestamp), or None."""
        line = next((x for x in self.lines if text in x), None)
        return None if line is None else datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    def serving(self) -> bool:
        return self.at("controller serving") is not None

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            await self._reader  # the pipe ends with the process


async def waited(check: object, what: str, *shown: Replica) -> None:
    """`eventually(check)`, failing with the replicas' last log lines."""
    try:
        await eventually(check, timeout=DEADLINE, what=what)  # type: ignore[arg-type]
    except AssertionError as err:
        raise AssertionError(f"{err}; " + "; ".join(f"{r.name}: {r.lines[-12:]}" for r in shown)) from None


@pytest.fixture
async def replicas(short_tmp: Path) -> AsyncIterator[tuple[FakeApiServer, list[Replica]]]:
    server, w = FakeApiServer(), World()
    w.node("node-a", gpus=1)
    for obj in w.slices:
        server.put(obj)
    await server.start()
    proxies = [Proxy(server.port) for _ in range(2)]
    for p in proxies:
        await p.start()
    started = [Replica(name, p, short_tmp) for name, p in zip(("a", "b"), proxies)]
    try:
        yield server, started
    finally:
        for r in started:
            await r.stop()
        for p in proxies:
            await p.stop()
        await server.stop()


async def test_a_leader_cut_off_from_the_api_server_stops_serving_before_the_standby_serves(replicas) -> None:
    server, (a, b) = replicas
    await a.start()
    await waited(a.serving, "a leading and serving", a)
    await b.start()
    await waited(lambda: any("waiting for leadership" in x for x in b.lines), "b standing by", b)
    lease = server.leases[("timeslice-system", "timeslice-controller")]
    assert lease["spec"]["holderIdentity"] == "a"
    a.proxy.hang()
    await waited(b.serving, "b taking over", a, b)
    stopped, took_over = a.at("controller stops serving"), b.at("controller serving")
    assert stopped is not None, f"a never stopped serving: {a.lines[-10:]}"
    assert took_over is not None and stopped < took_over, (stopped, took_over, a.lines[-8:], b.lines[-8:])
    assert any("Lease not renewed" in x for x in a.lines)
    assert a.proc is not None and await asyncio.wait_for(a.proc.wait(), DEADLINE) is not None  # it exited
    assert server.leases[("timeslice-system", "timeslice-controller")]["spec"]["holderIdentity"] == "b"
