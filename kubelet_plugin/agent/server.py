"""Node-agent gRPC server: `create_server` builds and starts it.

Owned by the node agent; called by the demo, tests and the kubelet plugin. Listens on
a unix socket (`unix:///path`) or TCP, plaintext or, with `credentials` (the kubelet
plugin's `--agent-tls`: `tls.AgentIdentity.server_credentials()`), TLS only. On TCP
beyond loopback, pass `callers` (`auth.AllowedCallers`) so that only the orchestrator may
call it, and `credentials` so that its token and the calls are encrypted in transit. A
unix socket is its owner's only (mode 0600): the kubelet plugin serves an agent without
`callers` only there (issue 10, item 12).
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import grpc.aio
from timeslice.driver import grpc_server
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.private_paths import free_socket_path
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.service import CallerCheck, NodeAgentServicer

SERVICE_NAME = apb.DESCRIPTOR.services_by_name["NodeAgent"].full_name


async def create_server(agent: NodeAgent, listen: str, callers: CallerCheck | None = None,
                        credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """A started server for `agent` on `listen`; returns (server, port; 0 for unix sockets).
    `callers`: who may call the NodeAgent service (None: anyone); health stays open.
    `credentials`: serve TLS with them (None: plaintext). A unix socket's directory is made,
    a file left at its path by an earlier run replaced, and the socket made mode 0600.
    Raises OSError when `listen` cannot be bound. Checkpoints an earlier run left
    unfinished are undone first (`NodeAgent.recover`)."""
    path = Path(listen.removeprefix("unix://").removeprefix("unix:")) if listen.startswith("unix:") else None
    if path is not None:  # before the records are touched: a live agent's socket refuses this one
        path.parent.mkdir(parents=True, exist_ok=True)
        free_socket_path(path)
    await agent.recover()
    servicer = NodeAgentServicer(agent, callers)
    server, port = await grpc_server.start(lambda s: apb_grpc.add_NodeAgentServicer_to_server(servicer, s),
                                           [SERVICE_NAME], listen, credentials)
    if path is not None:
        os.chmod(path, 0o600)
    return server, port
