"""Fakes at the kubelet plugin's seams, and a fixture that serves a real plugin on temp sockets.

`FakeClaimPlugin` implements `ClaimPlugin` (the seam behind the gRPC adapter) and
records its calls; tests talk to the real servers through our generated stubs,
the way kubelet does (`unix:<path>`, insecure).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc.aio
import pytest
from timeslice.kubelet_plugin.health import HealthSource
from timeslice.kubelet_plugin.plugin import ClaimRef, PreparedDevice, PrepareResult
from timeslice.kubelet_plugin.plugin_server import PluginServerConfig, PluginServers, create_servers

POOL = "node-a"


def device_for(uid: str, n: int = 0, share_id: str | None = None) -> PreparedDevice:
    return PreparedDevice(["gpu"], POOL, f"gpu-{n}-seat-0", [f"k8s.gpu.timeslice.dev/claim={uid}-gpu-{n}"], share_id)


@dataclass
class FakeClaimPlugin:
    """Answers every claim with `devices[uid]` (default: one device) unless told otherwise:
    `errors[uid]` fails that claim, `omit` leaves UIDs out, `extra` adds answers nobody asked
    for, `exc` raises from the call. `calls` records (op, claims); `delay` holds each call;
    `hold_until_running`: each call waits (10 s at most) until that many run at once."""

    devices: dict[str, list[PreparedDevice]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    omit: set[str] = field(default_factory=set)
    extra: dict[str, object] = field(default_factory=dict)
    exc: Exception | None = None
    delay: float = 0.0
    calls: list[tuple[str, list[ClaimRef]]] = field(default_factory=list)
    running: int = 0
    max_running: int = 0
    hold_until_running: int = 0
    _all_in: asyncio.Event = field(default_factory=asyncio.Event)

    async def _enter(self, op: str, claims: list[ClaimRef]) -> None:
        self.calls.append((op, claims))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        if self.running >= self.hold_until_running:
            self._all_in.set()
        try:
            if self.hold_until_running:
                await asyncio.wait_for(self._all_in.wait(), 10)
            await asyncio.sleep(self.delay)
        finally:
            self.running -= 1
        if self.exc is not None:
            raise self.exc

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        await self._enter("prepare", claims)
        out: dict[str, PrepareResult] = {
            c.uid: PrepareResult(error=self.errors[c.uid]) if c.uid in self.errors
            else PrepareResult(self.devices.get(c.uid, [device_for(c.uid)]))
            for c in claims if c.uid not in self.omit}
        out.update(self.extra)  # type: ignore[arg-type]
        return out

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        await self._enter("unprepare", claims)
        out: dict[str, str | None] = {c.uid: self.errors.get(c.uid) for c in claims if c.uid not in self.omit}
        out.update(self.extra)  # type: ignore[arg-type]
        return out


@dataclass
class Served:
    """A started plugin and channels to its two sockets, as kubelet would open them."""

    servers: PluginServers
    plugin: FakeClaimPlugin
    dra: grpc.aio.Channel
    registration: grpc.aio.Channel


@pytest.fixture
async def serve_plugin(short_tmp: Path) -> AsyncIterator[Callable[..., object]]:
    """`await serve_plugin(health_source=None, **config)` -> `Served`; everything stops at teardown."""
    started: list[Served] = []

    async def serve(health_source: HealthSource | None = None, plugin: FakeClaimPlugin | None = None,
                    **config: object) -> Served:
        config.setdefault("plugin_data_dir", short_tmp / "plugins" / "gpu.timeslice.dev")
        config.setdefault("registry_dir", short_tmp / "plugins_registry")
        plugin = plugin or FakeClaimPlugin()
        servers = await create_servers(PluginServerConfig(**config), plugin, health_source)  # type: ignore[arg-type]
        s = Served(servers, plugin, grpc.aio.insecure_channel(f"unix:{servers.paths.dra}"),
                   grpc.aio.insecure_channel(f"unix:{servers.paths.registration}"))
        started.append(s)
        return s

    yield serve
    for s in started:
        await s.dra.close()
        await s.registration.close()
        await s.servers.stop(0)
