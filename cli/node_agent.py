"""`timeslice node-agent`: a node agent on a machine outside Kubernetes (multi-node static groups).

The composition root of a standalone node: the node agent of the cluster (same backends,
write-ahead records, operations), which finds a job's processes by their environment
(`TIMESLICE_JOB=<job>`, `EnvironProcessResolver`), for a `timeslice orchestrator` whose
static groups name this node's address under `agents`. A unix socket (default) is mode
0600; a TCP address needs a shared token (`--token-file`; the orchestrator's
`agent_token_file`) and should use TLS (`--tls`: a self-signed certificate, kept in the
state directory across restarts, whose PEM is written to `--certificate-file` for the
orchestrator to pin, `agent_certificates`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from timeslice.driver import atomic, signals
from timeslice.driver.private_paths import lock_state_dir
from timeslice.kubelet_plugin.agent.auth import SharedToken
from timeslice.kubelet_plugin.agent.host_processes import EnvironProcessResolver
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.server import create_server
from timeslice.kubelet_plugin.agent.tls import kept

log = logging.getLogger("timeslice.agent")


@dataclass(frozen=True)
class NodeAgentConfig:
    """`listen`: `unix:///path` or `host:port` (port 0 picks one); `backends`: those this
    node offers; `state_dir`: the agent's checkpoint records, kept across restarts."""

    listen: str
    backends: tuple[str, ...]
    state_dir: Path
    token_file: str | None = None
    tls: bool = False
    certificate_file: Path | None = None

    def check(self) -> None:
        """Raises ValueError: a TCP address without a token, TLS without a certificate file
        (unknown backends: NodeAgent's own check)."""
        if not self.listen.startswith("unix:") and not self.token_file:
            raise ValueError(f"--listen {self.listen}: a node agent on a network address needs --token-file (any "
                             "local or remote caller could freeze processes); or listen on a unix socket")
        if self.tls and self.certificate_file is None:
            raise ValueError("--tls needs --certificate-file: the orchestrator pins the certificate written there")


async def serve(cfg: NodeAgentConfig) -> None:
    """Run until SIGINT/SIGTERM/SIGHUP; prints `ready listen=<address> [certificate=<file>]` when
    serving (port 0 replaced by the bound one). Raises ValueError, OSError."""
    cfg.check()
    stop = signals.stop_event()
    cfg.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with lock_state_dir(cfg.state_dir, "node-agent"):  # first: a second agent on this state dir stops here
        await _serve(cfg, stop)


async def _serve(cfg: NodeAgentConfig, stop: asyncio.Event) -> None:
    callers = SharedToken(cfg.token_file) if cfg.token_file else None
    identity = kept(cfg.state_dir, socket.gethostname()) if cfg.tls else None
    if identity is not None and cfg.certificate_file is not None:
        atomic.write_atomic(cfg.certificate_file, identity.certificate_pem)
    elif not cfg.listen.startswith("unix:"):
        log.warning("node agent on %s is plaintext (no --tls): its calls and token are not encrypted in transit",
                    cfg.listen)
    agent = NodeAgent(EnvironProcessResolver(), backends=cfg.backends, records_path=cfg.state_dir / "agent.json")
    server, port = await create_server(agent, cfg.listen, callers,
                                       identity.server_credentials() if identity else None)
    listen = cfg.listen if cfg.listen.startswith("unix:") else f"{cfg.listen.rpartition(':')[0]}:{port}"
    log.info("node agent serving listen=%s backends=%s auth=%s tls=%s", listen, ",".join(cfg.backends),
             "token" if callers else "none", identity.fingerprint if identity else "off")
    print(f"ready listen={listen}" + (f" certificate={cfg.certificate_file}" if identity else ""), flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(1)

