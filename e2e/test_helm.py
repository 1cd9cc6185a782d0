"""The Helm chart (manifests/helm/timeslice-dra) on the local cluster: its default values render
what real kustomize builds from manifests/base, its local values (hack/local-helm-values.yaml)
what it builds from hack/local-driver; then `helm install` with the local values brings up the
driver (plugin and controller Ready, the plugin's ResourceSlice published, a leader serving), and
`helm uninstall` removes every object it made, so that the next tests install the driver again
with kustomize (each e2e test installs what it needs: e2e/test_in_cluster.py, test_manifests.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from e2e.plugin_fixtures import DRIVER, our_slices, wait
from e2e.test_in_cluster import SYSTEM, certificate, pods, ready, serving_leader
from tests.helm_chart import BASE, CHART, LOCAL_VALUES, ROOT, differences, helm, render

RELEASE = "timeslice-dra"
# helm keeps its release record here; the chart's objects go to namespace.name (timeslice-system)
RELEASE_NAMESPACE = "default"


def kustomize(kube, directory) -> list[dict]:
    return [o for o in yaml.safe_load_all(kube.run("kustomize", str(directory)).stdout) if o]


def normalised(objs: list[dict], flag_order: bool = False, service_port: bool = False) -> list[dict]:
    """Copies of `objs` with what may differ between kustomize's output and the chart's made equal:

    - always: whitespace in the CEL of ValidatingAdmissionPolicies. kustomize (kyaml) writes a
      folded block scalar (`>-`) whose lines are more indented back with extra newlines (compare
      `kubectl kustomize manifests/base` with the files); CEL ignores whitespace.
    - flag_order: the options of a container's command as a sorted list of (flag, value)
      (argparse takes them in any order; hack/local-driver replaces the whole command and puts
      --fake-gpus/--backends first).
    - service_port: the orchestrator Service's targetPort. With a hostNetwork controller the
      chart declares no container ports and targets 50051 by number; hack/local-driver keeps
      `grpc`, a name no container declares there (that Service is unused on the local cluster:
      everything dials 127.0.0.1:50051).
    """
    out = copy.deepcopy(objs)
    for o in out:
        if o["kind"] == "ValidatingAdmissionPolicy":
            spec = o["spec"]
            for item in (*spec.get("variables", []), *spec.get("validations", []), *spec.get("matchConditions", [])):
                for field in ("expression", "messageExpression"):
                    if field in item:
                        item[field] = " ".join(item[field].split())
        if flag_order and o["kind"] in ("DaemonSet", "Deployment"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                c["command"] = c["command"][:2] + sorted(options(c["command"][2:]))
        if service_port and o["kind"] == "Service" and o["metadata"]["name"] == "timeslice-orchestrator":
            for p in o["spec"]["ports"]:
                p["targetPort"] = 50051 if p["targetPort"] in ("grpc", 50051) else p["targetPort"]
    return out


def options(argv: list[str]) -> list[str]:
    """`--flag value` and bare `--flag` options of argv, each as one string."""
    out: list[str] = []
    for a in argv:
        if a.startswith("--") or not out:
            out.append(a)
        else:
            out[-1] += " " + a
    return out


def test_default_values_render_what_kustomize_builds_from_manifests_base(kube) -> None:
    diff = differences(normalised(render()), normalised(kustomize(kube, BASE)))
    assert not diff, "\n\n".join(diff)


def test_local_values_render_what_kustomize_builds_from_hack_local_driver(kube) -> None:
    diff = differences(normalised(render(values=[LOCAL_VALUES]), flag_order=True, service_port=True),
                       normalised(kustomize(kube, ROOT / "hack" / "local-driver"), flag_order=True, service_port=True))
    assert not diff, "\n\n".join(diff)


def cluster_objects(kube) -> dict[str, bool]:
    """Whether each cluster-scoped object of the chart, and its namespace, exists."""
    names = {"namespace": SYSTEM, "deviceclass": DRIVER, "clusterrole": "timeslice-controller",
             "clusterrolebinding": "timeslice-kubelet-plugin",
             "validatingadmissionpolicy": "timeslice-kubelet-plugin-own-pod",
             "validatingadmissionpolicybinding": "gpu.timeslice.dev-distinct-gpus"}
    return {f"{kind}/{name}": kube.run("get", kind, name, "-o", "name", check=False).returncode == 0
            for kind, name in names.items()}


def plugin_published(kube: Any) -> str | None:
    """The Ready plugin pod's name once its log says it published (or adopted) the node's 4
    devices (one fake H200, 4 seats) and a ResourceSlice of our driver holds them."""
    pod = next((p for p in pods(kube, "timeslice-kubelet-plugin") if ready(p) and certificate(p)), None)
    if pod is None:
        return None
    log = kube.run("logs", "-n", SYSTEM, pod["metadata"]["name"], check=False).stdout
    if not any(f"{verb} slices=1 devices=4 " in log for verb in ("published", "adopted")):
        return None
    slices = [s for s in our_slices(kube) if s["spec"]["nodeName"] == pod["spec"]["nodeName"]]
    return pod["metadata"]["name"] if [len(s["spec"]["devices"]) for s in slices] == [4] else None


@pytest.mark.timeout(600)
def test_helm_install_brings_up_the_driver_and_uninstall_removes_it(kube) -> None:
    # earlier tests apply parts of manifests/base with kubectl (plugin_fixtures.apply_base) and
    # leave them (later ones apply them again): helm cannot install over objects it does not own
    kube.run("delete", "-k", str(BASE), "--ignore-not-found", "--wait=true", "--timeout=180s", check=False,
             timeout=240)
    wait(lambda: not any(cluster_objects(kube).values()), 180,
         "no driver installed (an earlier test's objects deleted)")
    env = kube.env
    install = helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--values", str(LOCAL_VALUES),
                   env=env, timeout=300)
    try:
        assert install.returncode == 0, install.stdout + install.stderr
        assert "STATUS: deployed" in install.stdout, install.stdout
        plugin = wait(lambda: plugin_published(kube), 180,
                      "the plugin pod Ready, its certificate and its ResourceSlice")
        leader = wait(lambda: serving_leader(kube), 120, "a serving leader controller pod")
        # (its readiness probe runs every 5 s: Ready may come after its log says it serves)
        wait(lambda: any(p["metadata"]["name"] == leader and ready(p) for p in pods(kube, "timeslice-controller")),
             60, f"the leader controller pod {leader} Ready")
        # installed by helm, with the local settings: hostNetwork on 127.0.0.1, the image imported, a fake GPU
        ds = kube.json("get", "daemonset", "-n", SYSTEM, "timeslice-kubelet-plugin")
        assert ds["metadata"]["labels"].get("app.kubernetes.io/managed-by") == "Helm", ds["metadata"]
        assert ds["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
        pod = kube.json("get", "pod", "-n", SYSTEM, plugin)
        assert pod["spec"]["hostNetwork"] is True and pod["status"]["podIP"] == "127.0.0.1"
        assert pod["spec"]["containers"][0]["image"] == "registry.local/timeslice/python:1"
        log = kube.run("logs", "-n", SYSTEM, leader).stdout
        assert "agent_tls=required" in log, log[-3000:]
        status = helm("status", RELEASE, "--namespace", RELEASE_NAMESPACE, env=env, timeout=60)
        assert "STATUS: deployed" in status.stdout, status.stdout + status.stderr
    finally:
        _uninstall(kube)
    releases = helm("list", "--all", "--namespace", RELEASE_NAMESPACE, "--short", env=env, timeout=60)
    assert RELEASE not in releases.stdout.split(), releases.stdout


def _uninstall(kube) -> None:
    uninstall = helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", "--timeout", "180s",
                     env=kube.env, timeout=240)
    assert wait(lambda: not any(cluster_objects(kube).values()), 180, "every object of the release deleted")
    assert uninstall.returncode == 0, uninstall.stdout + uninstall.stderr


@pytest.mark.timeout(600)
def test_gpu_node_values_run_the_plugin_on_gpu_nodes_only_and_it_refuses_a_node_without_the_driver(
        kube, node_name) -> None:
    """Issue 24, item 2, on the local cluster (no GPU, no NVIDIA driver): with
    values-gpu-nodes.yaml (and no fake GPUs) the plugin DaemonSet schedules nothing on a node
    without the GPU label; labelled, the node gets a plugin pod that tolerates the GPU taint,
    mounts the host's root as the driver root, and refuses to start in one line saying that
    the driver is not there and what to set."""
    kube.run("delete", "-k", str(BASE), "--ignore-not-found", "--wait=true", "--timeout=180s", check=False,
             timeout=240)
    wait(lambda: not any(cluster_objects(kube).values()), 180, "no driver installed (an earlier test's objects)")
    install = helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--values", str(LOCAL_VALUES),
                   "--values", str(CHART / "values-gpu-nodes.yaml"), "--set", "devices.fakeGPUs=null",
                   env=kube.env, timeout=300)
    try:
        assert install.returncode == 0, install.stdout + install.stderr
        ds = wait(lambda: (d := kube.json("get", "daemonset", "-n", SYSTEM, "timeslice-kubelet-plugin"))
                  .get("status", {}).get("observedGeneration") and d, 60, "the plugin DaemonSet observed")
        assert ds["status"]["desiredNumberScheduled"] == 0, ds["status"]  # this node has no GPU label
        assert not pods(kube, "timeslice-kubelet-plugin")
        kube.run("label", "node", node_name, "nvidia.com/gpu.present=true")

        def refused() -> dict | None:
            found = pods(kube, "timeslice-kubelet-plugin")
            if not found:
                return None
            name = found[0]["metadata"]["name"]
            waiting = next(iter(found[0].get("status", {}).get("containerStatuses", [])), {}).get("state", {})
            assert "CreateContainer" not in waiting.get("waiting", {}).get("reason", ""), waiting  # never started
            text = "".join(kube.run("logs", "-n", SYSTEM, name, *prev, check=False).stdout for prev in ((), ("-p",)))
            return found[0] if "no NVIDIA driver under the driver root /" in text else None

        pod = wait(refused, 180, "the plugin pod on the labelled node, refusing: no driver")
        spec = pod["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert any(v["name"] == "driver-root" and v["hostPath"]["path"] == "/" for v in spec["volumes"]), spec

        assert not ready(kube.json("get", "pod", "-n", SYSTEM, pod["metadata"]["name"]))
    finally:
        kube.run("label", "node", node_name, "nvidia.com/gpu.present-", check=False)
        _uninstall(kube)
