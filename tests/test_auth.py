"""Authenticated lock calls: the bearer token names a pod, which must be in the claim set.

The TokenReview call is the seam (`FakeReviews` answers as the API server would); the
gRPC server, the client and the token file are real."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from timeslice import AccessDenied, GroupNotFound, TimeSliceOrchestratorClient
from timeslice.controller.auth import TokenReviewAuthenticator
from timeslice.controller.orchestrator.config import GroupSpec, MemberSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator, pod_key
from timeslice.controller.orchestrator.server import create_server


class FakeReviews:
    def __init__(self, tokens: dict[str, str]) -> None:
        self.tokens = tokens  # token -> pod uid
        self.calls = 0

    async def create_token_review(self, body: dict) -> SimpleNamespace:
        self.calls += 1
        assert body["spec"]["audiences"] == ["timeslice.dev"]
        uid = self.tokens.get(body["spec"]["token"])
        user = SimpleNamespace(username="system:serviceaccount:ns:default",
                               extra={"authentication.kubernetes.io/pod-uid": [uid],
                                      "authentication.kubernetes.io/pod-name": ["p"]} if uid else {})
        return SimpleNamespace(status=SimpleNamespace(authenticated=uid is not None, user=user, error=None,
                                                      audiences=body["spec"]["audiences"] if uid else None))


@pytest.fixture
async def server(tmp_path):
    orch = Orchestrator([GroupSpec(id="g", members=(MemberSpec(claim_set="ns/a:gpu", claims_by_agent={},
                                                                pod_uids=("pod-a",)),))])
    orch.set_aliases({("ns/a", "gpu"): (("g", "ns/a:gpu"),), (pod_key("pod-a"), "gpu"): (("g", "ns/a:gpu"),)})
    reviews = FakeReviews({"token-a": "pod-a", "token-x": "pod-x"})
    srv, port = await create_server(orch, "127.0.0.1:0", TokenReviewAuthenticator(reviews))
    yield f"127.0.0.1:{port}", reviews
    await srv.stop(0)
    await orch.close()


async def test_only_the_claim_sets_pods_may_act(server, tmp_path, monkeypatch) -> None:
    target, reviews = server
    token = tmp_path / "token"
    monkeypatch.setenv("TIMESLICE_TOKEN_FILE", str(token))
    client = TimeSliceOrchestratorClient(target, "ns/a", "gpu")
    with pytest.raises(AccessDenied, match="no bearer token"):
        await asyncio.to_thread(client.acquire)
    token.write_text("token-x\n")
    with pytest.raises(AccessDenied, match="pod p holds no claim of 'ns/a:gpu'"):
        await asyncio.to_thread(client.acquire)
    token.write_text("forged")
    with pytest.raises(AccessDenied, match="token rejected"):
        await asyncio.to_thread(client.acquire)
    token.write_text("token-a")
    grant = await asyncio.to_thread(client.acquire)
    assert grant.epoch == 1
    await asyncio.to_thread(client.release)
    assert reviews.calls == 3  # token-x, forged, token-a: the release reused the cached review
    client.close()


async def test_status_wants_an_accepted_token_when_auth_is_on_and_carries_no_lease(server, tmp_path,
                                                                                 monkeypatch) -> None:
    """Before: GetGroupStatus and ListGroups called no authenticator (and returned the
    holder's lease id, with which anyone could release it)."""
    import grpc
    from timeslice.cli.main import main as cli
    from timeslice.v1 import orchestrator_pb2 as pb
    from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

    target, _ = server
    token = tmp_path / "token"
    monkeypatch.setenv("TIMESLICE_TOKEN_FILE", str(token))
    token.write_text("token-a")
    client = TimeSliceOrchestratorClient(target, "ns/a", "gpu")
    grant = await asyncio.to_thread(client.acquire)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        for call in (stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g")),
                     stub.ListGroups(pb.ListGroupsRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListGroups(pb.ListGroupsRequest(), metadata=(("authorization", "Bearer forged"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = await stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g"),
                                           metadata=(("authorization", "Bearer token-x"),))  # any pod, or an admin
    assert status.holder.job_id == "ns/a:gpu" and grant.lease_id not in str(status)
    assert await asyncio.to_thread(cli, ["status", "--target", target, "--json"]) == 0  # sends $TIMESLICE_TOKEN_FILE
    await asyncio.to_thread(client.release)
    client.close()


async def test_a_pod_that_names_no_job_locks_as_its_pods_job(server, tmp_path, monkeypatch) -> None:
    """Issue 11, item 4: no TIMESLICE_JOB in a cluster pod; the token names the pod, the pod's
    claim called "gpu" names the claim set. A pod with no such claim learns what to do."""
    target, _ = server
    token = tmp_path / "token"
    monkeypatch.setenv("TIMESLICE_TOKEN_FILE", str(token))
    monkeypatch.delenv("TIMESLICE_JOB", raising=False)
    token.write_text("token-a")
    client = TimeSliceOrchestratorClient(target, group_id="gpu")
    grant = await asyncio.to_thread(client.acquire)
    assert grant.epoch == 1
    await asyncio.to_thread(client.release)
    client.close()
    token.write_text("token-x")
    other = TimeSliceOrchestratorClient(target, group_id="gpu")
    with pytest.raises(GroupNotFound, match=r"holds no claim called 'gpu'.*or set TIMESLICE_JOB"):
        await asyncio.to_thread(other.acquire)
    other.close()
    token.unlink()
    with pytest.raises(ValueError, match="no job id"):
        TimeSliceOrchestratorClient(target, group_id="gpu")


async def test_a_pod_with_one_claim_may_name_no_group(server, tmp_path, monkeypatch) -> None:
    """Issue 24 (peer suite): DESIGN says that with a single claim the name may be omitted, yet
    acquire() raised "no group id". With a token the orchestrator takes the calling pod's only
    claim of this driver; a pod with several is told to name one; without a token the client
    still says what to set."""
    target, _ = server
    token = tmp_path / "token"
    monkeypatch.setenv("TIMESLICE_TOKEN_FILE", str(token))
    monkeypatch.delenv("TIMESLICE_JOB", raising=False)
    monkeypatch.delenv("TIMESLICE_GROUP", raising=False)
    token.write_text("token-a")
    client = TimeSliceOrchestratorClient(target)
    grant = await asyncio.to_thread(client.acquire)
    assert grant.epoch == 1
    await asyncio.to_thread(client.release)
    client.close()
    token.write_text("token-x")  # pod-x: no claim of this driver
    other = TimeSliceOrchestratorClient(target)
    with pytest.raises(GroupNotFound, match=r"no group named, and the calling pod \(pod-x\) holds no claim"):
        await asyncio.to_thread(other.acquire)
    other.close()
    token.unlink()
    with pytest.raises(ValueError, match="no group id"):
        TimeSliceOrchestratorClient(target, "ns/a").acquire()


async def test_a_pod_with_several_claims_is_told_to_name_one(tmp_path, monkeypatch) -> None:
    from timeslice import InvalidRequest

    orch = Orchestrator([GroupSpec(id="g1", members=(MemberSpec(claim_set="ns/a:gpu", claims_by_agent={},
                                                                 pod_uids=("pod-a",)),)),
                         GroupSpec(id="g2", members=(MemberSpec(claim_set="ns/a:rollout", claims_by_agent={},
                                                                 pod_uids=("pod-a",)),))])
    orch.set_aliases({(pod_key("pod-a"), "gpu"): (("g1", "ns/a:gpu"),),
                      (pod_key("pod-a"), "rollout"): (("g2", "ns/a:rollout"),)})
    srv, port = await create_server(orch, "127.0.0.1:0", TokenReviewAuthenticator(FakeReviews({"token-a": "pod-a"})))
    token = tmp_path / "token"
    token.write_text("token-a")
    monkeypatch.setenv("TIMESLICE_TOKEN_FILE", str(token))
    monkeypatch.delenv("TIMESLICE_GROUP", raising=False)
    client = TimeSliceOrchestratorClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(InvalidRequest, match=r"holds 2 claims of this driver \(gpu, rollout\): name one"):
            await asyncio.to_thread(client.acquire)
    finally:
        client.close()
        await srv.stop(0)
        await orch.close()
