"""Node agents found from the node-plugin pods: node name -> the agent's endpoint.

Owned by `ClusterState` (a `Reflector` on the plugin pods feeds `trim_plugin_pod`) and
read by the `Reconciler`, which puts each node's target into the group specs and hands
the agents' certificates to the orchestrator (`Orchestrator.set_agent_certificates`). The
node agent runs inside the kubelet plugin's pod (DaemonSet `timeslice-kubelet-plugin`,
label `app.kubernetes.io/name=timeslice-kubelet-plugin`) and listens on its container
port named `agent`; its address is the pod's `status.podIP` (the node's address under
hostNetwork). With `--agent-tls` the agent publishes its self-signed certificate (PEM) on
that pod as the annotation `timeslice.dev/agent-certificate`, and the controller pins it
for that target. During a rolling update a node can have two plugin pods: a Ready one
wins, then the newest (its certificate with it). A node with no running plugin pod has no
target: the reconciler gives it `missing_target(node)`, and a switch there fails with a
clear error (and rolls back) instead of calling a guessed address.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from timeslice.controller.orchestrator.agent_pool import MISSING_PREFIX
from timeslice.driver.names import AGENT_CERTIFICATE_ANNOTATION

PLUGIN_LABEL = ("app.kubernetes.io/name", "timeslice-kubelet-plugin")
PLUGIN_SELECTOR = "=".join(PLUGIN_LABEL)
AGENT_PORT_NAME = "agent"
DEFAULT_AGENT_PORT = 50052

Obj = dict[str, Any]


class AgentEndpoint(NamedTuple):
    """Where a node's agent listens (`host:port`) and the certificate its plugin pod
    publishes (PEM, as found in the annotation; None: the pod publishes none, the agent is
    plaintext)."""

    target: str
    certificate: str | None = None


def missing_target(node: str) -> str:
    """The stand-in target of a node without a node agent (see `AgentPool.get`)."""
    return f"{MISSING_PREFIX}{node}"


def _ready(status: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _agent_port(spec: Mapping[str, Any]) -> int:
    for container in spec.get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == AGENT_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return DEFAULT_AGENT_PORT


def trim_plugin_pod(pod: Obj, namespace: str) -> Obj | None:
    """{node, target, ready, created, certificate} of a running plugin pod in `namespace`
    with an IP, else None. `certificate`: the annotation `timeslice.dev/agent-certificate`
    as it is (None when absent; a malformed one is kept, so that calls to that agent fail
    with a clear error instead of falling back to plaintext)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    ip, node = status.get("podIP"), spec.get("nodeName")
    labels = meta.get("labels") or {}
    if meta.get("namespace") != namespace or labels.get(PLUGIN_LABEL[0]) != PLUGIN_LABEL[1] \
            or status.get("phase") != "Running" or not ip or not node or meta.get("deletionTimestamp"):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    certificate = (meta.get("annotations") or {}).get(AGENT_CERTIFICATE_ANNOTATION)
    return {"node": node, "target": f"{host}:{_agent_port(spec)}", "ready": _ready(status),
            "created": meta.get("creationTimestamp") or "",
            "certificate": certificate if isinstance(certificate, str) else None}


def agent_endpoints(pods: Iterable[Mapping[str, Any]]) -> dict[str, AgentEndpoint]:
    """node name -> agent endpoint, from trimmed plugin pods (Ready first, then newest)."""
    best: dict[str, tuple[tuple[bool, str, str], AgentEndpoint]] = {}
    for p in pods:
        rank = (bool(p["ready"]), str(p["created"]), str(p["target"]))
        if p["node"] not in best or rank > best[p["node"]][0]:
            best[p["node"]] = (rank, AgentEndpoint(str(p["target"]), p.get("certificate")))
    return {node: endpoint for node, (_, endpoint) in sorted(best.items())}


def agent_certificates(endpoints: Iterable[AgentEndpoint]) -> dict[str, str]:
    """agent target -> the certificate to pin for it, for the endpoints that publish one."""
    return {e.target: e.certificate for e in endpoints if e.certificate is not None}
