"""Node agents found from the node-plugin pods (controller/node_agents.py), through the
reflector on a fake API server, into the reconciler's group specs."""

from __future__ import annotations

from timeslice.controller.grouping import Snapshot
from timeslice.controller.node_agents import (
    AgentEndpoint,
    agent_certificates,
    agent_endpoints,
    missing_target,
    trim_plugin_pod,
)
from timeslice.controller.reconciler import agent_target
from timeslice.driver.names import AGENT_CERTIFICATE_ANNOTATION

NS = "timeslice-system"


def plugin_pod(name: str, node: str, ip: str = "10.0.0.1", phase: str = "Running", ready: bool = True,
               ns: str = NS, port: int | None = 50052, created: str = "2026-11-29T10:00:00Z",
               labels: dict[str, str] | None = None, certificate: str | None = None) -> dict:
    ports = [{"name": "agent", "containerPort": port}] if port else []
    annotations = {"other": "kept"} if certificate is None else {"other": "kept",
                                                                  AGENT_CERTIFICATE_ANNOTATION: certificate}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}", "creationTimestamp": created,
                         "labels": {"app.kubernetes.io/name": "timeslice-kubelet-plugin"} if labels is None
                         else labels, "annotations": annotations},
            "spec": {"nodeName": node, "containers": [{"name": "plugin", "ports": ports}]},
            "status": {"phase": phase, "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_running_plugin_pod_names_its_nodes_agent() -> None:
    assert trim_plugin_pod(plugin_pod("p", "n1", port=6000), NS) == {
        "node": "n1", "target": "10.0.0.1:6000", "ready": True, "created": "2026-11-29T10:00:00Z",
        "certificate": None}
    assert trim_plugin_pod(plugin_pod("p", "n1", ip="fd00::5", port=None), NS)["target"] == "[fd00::5]:50052"


def test_pods_that_are_no_agent_are_left_out() -> None:
    assert trim_plugin_pod(plugin_pod("p", "n1", ns="other"), NS) is None
    assert trim_plugin_pod(plugin_pod("p", "n1", labels={}), NS) is None
    assert trim_plugin_pod(plugin_pod("p", "n1", phase="Pending"), NS) is None
    assert trim_plugin_pod(plugin_pod("p", "n1", ip=""), NS) is None
    gone = plugin_pod("p", "n1")
    gone["metadata"]["deletionTimestamp"] = "2026-11-29T10:01:00Z"
    assert trim_plugin_pod(gone, NS) is None


def test_during_a_rolling_update_the_ready_then_newest_pod_wins() -> None:
    old = plugin_pod("old", "n1", ip="10.0.0.1", created="2026-11-29T09:00:00Z")
    new_unready = plugin_pod("new", "n1", ip="10.0.0.2", ready=False, created="2026-11-29T10:00:00Z")
    other = plugin_pod("b", "n2", ip="10.0.0.3")
    trimmed = [trim_plugin_pod(p, NS) for p in (old, new_unready, other)]
    assert agent_endpoints(trimmed) == {"n1": ("10.0.0.1:50052", None), "n2": ("10.0.0.3:50052", None)}
    new_ready = plugin_pod("new", "n1", ip="10.0.0.2", created="2026-11-29T10:00:00Z")
    trimmed = [trim_plugin_pod(p, NS) for p in (old, new_ready)]
    assert agent_endpoints(trimmed) == {"n1": ("10.0.0.2:50052", None)}


def test_the_published_certificate_comes_with_the_winning_pod() -> None:
    """The annotation is kept as it is, with the pod that names the node's agent; an empty
    or malformed one is kept too (calls to that agent then fail clearly, never in
    plaintext)."""
    old = plugin_pod("old", "n1", ip="10.0.0.1", created="2026-11-29T09:00:00Z", certificate="PEM-OLD")
    new = plugin_pod("new", "n1", ip="10.0.0.2", created="2026-11-29T10:00:00Z", certificate="PEM-NEW")
    plain = plugin_pod("b", "n2", ip="10.0.0.3")
    empty = plugin_pod("c", "n3", ip="10.0.0.4", certificate="")
    trimmed = [trim_plugin_pod(p, NS) for p in (old, new, plain, empty)]
    assert trimmed[0]["certificate"] == "PEM-OLD" and trimmed[2]["certificate"] is None
    endpoints = agent_endpoints(trimmed)
    assert endpoints == {"n1": AgentEndpoint("10.0.0.2:50052", "PEM-NEW"), "n2": AgentEndpoint("10.0.0.3:50052"),
                         "n3": AgentEndpoint("10.0.0.4:50052", "")}
    assert agent_certificates(endpoints.values()) == {"10.0.0.2:50052": "PEM-NEW", "10.0.0.4:50052": ""}


def test_reconciler_takes_the_template_else_the_pod_else_a_missing_agent() -> None:
    snap = Snapshot(node_agents={"n1": AgentEndpoint("10.0.0.1:50052")})
    assert agent_target("n1", snap, None) == "10.0.0.1:50052"
    assert agent_target("n2", snap, None) == missing_target("n2") == "no-agent:n2"
    assert agent_target("n1", snap, "{node}:7000") == "n1:7000"
