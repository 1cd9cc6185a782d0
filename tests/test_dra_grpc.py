"""NodePrepareResources / NodeUnprepareResources, v1 and v1beta1, over the real DRA socket.

Kubelet's side is our generated client stubs; the plugin behind the adapter is
`FakeClaimPlugin` (the `ClaimPlugin` seam).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2 as v1
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2_grpc as v1_grpc
from timeslice.driver.kubeletapi.dra_v1beta1 import dra_pb2 as v1beta1
from timeslice.driver.kubeletapi.dra_v1beta1 import dra_pb2_grpc as v1beta1_grpc
from timeslice.kubelet_plugin.plugin import ClaimRef, PreparedDevice

from tests.kubelet_fakes import POOL, FakeClaimPlugin, device_for

APIS = {"v1": (v1, v1_grpc), "v1beta1": (v1beta1, v1beta1_grpc)}


def claims(pb, *uids: str) -> list:
    return [pb.Claim(namespace="ns", uid=u, name=f"claim-{u}") for u in uids]


async def prepare(served, api: str, *uids: str):
    pb, pb_grpc = APIS[api]
    return await pb_grpc.DRAPluginStub(served.dra).NodePrepareResources(
        pb.NodePrepareResourcesRequest(claims=claims(pb, *uids)), timeout=5)


async def unprepare(served, api: str, *uids: str):
    pb, pb_grpc = APIS[api]
    return await pb_grpc.DRAPluginStub(served.dra).NodeUnprepareResources(
        pb.NodeUnprepareResourcesRequest(claims=claims(pb, *uids)), timeout=5)


@pytest.mark.parametrize("api", APIS)
async def test_one_failing_claim_does_not_fail_the_others(serve_plugin, api) -> None:
    served = await serve_plugin(plugin=FakeClaimPlugin(errors={"u2": "no seat left on gpu-0"}))
    r = await prepare(served, api, "u1", "u2")
    assert set(r.claims) == {"u1", "u2"}
    assert r.claims["u2"].error == "no seat left on gpu-0" and not r.claims["u2"].devices
    ok = r.claims["u1"]
    assert ok.error == ""
    assert [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in ok.devices] == [
        (["gpu"], POOL, "gpu-0-seat-0", ["k8s.gpu.timeslice.dev/claim=u1-gpu-0"])]
    assert served.plugin.calls == [("prepare", [ClaimRef("ns", "u1", "claim-u1"), ClaimRef("ns", "u2", "claim-u2")])]


async def test_v1_carries_share_id_only_when_the_plugin_sets_one(serve_plugin) -> None:
    plugin = FakeClaimPlugin(devices={"u1": [device_for("u1", 0, share_id="share-7"), device_for("u1", 1)]})
    served = await serve_plugin(plugin=plugin)
    devices = (await prepare(served, "v1", "u1")).claims["u1"].devices
    assert [d.HasField("share_id") for d in devices] == [True, False]
    assert devices[0].share_id == "share-7"
    beta = (await prepare(served, "v1beta1", "u1")).claims["u1"].devices  # v1beta1 has no share id
    assert [d.device_name for d in beta] == ["gpu-0-seat-0", "gpu-1-seat-0"]
    assert "share_id" not in v1beta1.Device.DESCRIPTOR.fields_by_name


@pytest.mark.parametrize("api", APIS)
async def test_plugin_exception_fails_each_claim_not_the_call(serve_plugin, api, caplog) -> None:
    served = await serve_plugin(plugin=FakeClaimPlugin(exc=RuntimeError("checkpoint file is corrupt")))
    with caplog.at_level(logging.ERROR, logger="timeslice.kubelet_plugin.dra"):
        r = await prepare(served, api, "u1", "u2")
        u = await unprepare(served, api, "u1")
    assert {uid: c.error for uid, c in r.claims.items()} == {
        "u1": "prepare failed: RuntimeError: checkpoint file is corrupt",
        "u2": "prepare failed: RuntimeError: checkpoint file is corrupt"}
    assert u.claims["u1"].error == "unprepare failed: RuntimeError: checkpoint file is corrupt"
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage().split(" api=")[0] for r in failed] == ["prepare failed in the plugin",
                                                                  "unprepare failed in the plugin"]
    assert all(r.exc_info for r in failed)  # with the traceback


@pytest.mark.parametrize("api", APIS)
async def test_missing_results_are_filled_and_unknown_ones_dropped(serve_plugin, api, caplog) -> None:
    plugin = FakeClaimPlugin(omit={"u2"}, extra={"stranger": None})
    served = await serve_plugin(plugin=plugin)
    r = await prepare(served, api, "u1", "u2")
    assert set(r.claims) == {"u1", "u2"}  # kubelet fails a call that answers for a claim it did not name
    assert r.claims["u1"].error == ""
    assert r.claims["u2"].error == "prepare: the plugin returned no result for this claim"
    u = await unprepare(served, api, "u1", "u2")
    assert {uid: c.error for uid, c in u.claims.items()} == {
        "u1": "", "u2": "unprepare: the plugin returned no result for this claim"}
    assert caplog.text.count("dropped results for claims not asked for uids=['stranger']") == 2


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("claim_list", "message"), [
    ([], "claims is empty: name at least one claim"),
    ([("ns", "u1", "a"), ("ns", "", "b")], "claims[1] (ns/b uid='') has no uid"),
    ([("", "u1", "")], "claims[0] (/ uid='u1') has no namespace, name"),
])
async def test_bad_requests_are_invalid_argument(serve_plugin, api, claim_list, message) -> None:
    served = await serve_plugin()
    pb, pb_grpc = APIS[api]
    req = [pb.Claim(namespace=n, uid=u, name=m) for n, u, m in claim_list]
    stub = pb_grpc.DRAPluginStub(served.dra)
    for call, request in ((stub.NodePrepareResources, pb.NodePrepareResourcesRequest(claims=req)),
                          (stub.NodeUnprepareResources, pb.NodeUnprepareResourcesRequest(claims=req))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == message
    assert served.plugin.calls == []


@pytest.mark.parametrize("api", APIS)
async def test_unprepare_reports_per_claim_errors(serve_plugin, api) -> None:
    served = await serve_plugin(plugin=FakeClaimPlugin(errors={"u1": "CDI spec in use"}))
    u = await unprepare(served, api, "u1", "u2")
    assert {uid: c.error for uid, c in u.claims.items()} == {"u1": "CDI spec in use", "u2": ""}
    assert served.plugin.calls == [("unprepare", [ClaimRef("ns", "u1", "claim-u1"), ClaimRef("ns", "u2", "claim-u2")])]


async def test_subrequests_are_reported_as_their_request_and_uids_passed_once(serve_plugin) -> None:
    dev = PreparedDevice(["gpu/h200", "gpu/any", "sampler"], POOL, "gpu-0-seat-0", [])
    served = await serve_plugin(plugin=FakeClaimPlugin(devices={"u1": [dev]}))
    r = await prepare(served, "v1", "u1", "u1")
    assert list(r.claims["u1"].devices[0].request_names) == ["gpu", "sampler"]
    assert [len(c) for _, c in served.plugin.calls] == [1]


async def test_a_device_without_pool_or_name_fails_its_claim(serve_plugin) -> None:
    bad = PreparedDevice([], "", "gpu-0-seat-0", [])
    served = await serve_plugin(plugin=FakeClaimPlugin(devices={"u1": [bad]}))
    r = await prepare(served, "v1", "u1", "u2")
    assert r.claims["u1"].error.startswith("the plugin returned a device without pool or device name")
    assert r.claims["u2"].error == ""


async def test_calls_reach_the_plugin_at_once(serve_plugin) -> None:
    """Issue 12, item 8: calls of different pods are not serialized by the adapter (the plugin
    locks per claim), so one slow claim delays no other."""
    plugin = FakeClaimPlugin(hold_until_running=3)  # each call returns once all three are in the plugin
    served = await serve_plugin(plugin=plugin)
    await asyncio.gather(prepare(served, "v1", "u1"), prepare(served, "v1beta1", "u2"), unprepare(served, "v1", "u3"))
    assert len(plugin.calls) == 3 and plugin.max_running == 3
