"""The driver installed as users install it (manifests/base through hack/local-driver):
the node plugin as a DaemonSet pod (one fake GPU, `freeze` backend), the controller as a
Deployment of two leader-elected replicas. The controller finds the node agent from the
plugin pod (no `--agent-template`) and calls it with its projected ServiceAccount token,
which the agent checks with TokenReview; the example's two Jobs alternate on one GPU, and
deleting the leader controller pod mid-run keeps the group working.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from e2e.example_check import EXAMPLE, run_example_and_check, status
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


def logs(kube, app: str) -> str:
    return kube.run("logs", "-n", SYSTEM, "-l", f"app.kubernetes.io/name={app}", "--tail=200", "--prefix",
                    check=False).stdout


@pytest.fixture(scope="module")
def installed(kube):
    kube.run("apply", "-k", str(DRIVER_OVERLAY), timeout=120)
    try:
        wait(lambda: any(ready(p) for p in pods(kube, "timeslice-kubelet-plugin")), 120, "the plugin pod Ready")
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

    def delete_leader_after_two_switches() -> None:
        if not deleted and any(int(g.get("switches", 0)) >= 2 for g in status()):
            time.sleep(0.4)  # let the claim status record the current holder
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
