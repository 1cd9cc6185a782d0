"""Claim sets and lock groups from claims, pods and slices (controller/grouping.py)."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
from timeslice.cli.main import main as cli
from timeslice.controller.grouping import (
    CONFLICTING_GROUP_CONFIG,
    CONFLICTING_JOB_CONFIG,
    INVALID_CONFIG,
    UNKNOWN_DEVICE,
    PhysicalGpu,
    Snapshot,
    compute,
    diff,
    group_id,
    physical_gpus,
)
from timeslice.controller.jobs import ID_PATTERN
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server
from timeslice.controller.orchestrator.service import group_status
from timeslice.controller.reconciler import Reconciler, aliases, group_spec
from timeslice.driver import names
from timeslice.driver.errors import FailedPrecondition

from tests.cluster_objects import OTHER_DRIVER, World, gpu_uuid, slice_obj, ts_config


def one_node(gpus: int = 2) -> World:
    w = World()
    w.node("node-a", gpus=gpus)
    return w


def only_group(s: Snapshot):
    assert len(s.groups) == 1, s.groups
    return next(iter(s.groups.values()))


def test_physical_gpus_from_slices() -> None:
    table = physical_gpus([slice_obj("node-a", gpus=2, seats=2),
                           slice_obj("node-b", gpus=1, seats=1, attribute="uuid"),
                           slice_obj("node-c", driver=OTHER_DRIVER)])
    h200 = ("NVIDIA H200", "580.159.4")
    assert table[("node-a", "gpu-1-seat-0")] == PhysicalGpu(gpu_uuid("node-a", 1), "node-a", *h200)
    assert table[("node-a", "gpu-1-seat-1")] == table[("node-a", "gpu-1-seat-0")]
    assert table[("node-b", "gpu-0-seat-0")] == PhysicalGpu(gpu_uuid("node-b", 0), "node-b", *h200)  # uuid fallback
    assert not [k for k in table if k[0] == "node-c"]
    assert len(table) == 5


def test_physical_gpus_qualified_attribute_and_newest_generation() -> None:
    old = slice_obj("node-a", gpus=1, seats=1, generation=1)
    new = slice_obj("node-a", gpus=1, seats=1, generation=2)
    new["spec"]["devices"][0]["attributes"] = {f"{names.DRIVER_NAME}/physicalGpu": {"string": "GPU-new"}}
    assert physical_gpus([old, new]) == {("node-a", "gpu-0-seat-0"): PhysicalGpu("GPU-new", "node-a")}


def test_two_jobs_on_two_seats_of_one_gpu_are_one_group() -> None:
    w = one_node()
    a, b = w.pod("a-0", owner=("Job", "a")), w.pod("b-0", owner=("Job", "b"))
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")])
    w.claim(b, "gpu", [("node-a", "gpu-0-seat-1")])
    s = w.snapshot()
    g = only_group(s)
    assert [cs.id for cs in g.claim_sets] == ["ns/job/a:gpu", "ns/job/b:gpu"]
    assert g.gpus == (gpu_uuid("node-a", 0),) and g.nodes == ("node-a",)
    assert g.id == group_id([gpu_uuid("node-a", 0)]) and ID_PATTERN.fullmatch(g.id)
    assert g.jobs == ("ns/job/a", "ns/job/b")
    assert g.backend == "auto" and g.lease_seconds == names.DEFAULT_LEASE_SECONDS
    assert s.group_of == {"ns/job/a:gpu": g.id, "ns/job/b:gpu": g.id}
    assert s.warnings == ()


def test_claims_on_different_gpus_are_separate_groups() -> None:
    w = one_node()
    a, b = w.pod("a-0", job="a"), w.pod("b-0", job="b")
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")])
    w.claim(b, "gpu", [("node-a", "gpu-1-seat-0")])
    s = w.snapshot()
    assert len(s.groups) == 2
    assert sorted(len(g.claim_sets) for g in s.groups.values()) == [1, 1]


def test_async_rl_trainers_share_samplers_stay_alone() -> None:
    """A.trainer and B.trainer share GPU 0; A.sampler on GPU 1, B.sampler on GPU 2."""
    w = one_node(gpus=3)
    a_train, a_sample = w.pod("a-trainer", job="a"), w.pod("a-sampler", job="a")
    b_train, b_sample = w.pod("b-trainer", job="b"), w.pod("b-sampler", job="b")
    w.claim(a_train, "trainer", [("node-a", "gpu-0-seat-0")])
    w.claim(b_train, "trainer", [("node-a", "gpu-0-seat-1")])
    w.claim(a_sample, "sampler", [("node-a", "gpu-1-seat-0")])
    w.claim(b_sample, "sampler", [("node-a", "gpu-2-seat-0")])
    s = w.snapshot()
    members = sorted(tuple(cs.id for cs in g.claim_sets) for g in s.groups.values())
    assert members == [("ns/a:sampler",), ("ns/a:trainer", "ns/b:trainer"), ("ns/b:sampler",)]
    # job a is in two groups
    assert s.group_of["ns/a:trainer"] != s.group_of["ns/a:sampler"]
    assert s.claim_set("ns/a", "sampler").gpus == (gpu_uuid("node-a", 1),)


def test_multi_node_spmd_claim_set_spans_nodes_and_switches_as_one() -> None:
    """One job, one pod per node, each with its own claim from the template `trainer`:
    one claim set on two nodes; a second such job on the same GPUs joins its group."""
    w = World()
    w.node("node-a", gpus=1)
    w.node("node-b", gpus=1)
    for job, seat in (("spmd-1", 0), ("spmd-2", 1)):
        for node in ("node-a", "node-b"):
            p = w.pod(f"{job}-{node}", owner=("Job", job), node=node)
            w.claim(p, "trainer", [(node, f"gpu-0-seat-{seat}")])
    s = w.snapshot()
    cs = s.claim_set("ns/job/spmd-1", "trainer")
    assert cs is not None
    assert [c.name for c in cs.claims] == ["spmd-1-node-a-trainer", "spmd-1-node-b-trainer"]
    assert cs.nodes == ("node-a", "node-b") and len(cs.pods) == 2
    assert cs.gpus == (gpu_uuid("node-a", 0), gpu_uuid("node-b", 0))
    g = only_group(s)
    assert g.nodes == ("node-a", "node-b") and len(g.claim_sets) == 2


def test_claims_kube_scheduler_makes_for_the_extended_resource_form_one_claim_set_per_job() -> None:
    """Issue 12, item 13: pods that ask for `timeslice.dev/gpu` (DRAExtendedResource) have
    no `spec.resourceClaims`; their claims, named in `status.extendedResourceClaimStatus`,
    are the job's claim set `timeslice.dev/gpu`, locked by that name, beside a job with a
    template claim on the same GPU. The controller's trimmed pods keep what this needs."""
    from timeslice.controller.cluster_state import trim_claim, trim_pod

    w = one_node()
    for i in range(2):
        w.extended_claim(w.pod(f"ext-{i}", owner=("Job", "ext")), "timeslice.dev/gpu", [("node-a", f"gpu-0-seat-{i}")])
    w.claim(w.pod("b-0", owner=("Job", "b")), "gpu", [("node-a", "gpu-0-seat-2")])
    trimmed = compute([trim_claim(c) for c in w.claims], [trim_pod(p) for p in w.pods], physical_gpus(w.slices))
    assert trimmed == w.snapshot()
    cs = trimmed.claim_set("ns/job/ext", "timeslice.dev/gpu")
    assert cs is not None and cs.handles == ("timeslice.dev/gpu",) and len(cs.pods) == 2
    assert [c.name for c in cs.claims] == ["ext-0-extended-resources-x1", "ext-1-extended-resources-x1"]
    assert [c.id for c in only_group(trimmed).claim_sets] == ["ns/job/b:gpu", "ns/job/ext:timeslice.dev/gpu"]


