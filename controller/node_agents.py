"""Node agents found from the node-plugin pods: node name -> the agent's gRPC target.

Owned by `ClusterState` (a `Reflector` on the plugin pods feeds `trim_plugin_pod`) and
read by the `Reconciler`, which puts each node's target into the group specs. The node
agent runs inside the kubelet plugin's pod (DaemonSet `timeslice-kubelet-plugin`,
label `app.kubernetes.io/name=timeslice-kubelet-plugin`) and listens on its container
port named `agent`; its address is the pod's `status.podIP` (the node's address under
hostNetwork). During a rolling update a node can have two plugin pods: a Ready one wins,
then the newest. A node with no running plugin pod has no target: the reconciler gives
it `missing_target(node)`, and a switch there fails with a clear error (and rolls back)
instead of calling a guessed address.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from timeslice.controller.orchestrator.agents import MISSING_PREFIX

PLUGIN_LABEL = ("app.kubernetes.io/name", "timeslice-kubelet-plugin")
PLUGIN_SELECTOR = "=".join(PLUGIN_LABEL)
AGENT_PORT_NAME = "agent"
DEFAULT_AGENT_PORT = 50052

Obj = dict[str, Any]


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
    """{node, target, ready, created} of a running plugin pod in `namespace` with an IP, else None."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    ip, node = status.get("podIP"), spec.get("nodeName")
    labels = meta.get("labels") or {}
    if meta.get("namespace") != namespace or labels.get(PLUGIN_LABEL[0]) != PLUGIN_LABEL[1] \
            or status.get("phase") != "Running" or not ip or not node or meta.get("deletionTimestamp"):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return {"node": node, "target": f"{host}:{_agent_port(spec)}", "ready": _ready(status),
            "created": meta.get("creationTimestamp") or ""}


def agent_targets(pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """node name -> agent target, from trimmed plugin pods (Ready first, then newest)."""
    best: dict[str, tuple[bool, str, str]] = {}
    for p in pods:
        rank = (bool(p["ready"]), str(p["created"]), str(p["target"]))
        if p["node"] not in best or rank > best[p["node"]]:
            best[p["node"]] = rank
    return {node: rank[2] for node, rank in sorted(best.items())}
