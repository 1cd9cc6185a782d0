"""The ValidatingAdmissionPolicy of manifests/base rejects multi-seat requests without a
distinct-GPU constraint (matchAttribute on the seat, distinctAttribute on the physical GPU,
or a selector pinning seat 0) at apply time, with a message that says how to fix them;
`allocationMode: All` (a whole GPU, an admin-access monitor) is accepted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "manifests" / "base" / "admission-policy.yaml"


SEAT_ZERO = 'device.attributes["gpu.timeslice.dev"].seat == 0'


def claim(name: str, count: int, constraints: list[dict] | None = None, selector: str | None = None) -> dict:
    exactly: dict = {"deviceClassName": "gpu.timeslice.dev", "count": count}
    if selector is not None:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    devices: dict = {"requests": [{"name": "gpus", "exactly": exactly}]}
    if constraints is not None:
        devices["constraints"] = constraints
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": devices}}


@pytest.fixture
def policy(kube):
    kube.run("apply", "-f", str(POLICY))
    deadline = time.monotonic() + 30  # the policy is enforced once the API server has compiled it
    while time.monotonic() < deadline:
        probe = kube.run("create", "--dry-run=server", "-f", "-", "-n", "default",
                         input=yaml.safe_dump(claim("probe", 2)), check=False)
        if probe.returncode != 0:
            break
        time.sleep(0.5)
    yield
    kube.run("delete", "-f", str(POLICY), "--ignore-not-found", check=False)


def test_count_two_without_seat_constraint_is_rejected(kube, namespace, policy) -> None:
    r = kube.run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(claim("two", 2)), check=False)
    assert r.returncode != 0
    assert "ask for more than one gpu.timeslice.dev device" in r.stderr
    assert "matchAttribute: gpu.timeslice.dev/seat" in r.stderr


@pytest.mark.parametrize("constraint, selector", [
    ({"matchAttribute": "gpu.timeslice.dev/seat"}, None),
    ({"matchAttribute": "gpu.timeslice.dev/seat", "requests": ["gpus"]}, None),
    ({"distinctAttribute": "gpu.timeslice.dev/physicalGpu"}, None),
    (None, SEAT_ZERO),  # one seat per GPU: two devices are two GPUs (issue 11, item 7)
    (None, "device.attributes['gpu.timeslice.dev'].seat==0"),
])
def test_constraints_that_guarantee_distinct_gpus_and_count_one_are_accepted(kube, namespace, policy, constraint,
                                                                             selector) -> None:
    two = claim("two-ok", 2, [constraint] if constraint else None, selector)
    kube.run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(two))
    kube.run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(claim("one", 1)))
    kube.run("delete", "-n", namespace, "resourceclaim", "two-ok", "one")


def test_a_selector_that_does_not_pin_seat_zero_is_rejected(kube, namespace, policy) -> None:
    r = kube.run("create", "-n", namespace, "-f", "-", check=False,
                 input=yaml.safe_dump(claim("loose", 2, selector=SEAT_ZERO + " || true")))
    assert r.returncode != 0 and "request(s) gpus" in r.stderr


def test_template_is_checked_too(kube, namespace, policy) -> None:
    tmpl = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
            "spec": {"spec": claim("x", 3)["spec"]}}
    r = kube.run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(tmpl), check=False)
    assert r.returncode != 0 and "request(s) gpus" in r.stderr


@pytest.mark.parametrize("admin", [False, True], ids=["whole-gpu", "admin-monitor"])
def test_allocation_mode_all_is_accepted(kube, namespace, policy, admin) -> None:
    """Issue 11, item 6: every seat of GPU 0 to one claim (exclusive), or every seat of the
    node to an admin-access monitor."""
    c = claim("all", 1, selector=None if admin else "device.attributes['gpu.timeslice.dev'].index == 0")
    exactly = c["spec"]["devices"]["requests"][0]["exactly"]
    del exactly["count"]
    exactly["allocationMode"] = "All"
    if admin:
        exactly["adminAccess"] = True  # allowed in namespaces labelled resource.kubernetes.io/admin-access
        kube.run("label", "namespace", namespace, "resource.kubernetes.io/admin-access=true", "--overwrite")
    r = kube.run("create", "-n", namespace, "-f", "-", "--dry-run=server", input=yaml.safe_dump(c), check=False)
    assert r.returncode == 0, r.stderr
