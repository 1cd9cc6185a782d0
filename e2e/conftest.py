"""End-to-end tests against a real cluster ($KUBECONFIG), e.g. from hack/local-cluster.sh.

    hack/local-cluster.sh up && eval "$(hack/local-cluster.sh env)"
    python -m pytest -m e2e e2e/

Every test here is marked `e2e` and is skipped (with the reason) when KUBECONFIG is
unset or the cluster does not answer.  kubectl is taken from $KUBECTL, PATH, or the
local-cluster build cache.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

BUSYBOX_IMAGE = os.environ.get("TIMESLICE_BUSYBOX_IMAGE", "registry.local/timeslice/busybox:1")
PYTHON_IMAGE = os.environ.get("TIMESLICE_PYTHON_IMAGE", "registry.local/timeslice/python:1")
E2E_DIR = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end test against a real cluster ($KUBECONFIG)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


def find_kubectl() -> str | None:
    if os.environ.get("KUBECTL"):
        return os.environ["KUBECTL"]
    found = shutil.which("kubectl")
    if found:
        return found
    cache = os.environ.get("TIMESLICE_CACHE") or str(Path.home() / ".cache" / "timeslice-dra")
    cands = sorted(glob.glob(f"{cache}/k8s-*/bin/kubectl"))
    return cands[-1] if cands else None


class Kube:
    """Thin kubectl wrapper (subprocess)."""

    def __init__(self, kubectl: str, kubeconfig: str):
        self.kubectl = kubectl
        self.env = dict(os.environ, KUBECONFIG=kubeconfig)
        self.busybox_image = BUSYBOX_IMAGE
        self.python_image = PYTHON_IMAGE

    def run(self, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess:
        p = subprocess.run([self.kubectl, *args], input=input, capture_output=True, text=True,
                           env=self.env, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({p.returncode}):\n"
                                 f"{p.stdout}\n{p.stderr}")
        return p

    def json(self, *args: str) -> dict:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def apply(self, obj: dict, retry_s: float = 30) -> None:
        """Create/update an object; retries while the namespace's ServiceAccount is missing."""
        deadline = time.monotonic() + retry_s
        while True:
            p = self.run("apply", "-f", "-", input=json.dumps(obj), check=False)
            if p.returncode == 0:
                return
            if time.monotonic() > deadline or "serviceaccount" not in p.stderr.lower():
                raise AssertionError(f"kubectl apply failed:\n{p.stdout}\n{p.stderr}")
            time.sleep(1)

    def wait_pod_phase(self, ns: str, name: str, phases: set[str], timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        pod: dict = {}
        while time.monotonic() < deadline:
            pod = self.json("get", "pod", "-n", ns, name)
            phase = pod.get("status", {}).get("phase")
            if phase in phases:
                return pod
            if phase == "Failed":
                break
            time.sleep(1)
        events = self.run("get", "events", "-n", ns, "--field-selector",
                          f"involvedObject.name={name}", check=False).stdout
        raise AssertionError(f"pod {ns}/{name} not in {phases}: "
                             f"{json.dumps(pod.get('status'), indent=1)}\nevents:\n{events}")

    def logs(self, ns: str, name: str) -> str:
        return self.run("logs", "-n", ns, name).stdout


@pytest.fixture(scope="session")
def kube() -> Kube:
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        pytest.skip("e2e: KUBECONFIG is not set (start a cluster: hack/local-cluster.sh up; "
                    "eval \"$(hack/local-cluster.sh env)\")")
    if not all(Path(p).is_file() for p in kubeconfig.split(os.pathsep) if p):
        pytest.skip(f"e2e: KUBECONFIG={kubeconfig} does not exist (is the cluster up?)")
    kubectl = find_kubectl()
    if not kubectl:
        pytest.skip("e2e: no kubectl found ($KUBECTL, PATH or the local-cluster build cache)")
    k = Kube(kubectl, kubeconfig)
    try:
        p = k.run("get", "--raw", "/readyz", check=False, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.skip(f"e2e: cluster at KUBECONFIG={kubeconfig} did not answer within 15s")
    if p.returncode != 0 or p.stdout.strip() != "ok":
        pytest.skip(f"e2e: cluster at KUBECONFIG={kubeconfig} not reachable/ready: "
                    f"{(p.stderr or p.stdout).strip()[:300]}")
    return k


@pytest.fixture(scope="session")
def namespace(kube: Kube):
    ns = f"ts-e2e-{uuid.uuid4().hex[:8]}"
    kube.run("create", "namespace", ns)
    deadline = time.monotonic() + 60
    while kube.run("get", "serviceaccount", "default", "-n", ns, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"namespace {ns}: default ServiceAccount never appeared "
                                 "(kube-controller-manager running?)")
        time.sleep(0.5)
    yield ns
    kube.run("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="session")
def node_name(kube: Kube) -> str:
    nodes = kube.json("get", "nodes")["items"]
    assert nodes, "cluster has no nodes"
    return nodes[0]["metadata"]["name"]
