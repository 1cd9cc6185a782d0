"""The two-jobs-one-gpu example run and checked: shared by the e2e tests that run the
driver as host processes (test_timeslicing.py) and as installed pods (test_in_cluster.py).

Reads the interleaving where users look: `timeslice status` (orchestrator on
127.0.0.1:50051), the claims' `status.devices`, the claims' Events and the jobs' logs.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "hack" / "local-example"
NS = "timeslice-examples"
TARGET = "127.0.0.1:50051"


_token: dict[str, str] = {}


def status(kube) -> list[dict]:
    """`timeslice status --json` as an admin would run it against an orchestrator with
    `--auth tokenreview`: a token from `kubectl create token` (audience timeslice.dev) in
    $TIMESLICE_TOKEN_FILE. [] while the orchestrator is not up; an auth error fails."""
    if "file" not in _token:
        token = kube.run("create", "token", "default", "-n", "default", "--audience", "timeslice.dev",
                         "--duration", "2h").stdout.strip()
        path = Path(tempfile.mkdtemp(prefix="timeslice-e2e-")) / "token"
        path.write_text(token)
        path.chmod(0o600)
        _token["file"] = str(path)
    r = subprocess.run([sys.executable, "-m", "timeslice.cli.main", "status", "--target", TARGET, "--json"],
                       capture_output=True, text=True, timeout=30,
                       env={**os.environ, "TIMESLICE_TOKEN_FILE": _token["file"]})
    if "UNAUTHENTICATED" in r.stderr or "PERMISSION_DENIED" in r.stderr:
        raise AssertionError(f"timeslice status refused: {r.stderr.strip()}")
    return json.loads(r.stdout) if r.returncode == 0 else []


def not_finished(kube, ns: str) -> str:
    """Why Jobs of `ns` did not finish, for an assertion's message: its pods (phase, each
    container's state), the namespace's last Warning events, each group's `timeslice status`."""
    pods = []
    for pod in kube.json("get", "pods", "-n", ns)["items"]:
        states = [f"{c['name']}={json.dumps(c.get('state'))} restarts={c.get('restartCount', 0)}"
                  for c in pod.get("status", {}).get("containerStatuses", [])]
        pods.append(f"{pod['metadata']['name']}: {pod.get('status', {}).get('phase')} {' '.join(states)}")
    events = kube.run("get", "events", "-n", ns, "--field-selector", "type=Warning", "--sort-by=.lastTimestamp",
                      check=False).stdout.splitlines()[-15:]
    groups = [{k: g.get(k) for k in ("group_id", "phase", "holder", "waiters", "switches", "failed_switches")}
              for g in status(kube)]
    return "\n".join(["pods:", *pods, "warning events:", *events, "groups:", *map(json.dumps, groups)])


def recorded_holders(kube) -> set[str]:
    """The holders the example's claims record in their status (what a new leader adopts)."""
    return {d.get("data", {}).get("holder") for c in kube.json("get", "resourceclaims", "-n", NS)["items"]
            for d in c.get("status", {}).get("devices", [])} - {None, ""}


def run_example_and_check(kube, during=lambda: None, layout: Path = EXAMPLE) -> dict:
    """Apply the example (or another `layout` of its two Jobs), call `during()` every 0.5 s
    until both Jobs succeeded, check the interleaving; returns the group's last
    `timeslice status` (a dict)."""
    kube.run("apply", "-k", str(layout))
    seen: dict[str, dict] = {}
    conditions: list[dict] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for g in status(kube):
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
        during()
        time.sleep(0.5)
    assert len(done) == 2, f"jobs did not finish\n{not_finished(kube, NS)}"
    # one group held both claim sets, and switched between them
    assert len(seen) == 1, seen
    group = next(iter(seen.values()))
    assert int(group.get("switches", 0)) >= 1 and int(group.get("failed_switches", 0)) == 0, group
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
    return group
