"""`timeslice kubelet-plugin`: the node component, wired from its parts and run.

Owned by the kubelet plugin; started by the CLI. One asyncio loop serves: the DRA and
registration sockets (`plugin_server`), ResourceSlice publishing (`slice_publisher`),
device health (`health`), the claim preparer (`preparer`) and the node agent
(`agent/`), which the orchestrator calls to checkpoint and restore claims' processes;
with `agent_auth: tokenreview` only `agent_allowed_users` may call it (`agent/auth.py`);
with `agent_tls` it serves TLS with a self-signed certificate made at start
(`agent/tls.py`, key in memory only) and publishes the certificate on its own pod
(`POD_NAMESPACE`/`POD_NAME`, `agent_certificate.py`) for the controller to pin.
Order at start: restore CDI specs from the checkpoint, publish slices, serve the agent
(then publish its certificate, retried in the background), then the DRA socket and,
last, the registration socket (kubelet calls in at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Literal

from kubernetes.aio import client as k8s
from kubernetes.aio.client.exceptions import ApiException
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from timeslice.driver import kubeapi, names, signals, vmm_shim
from timeslice.driver.errors import NotFound
from timeslice.driver.events import EventRecorder
from timeslice.driver.liveness import Heartbeat, tasks_alive
from timeslice.driver.private_paths import lock_state_dir
from timeslice.driver.tasks import cancel_and_wait
from timeslice.driver.tokenreview import TokenReviewer
from timeslice.kubelet_plugin.agent.auth import AllowedCallers
from timeslice.kubelet_plugin.agent.backends.vmm import VmmBackend
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.pod_processes import ClaimProcessResolver
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server
from timeslice.kubelet_plugin.agent.tls import self_signed
from timeslice.kubelet_plugin.agent_certificate import CertificatePublisher
from timeslice.kubelet_plugin.checkpoint import Checkpoint
from timeslice.kubelet_plugin.devices import GpuInfo, discover_gpus
from timeslice.kubelet_plugin.driver_root import DriverRoot
from timeslice.kubelet_plugin.health import DeviceRef, NvmlHealthSource, StaticHealthSource
from timeslice.kubelet_plugin.plugin_server import PluginServerConfig, create_servers
from timeslice.kubelet_plugin.preparer import ClaimPreparer
from timeslice.kubelet_plugin.resourceslices import build_devices
from timeslice.kubelet_plugin.slice_publisher import ApiSliceStore, SlicePublisher

log = logging.getLogger("timeslice.kubelet_plugin")


class KubeletPluginConfig(BaseModel):
    """Everything `timeslice kubelet-plugin` needs; paths are host paths. `agent_auth`:
    `tokenreview` lets only `agent_allowed_users` (TokenReview user names) call the node
    agent; `none` (the default) serves only a unix socket, made mode 0600 (root's callers
    only): anyone reaching an unauthenticated port could freeze any claim's processes and
    overwrite another job's checkpoint record (issue 10, item 12). `agent_tls`: serve the agent port with
    TLS and publish its certificate on pod `pod_namespace`/`pod_name` (default: env
    `POD_NAMESPACE` / `POD_NAME`, from the downward API). `liveness_file`: touched while
    the plugin works (`driver.liveness`: its background tasks run and the kubelet's sockets
    exist; None: off)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_name: str = Field(min_length=1)
    fake_gpus: str | None = None
    sharing: Literal["seats", "consumable"] = "seats"
    seats: int = Field(default=4, ge=1, le=64)
    state_dir: Path = Path("/var/lib/kubelet/plugins") / names.DRIVER_NAME / "state"
    cdi_dir: Path = Path("/var/run/cdi")
    plugin_data_dir: Path | None = None
    registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    agent_listen: str = f"unix:///var/lib/kubelet/plugins/{names.DRIVER_NAME}/agent.sock"
    agent_auth: Literal["none", "tokenreview"] = "none"
    agent_allowed_users: tuple[str, ...] = Field(default=names.DEFAULT_AGENT_CALLERS, min_length=1)
    agent_tls: bool = False
    pod_name: str = Field(default_factory=lambda: os.environ.get("POD_NAME", ""))
    pod_namespace: str = Field(default_factory=lambda: os.environ.get("POD_NAMESPACE", ""))
    backends: tuple[str, ...] = ("freeze", "none")
    orchestrator: str = ""
    # prepared claims are checked against the API server at start and this often, seconds
    prune_seconds: float = Field(default=300.0, gt=0)
    liveness_file: Path | None = None
    driver_root: Path | None = None
    driver_root_host: Path | None = None

    @field_validator("backends")
    @classmethod
    def _known_backends(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [b for b in v if b not in names.BACKENDS]
        if unknown or not v:
            raise ValueError(f"--backends {','.join(v)}: unknown {unknown or 'none given'}; known: "
                             f"{', '.join(names.BACKENDS)}")
        return v

    @model_validator(mode="after")
    def _unauthenticated_only_on_a_unix_socket(self) -> KubeletPluginConfig:
        if self.agent_auth == "none" and not self.agent_listen.startswith("unix:"):
            raise ValueError(f"--agent-listen {self.agent_listen} with --agent-auth none: an unauthenticated node "
                             "agent serves only a unix socket (unix:///path, made mode 0600); to listen on a port "
                             "use --agent-auth tokenreview")
        return self


def device_table(gpus: list[GpuInfo], cfg: KubeletPluginConfig) -> tuple[list[dict[str, Any]], dict[str, GpuInfo]]:
    """(devices to publish, published device name -> its GPU)."""
    devices = build_devices(gpus, cfg.sharing, cfg.seats)
    by_uuid = {g.uuid: g for g in gpus}
    table = {d["name"]: by_uuid[d["attributes"]["uuid"]["string"]] for d in devices}
    return devices, table


def _local(listen: str) -> bool:
    """Whether `listen` (`host:port` or `unix:...`) is reachable from this host only."""
    return listen.startswith("unix:") or listen.rsplit(":", 1)[0] in ("127.0.0.1", "localhost", "[::1]")



async def _prune_periodically(preparer: ClaimPreparer, seconds: float) -> None:
    """`ClaimPreparer.prune_gone` at start, then every `seconds`: prepared claims deleted
    while this plugin was down lose their CDI spec and checkpoint entry."""
    while True:
        try:
            await preparer.prune_gone()
        except Exception:  # the API server away: asked again next time
            log.exception("checking prepared claims against the API server failed")
        await asyncio.sleep(seconds)

async def run(cfg: KubeletPluginConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or SIGINT/SIGTERM/SIGHUP when `stop` is None). Raises
    GpuDiscoveryError at once on a node without the NVIDIA driver (`--driver-root`), OSError
    when another kubelet plugin uses `cfg.state_dir` (its claims' checkpoint and its agent's
    records) or serves on its sockets: the second one stops touching nothing."""
    cfg.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with lock_state_dir(cfg.state_dir, "kubelet-plugin"):
        await _serve(cfg, stop)


async def _serve(cfg: KubeletPluginConfig, stop: asyncio.Event | None) -> None:
    driver = DriverRoot(cfg.driver_root, cfg.driver_root_host or cfg.driver_root) \
        if cfg.driver_root is not None and cfg.fake_gpus is None else None
    if driver is not None:
        driver.load()  # before NVML is first asked
    api = await kubeapi.api_client()
    resource_api = k8s.ResourceV1Api(api)
    events = EventRecorder(k8s.CoreV1Api(api), f"{names.DRIVER_NAME}/kubelet-plugin", cfg.node_name)

    async def read_claim(namespace: str, name: str) -> dict[str, Any]:
        try:
            obj = await resource_api.read_namespaced_resource_claim(name, namespace)
        except ApiException as err:
            if err.status == 404:
                raise NotFound(f"claim {namespace}/{name} no longer exists") from None
            raise kubeapi.api_error(err, f"read claim {namespace}/{name}") from None
        return api.sanitize_for_serialization(obj)

    gpus = await asyncio.to_thread(discover_gpus, cfg.fake_gpus, cfg.node_name)
    devices, table = device_table(gpus, cfg)
    preparer = ClaimPreparer(node_name=cfg.node_name, read_claim=read_claim, lookup=table.get,
                             checkpoint=Checkpoint(cfg.state_dir / "checkpoint.json"), cdi_dir=cfg.cdi_dir,
                             events=events, orchestrator=cfg.orchestrator,
                             driver_mounts=driver.mounts() if driver is not None else (),
                             vmm_shim=vmm_shim.install_for_containers(cfg.state_dir)
                             if names.BACKEND_VMM in cfg.backends else None)
    restored = preparer.restore_cdi_specs()
    pruner = asyncio.create_task(_prune_periodically(preparer, cfg.prune_seconds), name="prune-claims")
    publisher = SlicePublisher(ApiSliceStore(api), cfg.node_name)
    await publisher.publish(devices, wait=False)  # the loop retries while the API server is away
    # `vmm` without the node's pinned pool in a pod: the plugin's memory limit (the chart's 512 MiB) cannot
    # hold one, and one a job's shim populated would be charged to that job's pod; each checkpoint registers
    # host memory of its shim's own (slower: docs/backends.md)
    backends = [VmmBackend(names.DEFAULT_LOCK_TIMEOUT_SECONDS, pool_bytes=0) if b == names.BACKEND_VMM else b
                for b in cfg.backends]
    agent = NodeAgent(StaticProcessResolver(), backends=backends, records_path=cfg.state_dir / "agent.json",
                      claim_resolver=ClaimProcessResolver(cfg.node_name, read_claim,
                                                          lambda d: table[d].uuid if d in table else None))
    callers = None
    if cfg.agent_auth == "tokenreview":
        callers = AllowedCallers(TokenReviewer(k8s.AuthenticationV1Api(api), names.AGENT_AUDIENCE),
                                 cfg.agent_allowed_users)
    identity = self_signed(cfg.node_name) if cfg.agent_tls else None
    if identity is None and not _local(cfg.agent_listen):
        log.warning("node agent on %s is plaintext (no --agent-tls): its calls and tokens are not encrypted in "
                    "transit", cfg.agent_listen)
    agent_server, agent_port = await create_agent_server(
        agent, cfg.agent_listen, callers, identity.server_credentials() if identity else None)
    cert_publisher = None
    if identity is not None:
        log.info("node agent TLS certificate=%s not_after=%s", identity.fingerprint, identity.not_after.isoformat())
        if cfg.pod_name and cfg.pod_namespace:
            cert_publisher = CertificatePublisher(k8s.CoreV1Api(api), cfg.pod_namespace, cfg.pod_name,
                                                  identity.certificate_pem.decode())
            cert_publisher.start()
        else:
            log.error("node agent certificate NOT published: POD_NAME and POD_NAMESPACE are not set (the downward "
                      "API in manifests/base/kubelet-plugin.yaml sets them), so the controller cannot pin it: "
                      "calls to this agent fail their TLS handshake, or are refused with --require-agent-tls")
    refs = [DeviceRef(cfg.node_name, d["name"], "" if table[d["name"]].fake else table[d["name"]].uuid)
            for d in devices]
    source = StaticHealthSource(lambda: refs) if cfg.fake_gpus else NvmlHealthSource(lambda: refs)
    servers = await create_servers(PluginServerConfig(plugin_data_dir=cfg.plugin_data_dir,
                                                      registry_dir=cfg.registry_dir), preparer, source)
    log.info("kubelet plugin up node=%s gpus=%d devices=%d restored_cdi_specs=%d agent_port=%d agent_auth=%s "
             "agent_tls=%s", cfg.node_name, len(gpus), len(devices), restored, agent_port, cfg.agent_auth,
             "on" if identity else "off")
    heartbeat = None
    if cfg.liveness_file:  # a socket the kubelet lost (its plugin directory wiped) comes back with a restart
        kubelet_sockets = [servers.paths.dra] + ([servers.paths.registration] if servers.registration_server else [])
        heartbeat = Heartbeat(cfg.liveness_file, {
            "tasks": tasks_alive(lambda: [pruner, publisher.task, cert_publisher.task if cert_publisher else None]),
            "sockets": lambda: ", ".join(f"{p} is gone" for p in kubelet_sockets if not p.exists()) or None})
        heartbeat.start()
    if stop is None:
        stop = signals.stop_event()
    try:
        await stop.wait()
    finally:
        if heartbeat is not None:
            await heartbeat.stop()
        with contextlib.suppress(Exception):
            await servers.stop(1)
        await agent_server.stop(1)
        if cert_publisher is not None:
            await cert_publisher.stop()
        await cancel_and_wait(pruner)
        await publisher.stop()
        await api.close()
