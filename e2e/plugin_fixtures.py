"""Fixtures for the kubelet-plugin e2e tests: our RBAC applied, the plugin running as a
host process (as the kubelet's node agent would) with the plugin ServiceAccount's token,
and helpers for claims and pods. Imported by e2e/test_kubelet_plugin.py."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "manifests" / "base"
CDI_DIR = Path(os.environ.get("TIMESLICE_CDI_DIR", "/var/run/cdi"))
DRIVER = "gpu.timeslice.dev"


def token_kubeconfig(kube: Any, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates as ServiceAccount timeslice-system/<sa> (least privilege)."""
    admin = yaml.safe_load(Path(kube.env["KUBECONFIG"]).read_text())
    cluster = admin["clusters"][0]["cluster"]
    if "certificate-authority" in cluster:
        cluster = {"server": cluster["server"], "certificate-authority-data": base64.b64encode(
            Path(cluster["certificate-authority"]).read_bytes()).decode()}
    token = kube.run("create", "token", sa, "-n", "timeslice-system", "--duration=3h").stdout.strip()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": sa}}]}))
    return path


def agent_socket(workdir: Path) -> str:
    """The node agent's unix socket for a plugin run in `workdir` (unauthenticated agents
    serve only a unix socket); the host-run controllers reach it there."""
    return f"unix://{workdir}/agent.sock"


class PluginProcess:
    """`timeslice kubelet-plugin` as a host process; restartable."""

    def __init__(self, workdir: Path, kubeconfig: Path, node: str, fake_gpus: str = "2xH200",
                 agent_listen: str | None = None, backends: str = "freeze,none") -> None:
        agent_listen = agent_listen or agent_socket(workdir)
        self.workdir = workdir
        self.log = workdir / "plugin.log"
        self.argv = [sys.executable, "-m", "timeslice.cli.main", "kubelet-plugin", "--node-name", node,
                     "--fake-gpus", fake_gpus, "--seats", "4", "--state-dir", str(workdir / "state"),
                     "--cdi-dir", str(CDI_DIR), "--agent-listen", agent_listen, "--backends", backends,
                     "--orchestrator", "127.0.0.1:50051", "--log-level", "INFO"]
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def apply_base(kube: Any, *files: str) -> None:
    """Apply these files of manifests/base (namespace, DeviceClass, policy, RBAC, ...)."""
    for f in files:
        kube.run("apply", "-f", str(BASE / f))


def node_agent_plugin(kube: Any, workdir: Path, node: str, fake_gpus: str) -> PluginProcess:
    """The plugin as the controllers' node agent (`agent_socket(workdir)`, freeze), with the
    namespace, DeviceClass, policy and both components' RBAC applied; started."""
    apply_base(kube, "namespace.yaml", "deviceclass.yaml", "admission-policy.yaml", "rbac-kubelet-plugin.yaml",
               "rbac-controller.yaml")
    plugin = PluginProcess(workdir, token_kubeconfig(kube, "timeslice-kubelet-plugin", workdir / "plugin.kubeconfig"),
                           node, fake_gpus=fake_gpus)
    plugin.start()
    return plugin


def wait(check: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def our_slices(kube: Any) -> list[dict]:
    return [s for s in kube.json("get", "resourceslices")["items"] if s["spec"]["driver"] == DRIVER]


def claim_template(kube: Any, ns: str, name: str, count: int = 1, constraints: list[dict] | None = None,
                   config: dict | None = None, every_seat_of: str | None = None) -> None:
    """`every_seat_of`: a CEL selector; the request is `allocationMode: All` over the seats it matches."""
    exactly: dict = {"deviceClassName": DRIVER, "count": count}
    if every_seat_of is not None:
        exactly = {"deviceClassName": DRIVER, "allocationMode": "All",
                   "selectors": [{"cel": {"expression": every_seat_of}}]}
    devices: dict = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if constraints:
        devices["constraints"] = constraints
    if config is not None:
        devices["config"] = [{"opaque": {"driver": DRIVER, "parameters": config}}]
    kube.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": ns}, "spec": {"spec": {"devices": devices}}})


def claim_pod(kube: Any, ns: str, name: str, templates: dict[str, str]) -> None:
    """A busybox pod printing its TIMESLICE_ env, with one pod-level claim per template."""
    kube.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
        "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": c, "resourceClaimTemplateName": t} for c, t in templates.items()],
            "containers": [{
                "name": "main", "image": kube.busybox_image, "imagePullPolicy": "Never",
                "command": ["sh", "-c", "env | grep ^TIMESLICE_ | sort; echo ready; sleep 3600"],
                "resources": {"claims": [{"name": c} for c in templates]}}]}})


def pod_claims(kube: Any, ns: str, pod: str) -> dict[str, dict]:
    """{pod-level claim name: the ResourceClaim object}."""
    statuses = kube.json("get", "pod", "-n", ns, pod)["status"].get("resourceClaimStatuses", [])
    return {s["name"]: kube.json("get", "resourceclaim", "-n", ns, s["resourceClaimName"]) for s in statuses}


def devices_of(claim: dict) -> list[str]:
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]


def pod_env(kube: Any, ns: str, pod: str) -> dict[str, str]:
    out = wait(lambda: "ready" in kube.run("logs", "-n", ns, pod, check=False).stdout and
               kube.run("logs", "-n", ns, pod).stdout, 60, f"pod {pod} output")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def checkpoint_claims(workdir: Path) -> dict:
    path = workdir / "state" / "checkpoint.json"
    return json.loads(path.read_text())["claims"] if path.exists() else {}
