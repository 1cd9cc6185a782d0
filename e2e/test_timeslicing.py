"""Two Jobs from one ResourceClaimTemplate share one physical GPU and alternate.

Host processes, as a node would run them: the kubelet plugin with one fake GPU (4 seats,
so both claims land on it) and the `freeze` backend, and the controller with the
orchestrator inside; each with its ServiceAccount's token (manifests/base RBAC). The
Jobs are manifests/examples/two-jobs-one-gpu (via hack/local-example): their pods run
the client library, and their worker processes are frozen while the other job holds.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e.plugin_fixtures import BASE, PluginProcess, token_kubeconfig, wait

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "hack" / "local-example"
NS = "timeslice-examples"
TARGET = "127.0.0.1:50051"


@pytest.fixture(scope="module")
def stack(kube, node_name, tmp_path_factory):
    for f in ("namespace.yaml", "deviceclass.yaml", "admission-policy.yaml", "rbac-kubelet-plugin.yaml",
              "rbac-controller.yaml"):
        kube.run("apply", "-f", str(BASE / f))
    work = tmp_path_factory.mktemp("stack")
    plugin = PluginProcess(work, token_kubeconfig(kube, "timeslice-kubelet-plugin", work / "plugin.kubeconfig"),
                           node_name, fake_gpus="1xH200")
    plugin.argv[plugin.argv.index("--agent-listen") + 1] = "127.0.0.1:50052"
    plugin.argv += ["--backends", "freeze,none"]
    plugin.start()
    ctl_log = open(work / "controller.log", "ab")
    controller = subprocess.Popen(
        [sys.executable, "-m", "timeslice.cli.main", "controller", "--listen", TARGET, "--agent-template",
         "{node}:50052", "--default-backend", "freeze"], stdout=ctl_log, stderr=subprocess.STDOUT,
        env={**plugin.env, "KUBECONFIG": str(token_kubeconfig(kube, "timeslice-controller",
                                                                work / "controller.kubeconfig"))})
    try:
        wait(lambda: "registered with kubelet" in plugin.text(), 60, "plugin registration")
        wait(lambda: "controller serving" in (work / "controller.log").read_text(), 60, "controller start")
        yield work
    finally:
        kube.run("delete", "-k", str(EXAMPLE), "--ignore-not-found", "--wait=true", "--timeout=120s", check=False,
                 timeout=180)
        controller.terminate()
        controller.wait(timeout=30)
        ctl_log.close()
        plugin.stop()
        print((work / "controller.log").read_text()[-6000:])
        print(plugin.text()[-3000:])


def status() -> list[dict]:
    r = subprocess.run([sys.executable, "-m", "timeslice.cli.main", "status", "--target", TARGET, "--json"],
                       capture_output=True, text=True, timeout=30)
    return json.loads(r.stdout) if r.returncode == 0 else []


@pytest.mark.timeout(400)
def test_two_jobs_share_one_gpu_and_alternate(kube, stack) -> None:
    kube.run("apply", "-k", str(EXAMPLE))
    seen: dict[str, dict] = {}
    conditions: list[dict] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for g in status():
            if len(g.get("agent_targets", [])) and g.get("grants"):
                seen[g["group_id"]] = g
        claims = kube.json("get", "resourceclaims", "-n", NS)["items"]
        for c in claims:
            for d in c.get("status", {}).get("devices", []):
                conditions.append({k["type"]: k["status"] for k in d.get("conditions", [])} | d.get("data", {}))
        done = [j for j in kube.json("get", "jobs", "-n", NS)["items"] if j.get("status", {}).get("succeeded")]
        failed = [j for j in kube.json("get", "jobs", "-n", NS)["items"] if j.get("status", {}).get("failed")]
        assert not failed, kube.run("logs", "-n", NS, "job/" + failed[0]["metadata"]["name"], check=False).stdout
        if len(done) == 2:
            break
        time.sleep(1)
    assert len(done) == 2, "jobs did not finish"
    # one group held both claim sets, and switched between them
    assert len(seen) == 1, seen
    group = next(iter(seen.values()))
    assert int(group.get("switches", 0)) >= 2 and int(group.get("failed_switches", 0)) == 0, group
    # the GPU phases never overlapped, and the state survived every freeze
    phases = []
    for job in ("rl-job-a", "rl-job-b"):
        lines = [json.loads(x) for x in kube.run("logs", "-n", NS, f"job/{job}").stdout.splitlines()
                 if x.startswith("{")]
        assert len(lines) == 5 and all(x["check_ok"] for x in lines), lines
        phases += [(x["start"], x["end"], job) for x in lines]
    phases.sort()
    for (_, e1, j1), (s2, _, j2) in itertools.pairwise(phases):
        assert s2 >= e1 - 0.01, f"{j1} and {j2} computed at the same time"
    assert len({j for _, _, j in phases[:4]}) == 2  # they alternate rather than run one after the other
    # status where users look: claim conditions and Events
    assert any(c.get("LockHeld") == "True" and c.get("groupId") == group["group_id"] for c in conditions), conditions
    assert any(c.get("Resident") == "False" for c in conditions)
    reasons = kube.run("get", "events", "-n", NS, "-o", "jsonpath={.items[*].reason}").stdout.split()
    assert "LockGranted" in reasons and "Switched" in reasons, reasons
