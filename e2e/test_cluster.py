"""Smoke tests of the cluster itself: node, DRA API, pods, logs, exec, images.

Helpers come only through fixtures (conftest.py), never `import conftest`: the repo has
more than one conftest module.
"""
from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.e2e


def pod(name: str, image: str, command: list[str], host_network: bool = False,
        env: dict[str, str] | None = None, restart: str = "Never") -> dict:
    spec: dict = {
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": 1,
        "containers": [{
            "name": "main", "image": image, "imagePullPolicy": "Never", "command": command,
            "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
        }],
    }
    if host_network:
        spec["hostNetwork"] = True
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def apply_in(kube, ns: str, obj: dict) -> None:
    obj["metadata"]["namespace"] = ns
    kube.apply(obj)


def test_node_ready(kube) -> None:
    nodes = kube.json("get", "nodes")["items"]
    assert nodes, "no nodes registered"
    for n in nodes:
        conds = {c["type"]: c["status"] for c in n["status"]["conditions"]}
        assert conds.get("Ready") == "True", f"node {n['metadata']['name']} not Ready: {conds}"
        for pressure in ("MemoryPressure", "DiskPressure", "PIDPressure"):
            assert conds.get(pressure) == "False", f"{pressure}: {conds}"
    assert kube.run("get", "--raw", "/readyz").stdout.strip() == "ok"


def test_control_plane_version(kube, node_name: str) -> None:
    server = json.loads(kube.run("get", "--raw", "/version").stdout)
    assert server["major"] == "1" and int(server["minor"].rstrip("+")) >= 34, server
    node = kube.json("get", "node", node_name)
    assert node["status"]["nodeInfo"]["kubeletVersion"] == server["gitVersion"]
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2."), \
        node["status"]["nodeInfo"]


def test_resource_v1_served(kube) -> None:
    group = json.loads(kube.run("get", "--raw", "/apis/resource.k8s.io/v1").stdout)
    assert group["groupVersion"] == "resource.k8s.io/v1"
    names = {r["name"] for r in group["resources"]}
    for want in ("deviceclasses", "resourceclaims", "resourceclaims/status",
                 "resourceclaimtemplates", "resourceslices"):
        assert want in names, f"{want} not served in resource.k8s.io/v1: {sorted(names)}"
    out = kube.run("api-resources", "--api-group=resource.k8s.io", "-o", "name").stdout.split()
    assert "resourceslices.resource.k8s.io" in out, out
    # empty lists work (the storage is wired up, not just discovery)
    kube.run("get", "resourceslices.v1.resource.k8s.io")
    kube.run("get", "deviceclasses.v1.resource.k8s.io")


def test_busybox_pod_logs(kube, namespace: str) -> None:
    apply_in(kube, namespace, pod("busybox-echo", kube.busybox_image,
                                  ["sh", "-c", "echo hello-from-busybox; uname -s"]))
    p = kube.wait_pod_phase(namespace, "busybox-echo", {"Succeeded"})
    assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    out = kube.logs(namespace, "busybox-echo")
    assert "hello-from-busybox" in out and "Linux" in out, out


def test_busybox_exec(kube, namespace: str) -> None:
    """kubectl exec goes apiserver -> kubelet (127.0.0.1:10250) -> containerd stream server."""
    apply_in(kube, namespace, pod("busybox-sleep", kube.busybox_image, ["sleep", "3600"]))
    kube.wait_pod_phase(namespace, "busybox-sleep", {"Running"})
    out = kube.run("exec", "-n", namespace, "busybox-sleep", "--", "sh", "-c", "echo exec-ok").stdout
    assert out.strip() == "exec-ok"
    kube.run("delete", "pod", "-n", namespace, "busybox-sleep", "--wait=false")


def test_python_image_runs_python3(kube, namespace: str) -> None:
    apply_in(kube, namespace, pod("python-version", kube.python_image, [
        "python3", "-c", "import sys, ssl, json; print('python-ok', sys.version.split()[0])"]))
    kube.wait_pod_phase(namespace, "python-version", {"Succeeded"}, timeout=180)
    out = kube.logs(namespace, "python-version")
    assert out.startswith("python-ok 3."), out


