"""The driver installed as users install it (manifests/base through hack/local-driver):
the node plugin as a DaemonSet pod (one fake GPU, `freeze` backend), the controller as a
Deployment of two leader-elected replicas. The controller finds the node agent from the
plugin pod (no `--agent-template`) and calls it with its projected ServiceAccount token,
which the agent checks with TokenReview, over TLS pinning the certificate the plugin
publishes on its pod (`--agent-tls`, `--require-agent-tls`); the example's two Jobs
alternate on one GPU, and deleting the leader controller pod mid-run keeps the group
working; the liveness probes restart a stopped plugin and a stopped standby controller.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from timeslice.driver.certificates import fingerprint
from timeslice.driver.names import AGENT_CERTIFICATE_ANNOTATION, AGENT_TLS_SERVER_NAME

from e2e.example_check import EXAMPLE, recorded_holders, run_example_and_check, status
from e2e.plugin_fixtures import DRIVER, our_slices, wait

DRIVER_OVERLAY = Path(__file__).resolve().parent.parent / "hack" / "local-driver"
SYSTEM = "timeslice-system"


def pods(kube, app: str) -> list[dict]:
    return kube.json("get", "pods", "-n", SYSTEM, "-l", f"app.kubernetes.io/name={app}")["items"]


def ready(pod: dict) -> bool:
    return pod.get("metadata", {}).get("deletionTimestamp") is None and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def lease_holder(kube) -> str:
    lease = kube.run("get", "lease", "-n", SYSTEM, "timeslice-controller", "-o",
                     "jsonpath={.spec.holderIdentity}", check=False)
    return lease.stdout.strip() if lease.returncode == 0 else ""


def serving_leader(kube) -> str | None:
    """The controller pod that holds the Lease and serves (its log says so)."""
    holder = lease_holder(kube)
    if not holder or not any(p["metadata"]["name"] == holder for p in pods(kube, "timeslice-controller")):
        return None
    log = kube.run("logs", "-n", SYSTEM, holder, check=False).stdout
    return holder if "controller serving" in log else None


def certificate(pod: dict) -> str | None:
    """The agent certificate (PEM) the plugin pod publishes, if any."""
    return (pod.get("metadata", {}).get("annotations") or {}).get(AGENT_CERTIFICATE_ANNOTATION)


def agent_health(target: str, pem: str | None) -> int:
    """grpc.health.v1 of the node agent at `target`: over TLS pinning `pem` (as the
    controller dials), or plaintext when `pem` is None. Raises grpc.RpcError."""
    if pem is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=pem.encode()),
                                      options=[("grpc.ssl_target_name_override", AGENT_TLS_SERVER_NAME)])
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def logs(kube, app: str) -> str:
    return kube.run("logs", "-n", SYSTEM, "-l", f"app.kubernetes.io/name={app}", "--tail=200", "--prefix",
                    check=False).stdout


@pytest.fixture(scope="module")
def installed(kube):
    kube.run("apply", "-k", str(DRIVER_OVERLAY), timeout=120)
    try:
        wait(lambda: any(ready(p) for p in pods(kube, "timeslice-kubelet-plugin")), 120, "the plugin pod Ready")
        # the controller requires TLS (--require-agent-tls): no switch before the certificate is out
        wait(lambda: any(ready(p) and certificate(p) for p in pods(kube, "timeslice-kubelet-plugin")), 60,
             f"the plugin pod's {AGENT_CERTIFICATE_ANNOTATION} annotation")
        wait(lambda: our_slices(kube), 60, f"ResourceSlices of {DRIVER}")
        wait(lambda: serving_leader(kube), 120, "a serving leader controller pod")
        yield
    finally:
        kube.run("delete", "-k", str(EXAMPLE), "--ignore-not-found", "--wait=true", "--timeout=120s", check=False,
                 timeout=180)
        print(logs(kube, "timeslice-controller")[-6000:])
        print(logs(kube, "timeslice-kubelet-plugin")[-3000:])
        kube.run("delete", "-k", str(DRIVER_OVERLAY), "--ignore-not-found", "--wait=true", "--timeout=120s",
                 check=False, timeout=180)


@pytest.mark.timeout(500)
def test_installed_driver_alternates_jobs_and_survives_deleting_the_leader_pod(kube, installed) -> None:
    first = serving_leader(kube)
    assert first is not None
    deleted: list[float] = []
    switched: list[bool] = []

    def delete_leader_after_two_switches() -> None:
        """Called between polls: at the first poll, once two switches were seen at any poll,
        where a claim's status records a holder (what the next leader adopts). (Not both at
        one poll: a poll takes seconds on a loaded machine, and the example's jobs hold 1 s.)"""
        if deleted:
            return
        if not switched and any(int(g.get("switches", 0)) >= 2 for g in status(kube)):
            switched.append(True)
        if switched and recorded_holders(kube):
            kube.run("delete", "pod", "-n", SYSTEM, first, "--wait=false")
            deleted.append(time.monotonic())

    group = run_example_and_check(kube, during=delete_leader_after_two_switches)
    assert deleted, "the leader pod was never deleted"
    second = wait(lambda: serving_leader(kube), 60, "a new serving leader")
    assert second != first
    log = kube.run("logs", "-n", SYSTEM, second).stdout
    assert f"agents=plugin pods in {SYSTEM}" in log, log[-3000:]
    assert "adopted group=" in log, log[-3000:]
    # the node agent was found from the plugin pod (hostNetwork: its IP is the node's, 127.0.0.1)
    plugin = next(p for p in pods(kube, "timeslice-kubelet-plugin") if ready(p))
    assert group["agent_targets"] == [f"{plugin['status']['podIP']}:50052"], group
    # the switches went through an agent that takes only the controller's token
    assert "agent_token_file=/var/run/secrets/timeslice.dev/node-agent/token" in log, log[-3000:]
    plugin_log = kube.run("logs", "-n", SYSTEM, plugin["metadata"]["name"]).stdout
    assert "agent_auth=tokenreview" in plugin_log, plugin_log[-3000:]
    # ... over TLS: the plugin pod publishes its certificate, the leader pinned exactly that one
    # (it dials lazily: its takeover listed the agent's jobs, and the switches went through it)
    pem = certificate(plugin)
    assert pem and pem.startswith("-----BEGIN CERTIFICATE-----"), plugin["metadata"].get("annotations")
    fp = fingerprint(pem)
    assert "agent_tls=on" in plugin_log, plugin_log[-3000:]
    assert (f"agent certificate published pod={SYSTEM}/{plugin['metadata']['name']} "
            f"annotation={AGENT_CERTIFICATE_ANNOTATION} certificate={fp}") in plugin_log, plugin_log[-3000:]
    assert "agent_tls=required" in log, log[-3000:]
    target = group["agent_targets"][0]
    assert f"agent channel target={target} tls=pinned certificate={fp}" in log, log[-3000:]
    assert "tls=off" not in log and "agent refused" not in log, log[-3000:]
    # the agent port speaks TLS only: a caller pinning the published certificate gets an
    # answer, a plaintext one does not (run here, on the node: hostNetwork on 127.0.0.1)
    assert agent_health(target, pem) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        agent_health(target, None)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_plugin_may_annotate_only_its_own_pod(kube, installed) -> None:
    """manifests/base/plugin-pod-policy.yaml: with a token bound to its pod, the plugin may set
    its own certificate annotation, and nothing else: not on another pod (here a controller
    pod on the same node), not another annotation, and not with a token bound to no pod."""
    plugin = next(p for p in pods(kube, "timeslice-kubelet-plugin") if ready(p))["metadata"]["name"]
    other = pods(kube, "timeslice-controller")[0]["metadata"]["name"]
    cert = kube.run("get", "pod", "-n", SYSTEM, plugin, "-o",
                    r"jsonpath={.metadata.annotations.timeslice\.dev/agent-certificate}").stdout

    def as_plugin(token: str, *args: str):
        return kube.run("--token", token, "--kubeconfig", "/dev/null", "--server", "https://127.0.0.1:6443",
                        "--insecure-skip-tls-verify", "-n", SYSTEM, *args, check=False)

    bound = kube.run("create", "token", "-n", SYSTEM, "timeslice-kubelet-plugin", "--bound-object-kind", "Pod",
                     "--bound-object-name", plugin).stdout.strip()
    unbound = kube.run("create", "token", "-n", SYSTEM, "timeslice-kubelet-plugin").stdout.strip()
    ok = as_plugin(bound, "annotate", "--overwrite", "pod", plugin, f"timeslice.dev/agent-certificate={cert}")
    assert ok.returncode == 0, ok.stderr
    for token, args, why in (
            (bound, ("annotate", "pod", other, "timeslice.dev/agent-certificate=forged"), "only its own pod"),
            (bound, ("annotate", "pod", plugin, "x=y"), "only the annotation timeslice.dev/agent-certificate"),
            (bound, ("label", "pod", plugin, "x=y"), "only the annotation timeslice.dev/agent-certificate"),
            (unbound, ("annotate", "--overwrite", "pod", plugin, "timeslice.dev/agent-certificate=forged"),
             "its token names none")):
        r = as_plugin(token, *args)
        assert r.returncode != 0 and "Forbidden" in r.stderr and why in r.stderr, (args, r.stderr)