def test_shared_claim_counts_for_each_pod_of_the_job_once() -> None:
    w = one_node()
    p0, p1 = w.pod("w-0", owner=("Job", "w")), w.pod("w-1", owner=("Job", "w"))
    c = w.claim(p0, "gpu", [("node-a", "gpu-0-seat-0")], name="shared")
    p0["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared"}]
    p0["status"]["resourceClaimStatuses"] = []
    w.share(c, p1, "gpu")
    cs = only_group(w.snapshot()).claim_sets
    assert len(cs) == 1 and len(cs[0].claims) == 1 and len(cs[0].pods) == 2


def test_admin_access_claims_and_results_are_never_members() -> None:
    w = one_node()
    job, admin = w.pod("job-0", job="j"), w.pod("monitor", job="mon")
    w.claim(job, "gpu", [("node-a", "gpu-0-seat-0")])
    w.claim(admin, "gpu", [("node-a", "gpu-0-seat-1")], admin=True)
    s = w.snapshot()
    assert list(s.claim_sets) == ["ns/j:gpu"]
    # admin access named only on the request (result flag absent) is excluded too
    w.claims[1]["status"]["allocation"]["devices"]["results"][0].pop("adminAccess")
    assert list(w.snapshot().claim_sets) == ["ns/j:gpu"]


