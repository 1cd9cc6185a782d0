"""Job identity of a pod: override, label, controller owner (lifted for JobSet and
Deployment), the pod itself; ids always valid for the orchestrator."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from timeslice.controller.jobs import ID_PATTERN, job_id, safe_id


def pod(name: str = "p-0", ns: str = "team", labels: dict[str, str] | None = None,
        owners: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "labels": labels or {}, "ownerReferences": owners or []}}


def owner(kind: str, name: str, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": kind, "name": name, "uid": "u", "controller": controller}


def test_pod_alone() -> None:
    assert job_id(pod("solo")) == "team/pod/solo"


def test_controller_owner_kind_lowercased() -> None:
    assert job_id(pod(owners=[owner("Job", "train-a")])) == "team/job/train-a"
    assert job_id(pod(owners=[owner("RayCluster", "rl")])) == "team/raycluster/rl"


def test_only_the_controller_owner_counts() -> None:
    assert job_id(pod(owners=[owner("ConfigMap", "x", controller=False)])) == "team/pod/p-0"
    assert job_id(pod(owners=[owner("ConfigMap", "x", controller=False), owner("Job", "j")])) == "team/job/j"


def test_jobset_pods_belong_to_their_jobset_not_the_child_job() -> None:
    labels = {"jobset.sigs.k8s.io/jobset-name": "spmd"}
    a = pod("spmd-workers-0-0", labels=labels, owners=[owner("Job", "spmd-workers-0")])
    b = pod("spmd-workers-1-0", labels=labels, owners=[owner("Job", "spmd-workers-1")])
    assert job_id(a) == job_id(b) == "team/jobset/spmd"


def test_replicaset_stands_for_its_deployment() -> None:
    p = pod(labels={"pod-template-hash": "5d8f7c"}, owners=[owner("ReplicaSet", "server-5d8f7c")])
    assert job_id(p) == "team/deployment/server"
    # a ReplicaSet not named after a template hash stays itself
    q = pod(labels={"pod-template-hash": "abc"}, owners=[owner("ReplicaSet", "rs-by-hand")])
    assert job_id(q) == "team/replicaset/rs-by-hand"


def test_label_beats_owner_and_override_beats_label() -> None:
    p = pod(labels={"timeslice.dev/job": "grpo-a"}, owners=[owner("Job", "j")])
    assert job_id(p) == "team/grpo-a"
    assert job_id(p, override="shared-name") == "team/shared-name"


def test_override_is_namespaced() -> None:
    """Two namespaces naming the same job never become one job."""
    assert job_id(pod(ns="a"), "x") != job_id(pod(ns="b"), "x")


def test_long_or_odd_ids_are_shortened_deterministically() -> None:
    long_name = "n" * 253
    got = job_id(pod(owners=[owner("Job", long_name)]))
    assert ID_PATTERN.fullmatch(got) and len(got) <= 253 and got.startswith("team/job/nnn")
    assert got == job_id(pod(owners=[owner("Job", long_name)]))
    assert got != job_id(pod(owners=[owner("Job", long_name + "x")]))
    odd = job_id(pod(), override="my job #1")
    assert ID_PATTERN.fullmatch(odd) and odd.startswith("team/my-job--1@")


def test_trailing_newline_is_not_an_id() -> None:
    assert safe_id("a\n") != "a\n" and ID_PATTERN.fullmatch(safe_id("a\n"))


@given(st.text(min_size=0, max_size=400))
def test_safe_id_is_always_valid(raw: str) -> None:
    out = safe_id(raw)
    assert ID_PATTERN.fullmatch(out), out
    assert safe_id(raw) == out
    if ID_PATTERN.fullmatch(raw):
        assert out == raw