def host_pid(pod: dict, word: str) -> int:
    """The host pid of the pod's `timeslice <word>` process (its cgroup names the pod uid)."""
    uid = pod["metadata"]["uid"]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            cgroup = (proc / "cgroup").read_text()
        except OSError:
            continue
        if word.encode() in cmdline and any(b"timeslice" in a for a in cmdline[:2]) and (
                uid in cgroup or uid.replace("-", "_") in cgroup):
            return int(proc.name)
    raise AssertionError(f"no timeslice {word} process of pod {pod['metadata']['name']} on this host")


def restarts(pod: dict) -> int:
    return sum(c.get("restartCount", 0) for c in pod.get("status", {}).get("containerStatuses", []))


@pytest.mark.timeout(300)
def test_liveness_probes_restart_a_stopped_plugin_and_controller(kube, installed) -> None:
    """Issue 12, item 1: the plugin and a standby controller (it serves no port) are stopped
    (SIGSTOP: a wedged process that still exists). Their heartbeat files age, the liveness
    probes fail with the reason, and the kubelet restarts both containers, which come back Ready."""
    plugin = next(p for p in pods(kube, "timeslice-kubelet-plugin") if ready(p))
    leader_name = wait(lambda: serving_leader(kube), 60, "a serving leader")
    standby = wait(lambda: next((p for p in pods(kube, "timeslice-controller")
                                 if ready(p) and p["metadata"]["name"] != leader_name), None), 120, "a Ready standby")
    stopped = {p["metadata"]["name"]: (p, restarts(p)) for p in (plugin, standby)}
    for pod, word in ((plugin, "kubelet-plugin"), (standby, "controller")):
        os.kill(host_pid(pod, word), signal.SIGSTOP)

    def restarted_and_ready() -> bool:
        now = {p["metadata"]["name"]: p for app in ("timeslice-kubelet-plugin", "timeslice-controller")
               for p in pods(kube, app)}
        return all(name in now and restarts(now[name]) > before and ready(now[name])
                   for name, (_, before) in stopped.items())

    wait(restarted_and_ready, 150, "both stopped containers restarted by their liveness probes and Ready")
    for name in stopped:
        events = kube.run("get", "events", "-n", SYSTEM, "--field-selector", f"involvedObject.name={name}", "-o",
                          "jsonpath={.items[*].message}").stdout
        assert "Liveness probe failed" in events and "heartbeat" in events, events
    wait(lambda: our_slices(kube), 60, "the restarted plugin's ResourceSlices")