def test_other_drivers_are_ignored() -> None:
    w = one_node()
    p, q = w.pod("p", job="p"), w.pod("q", job="q")
    w.claim(p, "gpu", [("node-a", "gpu-0-seat-0")], driver=OTHER_DRIVER)
    mixed = w.claim(q, "gpu", [("node-a", "gpu-0-seat-1")])
    mixed["status"]["allocation"]["devices"]["results"].append(
        {"request": "nic", "driver": OTHER_DRIVER, "pool": "node-a", "device": "gpu-0-seat-0"})
    s = w.snapshot()
    assert list(s.claim_sets) == ["ns/q:gpu"]
    assert s.claim_set("ns/q", "gpu").devices == (("node-a", "gpu-0-seat-1"),)


def test_unreserved_finished_and_unallocated_are_left_out() -> None:
    w = one_node()
    pending, done, running = w.pod("pending", job="x"), w.pod("done", job="y", phase="Succeeded"), w.pod("r", job="z")
    c = w.claim(pending, "gpu", [("node-a", "gpu-0-seat-0")])
    c["status"]["reservedFor"] = []
    w.claim(done, "gpu", [("node-a", "gpu-0-seat-1")])
    u = w.claim(running, "gpu", [("node-a", "gpu-0-seat-2")])
    del u["status"]["allocation"]
    assert w.snapshot().claim_sets == {}


def test_same_claim_name_in_two_namespaces() -> None:
    w = one_node()
    a, b = w.pod("p", ns="team-a", job="same"), w.pod("p", ns="team-b", job="same")
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")])
    w.claim(b, "gpu", [("node-a", "gpu-1-seat-0")])
    s = w.snapshot()
    assert sorted(s.claim_sets) == ["team-a/same:gpu", "team-b/same:gpu"]
    assert len(s.groups) == 2


def test_job_override_from_claim_config() -> None:
    w = one_node()
    p = w.pod("p", job="label-job")
    w.claim(p, "gpu", [("node-a", "gpu-0-seat-0")], config=[ts_config(job="from-config")])
    assert list(w.snapshot().claim_sets) == ["ns/from-config:gpu"]


