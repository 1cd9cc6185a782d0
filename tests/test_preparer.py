"""ClaimPreparer: allocation checks, config validation, CDI, checkpoint, idempotency.

The API server read is the seam (`read_claim`); everything else is real (files, JSON)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
from kubernetes.aio.client.exceptions import ApiException
from timeslice.driver import vmm_shim
from timeslice.driver.errors import FailedPrecondition, InvalidArgument, NotFound
from timeslice.driver.events import EventRecorder
from timeslice.kubelet_plugin.checkpoint import Checkpoint
from timeslice.kubelet_plugin.plugin import ClaimRef
from timeslice.kubelet_plugin.preparer import ClaimPreparer, plan_claim

NODE = "node-1"


@dataclass(frozen=True)
class Gpu:
    uuid: str
    device_nodes: tuple[str, ...] = ()


GPUS = {f"gpu-{i}-seat-{k}": Gpu(f"GPU-{i}", (f"/dev/nvidia{i}", "/dev/nvidiactl")) for i in range(2) for k in range(4)}


def claim(uid: str, devices: list[str], pool: str = NODE, request: str = "gpu", config: list | None = None,
          admin: bool = False) -> dict:
    return {"metadata": {"namespace": "ns", "name": f"claim-{uid}", "uid": uid},
            "status": {"allocation": {"devices": {
                "results": [{"request": request, "driver": "gpu.timeslice.dev", "pool": pool, "device": d,
                             **({"adminAccess": True} if admin else {})} for d in devices],
                "config": config or []}}}}


def test_plan_rejects_what_is_not_ours_to_prepare() -> None:
    with pytest.raises(FailedPrecondition, match="allocated to node other, not to this node node-1"):
        plan_claim(claim("u", ["gpu-0-seat-0"], pool="other"), "u", NODE, GPUS.get)
    with pytest.raises(FailedPrecondition, match="was replaced"):
        plan_claim(claim("u", ["gpu-0-seat-0"]), "v", NODE, GPUS.get)
    with pytest.raises(FailedPrecondition, match="not allocated"):
        plan_claim({"metadata": {"uid": "u"}, "status": {}}, "u", NODE, GPUS.get)
    with pytest.raises(FailedPrecondition, match="not published by this node"):
        plan_claim(claim("u", ["gpu-9-seat-0"]), "u", NODE, GPUS.get)


def test_two_seats_of_one_gpu_in_one_request_are_refused_with_the_fix() -> None:
    with pytest.raises(InvalidArgument, match=r"matchAttribute: gpu\.timeslice\.dev/seat"):
        plan_claim(claim("u", ["gpu-0-seat-0", "gpu-0-seat-1"]), "u", NODE, GPUS.get)
    plan = plan_claim(claim("u", ["gpu-0-seat-1", "gpu-1-seat-1"]), "u", NODE, GPUS.get)
    assert [d.physical_gpu for d in plan.devices] == ["GPU-0", "GPU-1"]


class Events:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def create_namespaced_event(self, namespace: str, body: dict) -> None:
        self.sent.append(body)


def preparer(tmp_path, claims: dict[str, dict], events: Events | None = None,
             vmm: tuple[str, str] | None = None) -> ClaimPreparer:
    async def read(ns: str, name: str) -> dict:
        if name not in claims:
            raise NotFound(f"claim {ns}/{name} no longer exists")
        return claims[name]

    return ClaimPreparer(node_name=NODE, read_claim=read, lookup=GPUS.get, cdi_dir=tmp_path / "cdi",
                         checkpoint=Checkpoint(tmp_path / "state" / "checkpoint.json"),
                         events=EventRecorder(events or Events(), "test"), orchestrator="127.0.0.1:50051",
                         vmm_shim=vmm)


async def test_prepare_is_per_claim_idempotent_and_survives_restarts(tmp_path) -> None:
    bad_cfg = [{"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.timeslice.dev", "parameters": {
        "apiVersion": "timeslice.dev/v1alpha1", "kind": "TimeSliceConfig", "backend": "magic"}}}]
    claims = {"claim-a": claim("a", ["gpu-0-seat-0"]), "claim-b": claim("b", ["gpu-1-seat-0"], config=bad_cfg),
              "claim-adm": claim("adm", ["gpu-0-seat-1"], admin=True)}
    events = Events()
    p = preparer(tmp_path, claims, events)
    refs = [ClaimRef("ns", u, f"claim-{u}") for u in ("a", "b", "adm", "gone")]
    first = await p.prepare(refs)
    assert first["a"].error is None and first["a"].devices[0].cdi_device_ids == ["timeslice.dev/gpu=a-gpu-0-seat-0"]
    assert "backend: Input should be" in first["b"].error and first["b"].devices == []
    assert "no longer exists" in first["gone"].error
    assert first["adm"].error is None
    assert [e["reason"] for e in events.sent] == ["PrepareFailed", "PrepareFailed"]
    assert events.sent[0]["involvedObject"]["kind"] == "ResourceClaim" and events.sent[0]["type"] == "Warning"
    spec = json.loads((tmp_path / "cdi" / "timeslice.dev-gpu_a.json").read_text())
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert spec["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidiactl"}]
    adm = json.loads((tmp_path / "cdi" / "timeslice.dev-gpu_adm.json").read_text())
    assert "TIMESLICE_ADMIN_ACCESS_ADM=true" in adm["containerEdits"]["env"]
    # a repeated prepare answers from the checkpoint, even after the claim is gone from the API
    claims.clear()
    again = await p.prepare([refs[0]])
    assert again["a"] == first["a"]
    # a restarted plugin (fresh process) after a reboot (tmpfs CDI dir emptied)
    for f in (tmp_path / "cdi").iterdir():
        f.unlink()
    fresh = preparer(tmp_path, {})
    assert fresh.restore_cdi_specs() == 2
    assert (tmp_path / "cdi" / "timeslice.dev-gpu_a.json").exists()
    done = await fresh.unprepare([refs[0], ClaimRef("ns", "never", "x")])
    assert done == {"a": None, "never": None}
    assert not (tmp_path / "cdi" / "timeslice.dev-gpu_a.json").exists() and "a" not in fresh.checkpoint.claims


def test_allocation_mode_all_and_admin_access_may_hold_every_seat_of_a_gpu() -> None:
    """Issue 11, item 6: `allocationMode: All` (a whole GPU to one claim) and an admin-access
    monitor hold several seats of one GPU on purpose; the GPU's device nodes pass through
    once. A count request beside them in the same claim is still checked."""
    whole = claim("u", [f"gpu-0-seat-{k}" for k in range(4)])
    whole["spec"] = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.timeslice.dev",
                                                                          "allocationMode": "All"}}]}}
    plan = plan_claim(whole, "u", NODE, GPUS.get)
    assert [d.physical_gpu for d in plan.devices] == ["GPU-0"] * 4 and not plan.admin_access
    assert [d.device_nodes for d in plan.devices] == [("/dev/nvidia0", "/dev/nvidiactl"), (), (), ()]
    sub = claim("u", ["gpu-0-seat-0", "gpu-0-seat-1"], request="gpu/whole")
    sub["spec"] = {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
        {"name": "whole", "deviceClassName": "gpu.timeslice.dev", "allocationMode": "All"}]}]}}
    assert len(plan_claim(sub, "u", NODE, GPUS.get).devices) == 2
    monitor = plan_claim(claim("u", [f"gpu-{i}-seat-{k}" for i in range(2) for k in range(4)], admin=True), "u",
                         NODE, GPUS.get)
    assert monitor.admin_access and len(monitor.devices) == 8
    counted = claim("u", ["gpu-1-seat-0", "gpu-1-seat-1"], request="two")
    counted["spec"] = {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.timeslice.dev", "allocationMode": "All"}},
        {"name": "two", "exactly": {"deviceClassName": "gpu.timeslice.dev", "count": 2}}]}}
    with pytest.raises(InvalidArgument, match="request 'two' got 2 seats of one physical GPU"):
        plan_claim(counted, "u", NODE, GPUS.get)


def test_requests_of_one_claim_that_disagree_on_their_config_are_refused() -> None:
    """Issue 11, item 5: a claim is one lock unit; a config for one request only (another
    job, another priority) was silently ignored for the claim. Now prepare refuses it."""
    cfg = {"opaque": {"driver": "gpu.timeslice.dev", "parameters": {
        "apiVersion": "timeslice.dev/v1alpha1", "kind": "TimeSliceConfig", "priority": 5, "job": "other"}},
        "requests": ["b"]}
    two = claim("u", ["gpu-0-seat-0"], request="a", config=[cfg])
    two["status"]["allocation"]["devices"]["results"].append(
        {"request": "b", "driver": "gpu.timeslice.dev", "pool": NODE, "device": "gpu-1-seat-0"})
    with pytest.raises(InvalidArgument, match=r"requests 'a' and 'b' carry different TimeSliceConfigs .*job=None "
                                              r"priority=0.* vs job=other priority=5"):
        plan_claim(two, "u", NODE, GPUS.get)
    del cfg["requests"]  # for every request: accepted
    assert plan_claim(two, "u", NODE, GPUS.get).configs["a"].priority == 5


async def test_a_config_without_nccl_peer_transports_sets_the_nccl_variables_in_the_containers(tmp_path) -> None:
    """Issue 14, item 0: `ncclPeerTransports: false` lets the cuda backends move a
    multi-GPU NCCL job; the plugin puts NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 into
    the claim's CDI spec. Without it, the claim's containers get neither."""
    cfg = [{"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.timeslice.dev", "parameters": {
        "apiVersion": "timeslice.dev/v1alpha1", "kind": "TimeSliceConfig", "ncclPeerTransports": False}}}]
    claims = {"claim-a": claim("a", ["gpu-0-seat-0", "gpu-1-seat-0"], config=cfg),
              "claim-b": claim("b", ["gpu-0-seat-1"])}
    p = preparer(tmp_path, claims)
    got = await p.prepare([ClaimRef("ns", u, f"claim-{u}") for u in ("a", "b")])
    assert got["a"].error is None and got["b"].error is None
    env = {u: json.loads((tmp_path / "cdi" / f"timeslice.dev-gpu_{u}.json").read_text())["containerEdits"]["env"]
           for u in ("a", "b")}
    assert {"NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1"} <= set(env["a"])
    assert not [e for e in env["b"] if e.startswith("NCCL_")]


async def test_a_claim_on_backend_vmm_gets_the_shim_mounted_and_preloaded(tmp_path) -> None:
    """Issue 26: the plugin puts the timeslice-vmm shim into the containers of a claim on `vmm`
    (a read-only bind of its copy in the plugin's state folder, and LD_PRELOAD naming it); a claim
    on another backend gets neither."""
    cfg = [{"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.timeslice.dev", "parameters": {
        "apiVersion": "timeslice.dev/v1alpha1", "kind": "TimeSliceConfig", "backend": "vmm"}}}]
    claims = {"claim-a": claim("a", ["gpu-0-seat-0"], config=cfg), "claim-b": claim("b", ["gpu-0-seat-1"])}
    p = preparer(tmp_path, claims, vmm=vmm_shim.install_for_containers(tmp_path / "state"))
    assert (tmp_path / "state" / vmm_shim.LIBRARY_NAME).read_bytes() == vmm_shim.library().read_bytes()
    got = await p.prepare([ClaimRef("ns", u, f"claim-{u}") for u in ("a", "b")])
    assert got["a"].error is None and got["b"].error is None
    edits = {u: json.loads((tmp_path / "cdi" / f"timeslice.dev-gpu_{u}.json").read_text())["containerEdits"]
             for u in ("a", "b")}
    assert f"LD_PRELOAD={vmm_shim.CONTAINER_PATH}" in edits["a"]["env"]
    assert {"hostPath": str(tmp_path / "state" / vmm_shim.LIBRARY_NAME), "containerPath": vmm_shim.CONTAINER_PATH,
            "options": ["ro", "nosuid", "nodev", "bind"]} in edits["a"]["mounts"]
    assert "mounts" not in edits["b"] and not [e for e in edits["b"]["env"] if e.startswith("LD_PRELOAD")]


async def test_one_claims_api_error_fails_only_that_claim_with_an_event(tmp_path) -> None:
    """Issue 12, item 5: a read that failed with an API error (not a 404) gave every claim of
    the call the raw exception. Now only that claim fails, with one line and an Event."""
    events = Events()
    good = claim("a", ["gpu-0-seat-0"])

    async def read(ns: str, name: str) -> dict:
        if name == "claim-bad":
            raise ApiException(status=500, reason="Internal Server Error")
        if name == "claim-odd":
            raise RuntimeError("connection reset by peer")
        return good

    p = ClaimPreparer(node_name=NODE, read_claim=read, lookup=GPUS.get, cdi_dir=tmp_path / "cdi",
                      checkpoint=Checkpoint(tmp_path / "checkpoint.json"), events=EventRecorder(events, "test"))
    out = await p.prepare([ClaimRef("ns", "a", "claim-a"), ClaimRef("ns", "bad", "claim-bad"),
                           ClaimRef("ns", "odd", "claim-odd")])
    assert out["a"].error is None and len(out["a"].devices) == 1
    assert out["bad"].error == "prepare ns/claim-bad: read claim ns/claim-bad: HTTP 500: Internal Server Error"
    assert out["odd"].error == "prepare ns/claim-odd: read claim ns/claim-odd: RuntimeError: connection reset by peer"
    assert [e["involvedObject"]["name"] for e in events.sent] == ["claim-bad", "claim-odd"]


async def test_claims_deleted_while_the_plugin_was_down_are_pruned(tmp_path) -> None:
    """Issue 12, item 7: prepare a claim, stop the plugin, delete the claim, start the plugin:
    its CDI spec and checkpoint entry stayed (the start-up restore even rewrote the spec). A
    claim re-created under the same name (another uid) is gone too; one the API server cannot
    answer for now is kept."""
    claims = {"claim-a": claim("a", ["gpu-0-seat-0"]), "claim-b": claim("b", ["gpu-1-seat-0"]),
              "claim-c": claim("c", ["gpu-0-seat-1"])}
    await preparer(tmp_path, claims).prepare([ClaimRef("ns", u, f"claim-{u}") for u in "abc"])
    del claims["claim-a"]  # deleted while the plugin was down
    claims["claim-b"] = claim("b2", ["gpu-1-seat-0"])  # deleted and re-created: another uid
    restarted = preparer(tmp_path, claims)
    assert restarted.restore_cdi_specs() == 3
    assert sorted(await restarted.prune_gone()) == ["a", "b"]
    assert sorted(restarted.checkpoint.claims) == ["c"]
    assert sorted(f.name for f in (tmp_path / "cdi").iterdir()) == ["timeslice.dev-gpu_c.json"]

    async def unavailable(ns: str, name: str) -> dict:
        raise ApiException(status=503, reason="Service Unavailable")

    away = ClaimPreparer(node_name=NODE, read_claim=unavailable, lookup=GPUS.get, cdi_dir=tmp_path / "cdi",
                         checkpoint=Checkpoint(tmp_path / "state" / "checkpoint.json"))
    assert await away.prune_gone() == [] and sorted(away.checkpoint.claims) == ["c"]


async def test_many_gone_claims_are_pruned_with_one_checkpoint_write(tmp_path, monkeypatch) -> None:
    """Issue 24: 500 gone claims, one checkpoint write each (every claim serialized and fsynced on
    the event loop), blocked the plugin's loop for 4.6 s at start-up. One write for all now."""
    import timeslice.kubelet_plugin.checkpoint as checkpoint_module

    claims = {f"claim-{i}": claim(f"u{i}", [f"gpu-{i % 2}-seat-{i % 4}"]) for i in range(40)}
    await preparer(tmp_path, claims).prepare([ClaimRef("ns", f"u{i}", f"claim-{i}") for i in range(40)])
    writes: list[object] = []
    write = checkpoint_module.write_atomic
    monkeypatch.setattr(checkpoint_module, "write_atomic", lambda path, data: (writes.append(path), write(path, data)))
    for i in range(30):
        del claims[f"claim-{i}"]
    restarted = preparer(tmp_path, claims)
    assert len(await restarted.prune_gone()) == 30
    assert len(writes) == 1 and len(Checkpoint(tmp_path / "state" / "checkpoint.json").claims) == 10


async def test_a_slow_claim_delays_no_other_claim_and_one_claim_runs_one_at_a_time(tmp_path) -> None:
    """Issue 12, item 8: every prepare call waited for the one before (one lock for all), so a
    slow API read of one claim delayed another pod's claim (1.9 s seen). Now claims are
    independent; the same claim's calls still run one after the other."""
    slow = asyncio.Event()
    reads: list[str] = []
    claims = {"claim-a": claim("a", ["gpu-0-seat-0"]), "claim-b": claim("b", ["gpu-1-seat-0"])}

    async def read(ns: str, name: str) -> dict:
        reads.append(name)
        if name == "claim-a":
            await slow.wait()
        return claims[name]

    p = ClaimPreparer(node_name=NODE, read_claim=read, lookup=GPUS.get, cdi_dir=tmp_path / "cdi",
                      checkpoint=Checkpoint(tmp_path / "checkpoint.json"))
    a = ClaimRef("ns", "a", "claim-a")
    first = asyncio.create_task(p.prepare([a]))
    again = asyncio.create_task(p.prepare([a]))  # the same claim: waits for the first, reads nothing
    out = await asyncio.wait_for(p.prepare([ClaimRef("ns", "b", "claim-b")]), 10)  # while a's read hangs
    assert out["b"].error is None and not first.done() and not again.done()
    slow.set()
    assert (await first)["a"] == (await again)["a"] and (await first)["a"].error is None
    assert reads == ["claim-a", "claim-b"] and p._locks == {}


async def test_leftover_temporaries_of_interrupted_cdi_writes_are_removed_at_start(tmp_path) -> None:
    """Issue 12, item 3: a write killed between its temporary and the rename left a complete
    spec file in the CDI directory (then named .tmp-*.json, which the runtime's loader read: a
    conflict that dropped the device). Temporaries end in .tmp now, and a start removes ours
    (only ours)."""
    p = preparer(tmp_path, {"claim-a": claim("a", ["gpu-0-seat-0"])})
    await p.prepare([ClaimRef("ns", "a", "claim-a")])
    cdi_dir = tmp_path / "cdi"
    leftover = cdi_dir / ".timeslice.dev-gpu_a.json.x7f3k2.tmp"
    leftover.write_text((cdi_dir / "timeslice.dev-gpu_a.json").read_text())
    foreign = cdi_dir / ".nvidia.com-gpu.json.abc.tmp"
    foreign.write_text("{}")
    assert preparer(tmp_path, {}).restore_cdi_specs() == 1
    assert not leftover.exists() and foreign.exists()
    assert sorted(f.name for f in cdi_dir.iterdir()) == [".nvidia.com-gpu.json.abc.tmp", "timeslice.dev-gpu_a.json"]