def test_hostnetwork_pod_reaches_apiserver(kube, namespace: str) -> None:
    """Pods that talk to the API use hostNetwork and KUBERNETES_SERVICE_HOST=127.0.0.1."""
    script = (
        "import os, ssl, urllib.request\n"
        "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "host, port = os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT']\n"
        "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
        "req = urllib.request.Request(f'https://{host}:{port}/version',\n"
        "    headers={'Authorization': 'Bearer ' + open(sa + '/token').read()})\n"
        "print('api', urllib.request.urlopen(req, context=ctx, timeout=10).status)\n"
    )
    apply_in(kube, namespace, pod("python-api", kube.python_image, ["python3", "-c", script],
                                  host_network=True,
                                  env={"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                       "KUBERNETES_SERVICE_PORT": "6443"}))
    kube.wait_pod_phase(namespace, "python-api", {"Succeeded"}, timeout=180)
    assert kube.logs(namespace, "python-api").strip() == "api 200"


def test_dra_allocation_without_driver(kube, namespace: str, node_name: str) -> None:
    """DRA control plane wiring: a hand-written ResourceSlice is allocated by the scheduler.

    The resourceclaim controller (KCM) makes the claim from the template, the scheduler's
    DynamicResources plugin allocates the published device and reserves the claim for the
    pod, and the kubelet's DRA manager tries to prepare it (and fails: no driver is
    registered for this fake driver name, so the pod never starts).
    """
    driver = f"{namespace}.e2e.example.com"
    slice_name, pod_name = f"{namespace}-slice", "dra-pod"
    objs = [
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": driver},
         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": slice_name},
         "spec": {"driver": driver, "nodeName": node_name,
                  "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
                  "devices": [{"name": "dev-0", "attributes": {"model": {"string": "fake"}}}]}},
    ]
    try:
        for o in objs:
            kube.apply(o)
        tmpl = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "one-dev"},
                "spec": {"spec": {"devices": {"requests": [
                    {"name": "dev", "exactly": {"deviceClassName": driver}}]}}}}
        apply_in(kube, namespace, tmpl)
        p = pod(pod_name, kube.busybox_image, ["sleep", "3600"])
        p["spec"]["resourceClaims"] = [{"name": "c", "resourceClaimTemplateName": "one-dev"}]
        p["spec"]["containers"][0]["resources"] = {"claims": [{"name": "c"}]}
        apply_in(kube, namespace, p)

        deadline = time.monotonic() + 60
        claim: dict = {}
        while time.monotonic() < deadline:
            got = kube.json("get", "pod", "-n", namespace, pod_name)
            statuses = got.get("status", {}).get("resourceClaimStatuses") or []
            if statuses and statuses[0].get("resourceClaimName") and got["spec"].get("nodeName"):
                claim = kube.json("get", "resourceclaims.v1.resource.k8s.io", "-n", namespace,
                                  statuses[0]["resourceClaimName"])
                if claim.get("status", {}).get("allocation"):
                    break
            time.sleep(1)
        else:
            raise AssertionError(f"claim never allocated / pod never scheduled: {json.dumps(claim)[:2000]}")
        assert got["spec"]["nodeName"] == node_name
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["driver"], r["pool"], r["device"]) for r in results] == [(driver, node_name, "dev-0")]
        assert any(r.get("name") == pod_name for r in claim["status"].get("reservedFor", []))

        # the kubelet's DRA manager takes over: with no plugin registered it reports an event
        deadline = time.monotonic() + 60
        events = ""
        while time.monotonic() < deadline:
            events = kube.run("get", "events", "-n", namespace, "--field-selector",
                              f"involvedObject.name={pod_name}", "-o", "json").stdout
            if driver in events and "not registered" in events:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"no kubelet DRA event for {driver}: {events[-2000:]}")
    finally:
        kube.run("delete", "pod", "-n", namespace, pod_name, "--grace-period=0", "--force",
                 "--ignore-not-found", check=False)
        kube.run("delete", "resourceslices.v1.resource.k8s.io", slice_name, "--ignore-not-found",
                 check=False)
        kube.run("delete", "deviceclasses.v1.resource.k8s.io", driver, "--ignore-not-found", check=False)


def test_python_image_has_the_client_library(kube, namespace: str) -> None:
    """The image built with `--wheels dist` (make e2e) carries `timeslice` and its two dependencies."""
    apply_in(kube, namespace, pod("py-client", kube.python_image, [
        "python3", "-c", "import timeslice, grpc, google.protobuf; "
        "print('client', timeslice.TimeSliceOrchestratorClient.__name__)"]))
    kube.wait_pod_phase(namespace, "py-client", {"Succeeded"}, timeout=180)
    assert kube.logs(namespace, "py-client").strip() == "client TimeSliceOrchestratorClient"