def test_ids_and_snapshot_do_not_depend_on_input_order() -> None:
    w = one_node(gpus=3)
    for i in range(6):
        p = w.pod(f"p{i}", job=f"j{i % 3}")
        w.claim(p, "gpu", [("node-a", f"gpu-{i % 3}-seat-{i // 3}")])
    ref = w.snapshot()
    rng = random.Random(7)
    for _ in range(10):
        claims, pods, slices = (copy.deepcopy(x) for x in (w.claims, w.pods, w.slices))
        for x in (claims, pods, slices):
            rng.shuffle(x)
        got = compute(claims, pods, physical_gpus(slices))
        assert got == ref
        assert list(got.groups) == list(ref.groups)
    assert set(ref.groups) == {group_id([gpu_uuid("node-a", i)]) for i in range(3)}


def test_config_conflict_in_a_claim_set_oldest_claim_wins_with_a_warning() -> None:
    w = World()
    w.node("node-a", gpus=1)
    w.node("node-b", gpus=1)
    old = w.pod("spmd-0", owner=("Job", "spmd"), node="node-a")
    new = w.pod("spmd-1", owner=("Job", "spmd"), node="node-b")
    w.claim(old, "trainer", [("node-a", "gpu-0-seat-0")], config=[ts_config(priority=5, backend="cuda")])
    newer = w.claim(new, "trainer", [("node-b", "gpu-0-seat-0")],
                    config=[ts_config(priority=9, backend="freeze", leaseSeconds=30)])
    s = w.snapshot()
    cs = s.claim_set("ns/job/spmd", "trainer")
    assert (cs.config.priority, cs.config.backend, cs.config.lease_seconds) == (5, "cuda", 10.0)
    assert [(x.claim.name, x.reason) for x in s.warnings] == [(newer["metadata"]["name"], CONFLICTING_JOB_CONFIG)]
    assert "priority=9" in s.warnings[0].message and "spmd-0-trainer" in s.warnings[0].message


def test_group_backend_from_oldest_claim_set_lease_is_the_longest() -> None:
    w = one_node()
    a, b = w.pod("a", job="a"), w.pod("b", job="b")
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")], config=[ts_config(backend="cuda", leaseSeconds=5)])
    w.claim(b, "gpu", [("node-a", "gpu-0-seat-1")], config=[ts_config(backend="none", leaseSeconds=20)])
    s = w.snapshot()
    g = only_group(s)
    assert (g.backend, g.lease_seconds) == ("cuda", 20.0)
    assert [(x.claim.name, x.reason) for x in s.warnings] == [("b-gpu", CONFLICTING_GROUP_CONFIG)]
    # claim sets by id, not by their pod-level names (both "gpu" here: the message named neither apart)
    ids = [cs.id for g in s.groups.values() for cs in g.claim_sets]
    assert all(i in s.warnings[0].message for i in ids), (ids, s.warnings[0].message)


def test_a_claim_whose_requests_differ_in_config_is_said_to_be_refused_by_the_plugin() -> None:
    """Peer suite (issue 24): the Warning said "request 'r0' decides for the claim" while the node
    plugin refuses to prepare such a claim (kubelet_plugin/preparer.py): the user was told it
    would run."""
    w = one_node()
    c = w.claim(w.pod("a", job="a"), "gpu", [("node-a", "gpu-0-seat-0"), ("node-a", "gpu-0-seat-1")],
                config=[ts_config(["r0"], priority=1), ts_config(["r1"], priority=2)])
    for result, request in zip(c["status"]["allocation"]["devices"]["results"], ("r0", "r1")):
        result["request"] = request
    s = w.snapshot()
    assert [x.reason for x in s.warnings] == [CONFLICTING_JOB_CONFIG]
    assert "the node plugin refuses to prepare this claim" in s.warnings[0].message
    assert "decides" not in s.warnings[0].message


def test_invalid_config_uses_defaults_with_a_warning() -> None:
    w = one_node()
    p = w.pod("p", job="j")
    w.claim(p, "gpu", [("node-a", "gpu-0-seat-0")], config=[ts_config(priority="high")])
    s = w.snapshot()
    assert s.claim_set("ns/j", "gpu").config.priority == 0
    assert [x.reason for x in s.warnings] == [INVALID_CONFIG] and "priority" in s.warnings[0].message


