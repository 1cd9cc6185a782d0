"""Plugin registration and the two sockets, driven the way kubelet drives them.

Kubelet sees the registration socket appear, calls GetInfo, dials the endpoint it names
and reports back with NotifyRegistrationStatus (reference/dra-protocol.md §2).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2 as v1
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2_grpc as v1_grpc
from timeslice.driver.kubeletapi.registration import registration_pb2 as rpb
from timeslice.driver.kubeletapi.registration import registration_pb2_grpc as rpb_grpc
from timeslice.driver.private_paths import lock_state_dir
from timeslice.kubelet_plugin.app import KubeletPluginConfig, run
from timeslice.kubelet_plugin.health import DeviceRef, StaticHealthSource
from timeslice.kubelet_plugin.plugin_server import PluginServerConfig, create_servers
from timeslice.kubelet_plugin.registration import RegistrationServicer
from timeslice.kubelet_plugin.sockets import prepare_socket, socket_paths

from tests.kubelet_fakes import FakeClaimPlugin


@pytest.mark.parametrize(("health", "versions"), [
    (False, ["v1.DRAPlugin", "v1beta1.DRAPlugin"]),
    (True, ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]),
])
async def test_get_info_names_the_driver_its_socket_and_services(serve_plugin, short_tmp, health, versions) -> None:
    source = StaticHealthSource(lambda: [DeviceRef("node-a", "gpu-0-seat-0")]) if health else None
    served = await serve_plugin(health_source=source)
    info = await rpb_grpc.RegistrationStub(served.registration).GetInfo(rpb.InfoRequest(), timeout=1)
    assert info.type == "DRAPlugin" and info.name == "gpu.timeslice.dev"
    assert info.endpoint == str(short_tmp / "plugins" / "gpu.timeslice.dev" / "dra.sock")
    assert list(info.supported_versions) == versions


async def test_kubelet_flow_register_then_prepare_through_the_endpoint(serve_plugin, caplog) -> None:
    served = await serve_plugin()
    reg = rpb_grpc.RegistrationStub(served.registration)
    info = await reg.GetInfo(rpb.InfoRequest(), timeout=1)
    async with grpc.aio.insecure_channel("unix:" + info.endpoint) as ch:  # kubelet dials the endpoint
        r = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1.NodePrepareResourcesRequest(
            claims=[v1.Claim(namespace="ns", uid="u1", name="c")]), timeout=5)
    assert r.claims["u1"].error == ""
    registration = served.servers.registration
    assert not registration.registered.is_set()
    await reg.NotifyRegistrationStatus(rpb.RegistrationStatus(plugin_registered=True), timeout=5)
    await asyncio.wait_for(registration.registered.wait(), 1)
    assert registration.last_error is None
    with caplog.at_level(logging.INFO, logger="timeslice.kubelet_plugin.registration"):
        await reg.NotifyRegistrationStatus(rpb.RegistrationStatus(
            plugin_registered=False, error="version v9.DRAPlugin not supported"), timeout=5)
    assert not registration.registered.is_set()
    assert registration.last_error == "version v9.DRAPlugin not supported"
    [rec] = [r for r in caplog.records if r.name == "timeslice.kubelet_plugin.registration"]
    assert rec.levelno == logging.ERROR
    assert rec.getMessage().endswith("error=version v9.DRAPlugin not supported")


async def test_dra_socket_serves_grpc_health(serve_plugin) -> None:
    served = await serve_plugin()
    stub = health_pb2_grpc.HealthStub(served.dra)
    for service in ("", "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"):
        r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING, service


def _stale_socket(path: Path) -> None:
    """A socket file whose server is gone, as a crashed plugin leaves it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


async def test_stale_sockets_are_replaced_at_start_and_removed_at_stop(short_tmp) -> None:
    config = PluginServerConfig(plugin_data_dir=short_tmp / "plugins" / "drv", registry_dir=short_tmp / "reg")
    paths = config.socket_paths()
    _stale_socket(paths.dra)
    paths.registration.parent.mkdir(parents=True)
    paths.registration.write_text("left over")  # not even a socket
    servers = await create_servers(config, FakeClaimPlugin())
    try:
        assert paths.dra.is_socket() and paths.registration.is_socket()
        async with grpc.aio.insecure_channel(f"unix:{paths.registration}") as ch:
            assert (await rpb_grpc.RegistrationStub(ch).GetInfo(rpb.InfoRequest(), timeout=1)).name
    finally:
        await servers.stop(0)
    assert not paths.dra.exists() and not paths.registration.exists()
    assert paths.dra.parent.is_dir() and paths.registration.parent.is_dir()