def test_device_without_slice_is_its_own_gpu_with_a_warning() -> None:
    w = World()  # no slices
    a, b = w.pod("a", job="a"), w.pod("b", job="b")
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")])
    w.claim(b, "gpu", [("node-a", "gpu-0-seat-1")])
    s = w.snapshot()
    assert len(s.groups) == 2
    assert {x.reason for x in s.warnings} == {UNKNOWN_DEVICE} and len(s.warnings) == 2


def test_diff_added_removed_changed_gone() -> None:
    w = one_node(gpus=3)
    a, b, c = w.pod("a", job="a"), w.pod("b", job="b"), w.pod("c", job="c")
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")])
    cb = w.claim(b, "gpu", [("node-a", "gpu-0-seat-1")])
    w.claim(c, "gpu", [("node-a", "gpu-1-seat-0")])
    before = w.snapshot()
    assert diff(before, before).empty

    # b's claim is deallocated; d arrives on GPU 2
    del cb["status"]["allocation"]
    d = w.pod("d", job="d")
    w.claim(d, "gpu", [("node-a", "gpu-2-seat-0")])
    after = w.snapshot()
    dd = diff(before, after)
    gpu0 = group_id([gpu_uuid("node-a", 0)])
    assert [g.id for g in dd.changed] == [gpu0]
    assert [cs.id for cs in dd.changed[0].claim_sets] == ["ns/a:gpu"]
    assert [g.id for g in dd.added] == [group_id([gpu_uuid("node-a", 2)])]
    assert dd.removed == () and dd.predecessors == {}
    assert [cs.id for cs in dd.claim_sets_gone] == ["ns/b:gpu"]
    assert [x.name for x in dd.claims_gone] == ["b-gpu"]

    # c's pod finishes: its group goes
    c["status"]["phase"] = "Succeeded"
    dd = diff(after, w.snapshot())
    assert [g.id for g in dd.removed] == [group_id([gpu_uuid("node-a", 1)])]
    assert [cs.id for cs in dd.claim_sets_gone] == ["ns/c:gpu"]


def test_diff_names_predecessors_of_a_merge() -> None:
    w = one_node(gpus=2)
    a, b = w.pod("a", job="a"), w.pod("b", job="b")
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")])
    w.claim(b, "gpu", [("node-a", "gpu-1-seat-0")])
    before = w.snapshot()
    bridge = w.pod("bridge", job="bridge")
    w.claim(bridge, "gpu", [("node-a", "gpu-0-seat-1"), ("node-a", "gpu-1-seat-1")])
    dd = diff(before, w.snapshot())
    merged = group_id([gpu_uuid("node-a", 0), gpu_uuid("node-a", 1)])
    assert [g.id for g in dd.added] == [merged]
    assert dd.predecessors == {merged: tuple(sorted(before.groups))}
    assert len(dd.removed) == 2 and dd.claim_sets_gone == ()


def _async_rl(claim_names: dict[str, str]) -> Snapshot:
    """Two async-RL jobs: each a trainer pod on a seat of GPU 0 and a sampler pod on its own
    GPU, their claims from templates trainer-gpu and sampler-gpu under `claim_names[role]`."""
    w = one_node(gpus=3)
    for i, job in enumerate(("a", "b")):
        trainer = w.pod(f"{job}-trainer", owner=("Job", job))
        sampler = w.pod(f"{job}-sampler", owner=("Job", job))
        w.claim(trainer, claim_names["trainer"], [("node-a", f"gpu-0-seat-{i}")], template="trainer-gpu")
        w.claim(sampler, claim_names["sampler"], [("node-a", f"gpu-{i + 1}-seat-0")], template="sampler-gpu")
    return w.snapshot()


def test_the_lock_unit_is_the_claim_source_not_the_pod_level_name() -> None:
    """Issue 11, item 1: the peers' layout calls every pod's claim `gpu`; keyed by the
    pod-level name, a job's trainer and sampler merged into one unit and all three GPUs
    into one group. Keyed by the claim source, it gives the three groups that role-named
    claims give: the trainers share GPU 0, each sampler is alone."""
    literal, role_named = _async_rl({"trainer": "gpu", "sampler": "gpu"}), \
        _async_rl({"trainer": "trainer", "sampler": "sampler"})
    for s in (literal, role_named):
        groups = sorted(sorted(cs.id for cs in g.claim_sets) for g in s.groups.values())
        assert groups == [["ns/job/a:sampler-gpu"], ["ns/job/a:trainer-gpu", "ns/job/b:trainer-gpu"],
                          ["ns/job/b:sampler-gpu"]]
    cs = literal.claim_sets["ns/job/a:trainer-gpu"]
    assert cs.source == "trainer-gpu" and cs.name == "gpu" and cs.handles == ("gpu", "trainer-gpu")
    assert cs.pods == ("uid-pod-ns-a-trainer",)
    assert role_named.claim_sets["ns/job/a:trainer-gpu"].handles == ("trainer", "trainer-gpu")


async def test_a_name_two_claim_sets_share_is_resolved_by_the_calling_pod() -> None:
    """The literal layout's clients all lock "gpu": the caller's pod (from its token) says
    which claim set it means; without a pod the name is refused with what to do, and the
    claim source always names one."""
    s = _async_rl({"trainer": "gpu", "sampler": "gpu"})
    orch = Orchestrator([group_spec(g, "none", lambda node: f"{node}:50052") for g in s.groups.values()])
    try:
        orch.set_aliases(aliases(s.claim_sets.values(), dict(s.group_of)))
        group, member = orch.group_for("ns/job/a", "gpu", pod_uid="uid-pod-ns-a-sampler")
        assert member == "ns/job/a:sampler-gpu" and group.id == s.group_of[member]
        group, member = orch.group_for("ns/job/a", "gpu", pod_uid="uid-pod-ns-a-trainer")
        assert member == "ns/job/a:trainer-gpu" and {m.claim_set for m in group.spec.members} == {
            "ns/job/a:trainer-gpu", "ns/job/b:trainer-gpu"}
        with pytest.raises(FailedPrecondition, match="2 claim sets its pods call 'gpu'"):
            orch.group_for("ns/job/a", "gpu")
        with pytest.raises(FailedPrecondition):
            orch.group_for("ns/job/a", "gpu", pod_uid="uid-pod-ns-b-trainer")  # another job's pod decides nothing
        assert orch.group_for("ns/job/b", "sampler-gpu")[1] == "ns/job/b:sampler-gpu"
    finally:
        await orch.close()


async def test_configuration_warnings_show_in_the_groups_status(capsys) -> None:
    """Issue 11, item 5: the conflicts that become Warning Events also show in `timeslice
    status` (GroupStatus.warnings), on the group of the claims involved."""
    w = one_node()
    a, b = w.pod("a", job="a"), w.pod("b", job="b")
    w.claim(a, "gpu", [("node-a", "gpu-0-seat-0")], config=[ts_config(backend="cuda")])
    w.claim(b, "gpu", [("node-a", "gpu-0-seat-1")], config=[ts_config(backend="none")])
    s = w.snapshot()
    orch = Orchestrator()
    try:
        await Reconciler(orch, agent_template="{node}:1").apply(s)
        status = group_status(orch.group(only_group(s).id).view())
        assert [x.split(":")[0] for x in status.warnings] == [CONFLICTING_GROUP_CONFIG]
        assert "backend=none" in status.warnings[0] and "backend=cuda" in status.warnings[0]
        server, port = await create_server(orch, "127.0.0.1:0")
        try:
            assert await asyncio.to_thread(cli, ["status", "--target", f"127.0.0.1:{port}"]) == 0
        finally:
            await server.stop(0)
        assert f"  warning: {CONFLICTING_GROUP_CONFIG}: " in capsys.readouterr().out
    finally:
        await orch.close()