async def test_a_second_plugin_is_refused_and_the_first_keeps_its_sockets(short_tmp) -> None:
    """A second plugin on the node (a stray copy, a manual start beside the DaemonSet's) must
    not take the kubelet's sockets from the first (gRPC alone removes a live socket file)."""
    config = PluginServerConfig(plugin_data_dir=short_tmp / "plugins" / "drv", registry_dir=short_tmp / "reg")
    paths = config.socket_paths()
    first = await create_servers(config, FakeClaimPlugin())
    try:
        dra_inode = paths.dra.stat().st_ino
        with pytest.raises(OSError, match="another server is listening"):
            await create_servers(config, FakeClaimPlugin())
        assert paths.dra.stat().st_ino == dra_inode
        async with grpc.aio.insecure_channel(f"unix:{paths.registration}") as ch:
            info = await rpb_grpc.RegistrationStub(ch).GetInfo(rpb.InfoRequest(), timeout=5)
        async with grpc.aio.insecure_channel(f"unix:{info.endpoint}") as dra:
            r = await health_pb2_grpc.HealthStub(dra).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await first.stop(0)


async def test_a_plugin_on_a_state_dir_in_use_stops_before_it_touches_anything(tmp_path) -> None:
    """The state dir holds the claims' checkpoint and the node agent's records: a second
    plugin on it is refused (the first holds its lock) before it reads or serves anything."""
    config = KubeletPluginConfig(node_name="n", state_dir=tmp_path / "state", fake_gpus="1",
                                 registry_dir=tmp_path / "reg")
    (tmp_path / "state").mkdir()
    with lock_state_dir(tmp_path / "state", "kubelet-plugin"):
        with pytest.raises(OSError, match="another timeslice kubelet-plugin uses this state dir"):
            await run(config)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["kubelet-plugin.lock"]
    assert not (tmp_path / "reg").exists()


async def test_dra_serves_before_the_registration_socket_appears(short_tmp) -> None:
    config = PluginServerConfig(plugin_data_dir=short_tmp / "p", registry_dir=short_tmp / "r")
    paths = config.socket_paths()
    seen: list[int] = []

    async def kubelet() -> None:  # reacts at once to the registration socket, like kubelet's fsnotify watch
        while not paths.registration.exists():  # noqa: ASYNC110  (a file, no event to wait on)
            await asyncio.sleep(0)
        async with grpc.aio.insecure_channel(f"unix:{paths.registration}") as reg:
            info = await rpb_grpc.RegistrationStub(reg).GetInfo(rpb.InfoRequest(), timeout=1)
        async with grpc.aio.insecure_channel(f"unix:{info.endpoint}") as dra:
            r = await health_pb2_grpc.HealthStub(dra).Check(health_pb2.HealthCheckRequest(), timeout=1)
        seen.append(r.status)

    watcher = asyncio.create_task(kubelet())
    servers = await create_servers(config, FakeClaimPlugin())
    try:
        await asyncio.wait_for(watcher, 5)
        assert seen == [health_pb2.HealthCheckResponse.SERVING]
    finally:
        await servers.stop(0)


def test_default_socket_paths_are_the_kubelet_ones() -> None:
    paths = socket_paths("gpu.timeslice.dev")
    assert str(paths.dra) == "/var/lib/kubelet/plugins/gpu.timeslice.dev/dra.sock"
    assert str(paths.registration) == "/var/lib/kubelet/plugins_registry/gpu.timeslice.dev-reg.sock"
    assert PluginServerConfig().socket_paths() == paths


def test_bad_socket_paths_and_endpoints_are_refused(tmp_path, short_tmp) -> None:
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        prepare_socket(tmp_path / ("x" * 120) / "dra.sock")
    (short_tmp / "dir.sock").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        prepare_socket(short_tmp / "dir.sock")
    with pytest.raises(ValueError, match="absolute socket path"):
        RegistrationServicer("gpu.timeslice.dev", "dra.sock")


async def test_a_registration_socket_that_cannot_bind_stops_the_dra_server(short_tmp) -> None:
    (short_tmp / "r").mkdir()
    (short_tmp / "r" / "gpu.timeslice.dev-reg.sock").mkdir()  # a directory where the socket goes
    config = PluginServerConfig(plugin_data_dir=short_tmp / "p", registry_dir=short_tmp / "r")
    with pytest.raises(ValueError, match="is a directory"):
        await create_servers(config, FakeClaimPlugin())
    assert not (short_tmp / "p" / "dra.sock").exists()
