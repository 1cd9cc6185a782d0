"""The client library against a real orchestrator: decorators, errors, retries, keep-alive."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import grpc
import pytest
from timeslice import (
    AcquireTimeout,
    AsyncTimeSliceOrchestratorClient,
    GroupNotFound,
    InvalidRequest,
    LeaseLost,
    NotHolding,
    OrchestratorUnavailable,
    TimeSliceOrchestratorClient,
    _rpc,
)
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.service import OrchestratorServicer
from timeslice.driver import grpc_server
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

from bench.machine import free_port
from tests.conftest import eventually


async def test_sync_decorator_and_context_manager(make_cluster) -> None:
    c = await make_cluster()
    client = TimeSliceOrchestratorClient(c.target, "job-a", "g")

    @client.on_accelerators()
    def phase(x: int) -> int:
        assert client.holding() is not None
        return x * 2

    assert await asyncio.to_thread(phase, 21) == 42
    assert client.holding() is None

    def block() -> None:
        with client.on_accelerators("g"):
            with client.on_accelerators("g"):  # nested: same grant, released once at the end
                pass
            assert client.holding() is not None
        assert client.holding() is None

    await asyncio.to_thread(block)
    assert (await c.status()).grants == 2
    await asyncio.to_thread(client.close)  # Leave is answered by this loop


async def test_sync_client_decorates_async_functions_without_blocking_the_loop(make_cluster) -> None:
    c = await make_cluster()
    client = TimeSliceOrchestratorClient(c.target, "job-a", "g")

    @client.on_accelerators()
    async def phase() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await phase() == "done"
    await asyncio.to_thread(client.close)  # Leave is answered by this loop


async def test_a_sync_clients_async_step_cancelled_while_waiting_releases_the_grant_it_gets_later(
        make_cluster) -> None:
    """A new user's input: a sync client's decorated `async def` step under
    `asyncio.wait_for`, cancelled while it waits. Its acquire runs on in a worker thread
    (nothing stops a thread): the grant it got later was held by nobody, for good, and the
    other jobs waited until the job ended. Now such a grant is released at once."""
    c = await make_cluster()
    holder, other = c.client("holder"), c.client("other")
    client = TimeSliceOrchestratorClient(c.target, "x", "g")

    @client.on_accelerators()
    async def step() -> None:
        raise AssertionError("never entered: cancelled while waiting")

    await holder.acquire()
    waiting = asyncio.create_task(step())

    async def x_waits() -> bool:
        return any(w.job_id == "x" for w in (await c.status()).waiters)
    await eventually(x_waits, timeout=30, what="x waiting")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await holder.release()  # x is granted now, in its worker thread, with nobody inside
    await other.acquire(timeout=30)  # ... and released at once: the group is not held for good
    assert client.holding() is None
    await other.release()
    await holder.close()
    await other.close()
    await asyncio.to_thread(client.close)


def test_a_generator_function_is_refused_by_the_decorator() -> None:
    """A new user's input: `@on_accelerators()` on a generator function released before the
    body ran (the call returns the generator at once): every GPU call of it ran outside the
    hold, beside the next holder's."""
    client = TimeSliceOrchestratorClient("127.0.0.1:1", "x", "g")
    try:
        with pytest.raises(TypeError, match="generator function"):
            @client.on_accelerators()
            def rollout(n: int):
                yield from range(n)
        with pytest.raises(TypeError, match="generator function"):
            @client.on_accelerators()
            async def stream(n: int):
                yield n
    finally:
        client.close()


async def test_async_client_decorator_and_errors(make_cluster) -> None:
    c = await make_cluster()
    a, b = c.client("a"), c.client("b")

    @a.on_accelerators()
    async def phase() -> int:
        return 7

    assert await phase() == 7
    with pytest.raises(TypeError, match="not `async def`"):
        a.on_accelerators()(lambda: None)
    await a.acquire()
    with pytest.raises(AcquireTimeout):
        await b.acquire(timeout=0.2)
    with pytest.raises(GroupNotFound):
        await b.acquire("missing")
    with pytest.raises(InvalidRequest, match="job_id"):
        await c.client("bad job").acquire()
    with pytest.raises(NotHolding):
        await b.release()
    await a.close()
    await b.close()


async def test_lost_lease_raises_on_scope_exit(make_cluster) -> None:
    c = await make_cluster(lease_seconds=0.3)
    client = TimeSliceOrchestratorClient(c.target, "job-a", "g")
    holding = asyncio.Event()
    loop = asyncio.get_running_loop()

    def body() -> None:
        import time
        with client.on_accelerators():
            loop.call_soon_threadsafe(holding.set)
            deadline = time.monotonic() + 30
            while client.holding() is not None:  # until its keep-alive hears that the lease is gone
                assert time.monotonic() < deadline, "the client never noticed its lost lease"
                time.sleep(0.01)

    task = asyncio.create_task(asyncio.to_thread(body))
    await holding.wait()
    c.orchestrator.group("g").drop_job("job-a", "test takes the lock away")
    with pytest.raises(LeaseLost):
        await task
    await asyncio.to_thread(client.close)  # Leave is answered by this loop


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
async def test_a_client_whose_lease_was_lost_says_it_lives_until_it_releases(kind: str) -> None:
    """Once its keep-alive is refused (the lease lost: revoked, lapsed), a client goes on
    calling with `lost` set until it releases: an `app` job whose hold ended unreleased keeps
    its engine awake while a client of it lives, whatever the node's processes look like (a
    review's finding: a short-lived process of the job, seen once, looked like a client that died)."""
    calls: list[bool] = []

    class Recording(OrchestratorServicer):
        async def KeepAlive(self, request, context):
            calls.append(request.lost)
            return await super().KeepAlive(request, context)

    orch = Orchestrator([GroupSpec(id="g", lease_seconds=0.3)])
    server, port = await serve(Recording(orch))
    try:
        if kind == "sync":
            client = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g")
            await asyncio.to_thread(client.acquire)
        else:
            aclient = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g")
            await aclient.acquire()
        orch.group("g").drop_job("a", "test takes the lock away")
        await eventually(lambda: calls.count(True) >= 3, what="three calls after the loss")
        assert calls[:calls.index(True)] and not any(calls[:calls.index(True)]) and all(calls[calls.index(True):])
        if kind == "sync":  # a new grant supersedes the lost hold: its calls stop (one may be on its way)
            await asyncio.to_thread(client.acquire)
        else:
            await aclient.acquire()
        lost_calls, n = calls.count(True), len(calls)
        await eventually(lambda: calls[n:].count(False) >= 2, what="the new hold's keep-alives")
        assert calls.count(True) <= lost_calls + 1
        orch.group("g").drop_job("a", "test takes the lock away again")
        with pytest.raises(LeaseLost):
            if kind == "sync":
                await asyncio.to_thread(client.release)
            else:
                await aclient.release()
        if kind == "sync":
            await asyncio.to_thread(client.close)
        else:
            await aclient.close()
    finally:
        await server.stop(0)
        await orch.close()


async def serve(servicer: OrchestratorServicer, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int]:
    """A started orchestrator server with `servicer` (a subclass that misbehaves on purpose)."""
    server = grpc_server.new_server()
    pb_grpc.add_OrchestratorServicer_to_server(servicer, server)
    port = grpc_server.bind(server, address)
    await server.start()
    return server, port


async def test_unavailable_is_retried_with_the_same_request_id() -> None:
    """The first two Acquire calls fail with UNAVAILABLE; the client retries with one request id."""
    seen: list[str] = []

    class Flaky(OrchestratorServicer):
        async def Acquire(self, request, context):
            seen.append(request.request_id)
            if len(seen) <= 2:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
            return await super().Acquire(request, context)

    orch = Orchestrator([GroupSpec(id="g")])
    server, port = await serve(Flaky(orch))
    try:
        client = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g")
        grant = await asyncio.to_thread(client.acquire)
        assert grant.epoch == 1 and len(seen) == 3 and len(set(seen)) == 1
        assert (await asyncio.to_thread(client.release)) == 0
        await asyncio.to_thread(client.close)  # Leave is answered by this loop
    finally:
        await server.stop(0)
        await orch.close()


async def test_cancelled_by_the_server_is_retried_with_the_same_request_id() -> None:
    """A stopping leader's in-flight Acquire can come back CANCELLED (e2e: deleting the leader
    pod failed a job with `acquire gpu: CANCELLED`); only the server side sends it to these
    blocking calls, so the client retries as for UNAVAILABLE, and past `unavailable_timeout`
    raises a typed error, not the base one (issue 10, item 15)."""
    seen: list[str] = []
    always = False

    class Stopping(OrchestratorServicer):
        async def Acquire(self, request, context):
            seen.append(request.request_id)
            if always or len(seen) == 1:
                await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
            return await super().Acquire(request, context)

    orch = Orchestrator([GroupSpec(id="g")])
    server, port = await serve(Stopping(orch))
    try:
        client = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g")
        grant = await asyncio.to_thread(client.acquire)
        assert grant.epoch == 1 and len(seen) == 2 and len(set(seen)) == 1
        await asyncio.to_thread(client.close)
        always = True
        other = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "b", "g", unavailable_timeout=0.3)
        with pytest.raises(OrchestratorUnavailable, match="acquire g: CANCELLED"):
            await asyncio.to_thread(other.acquire)
        await asyncio.to_thread(other.close)
    finally:
        await server.stop(0)
        await orch.close()


async def test_orchestrator_started_late_is_reached_by_retries() -> None:
    port = free_port()
    client = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g", unavailable_timeout=10)
    loop = asyncio.get_running_loop()
    refused = asyncio.Event()

    def on_state(state: grpc.ChannelConnectivity) -> None:
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            loop.call_soon_threadsafe(refused.set)

    client._channel.subscribe(on_state)
    task = asyncio.create_task(asyncio.to_thread(client.acquire))
    await asyncio.wait_for(refused.wait(), 30)  # the client tried, and nothing listened
    client._channel.unsubscribe(on_state)
    orch = Orchestrator([GroupSpec(id="g")])
    server, _ = await serve(OrchestratorServicer(orch), f"127.0.0.1:{port}")
    try:
        assert (await asyncio.wait_for(task, 10)).epoch == 1
        await eventually(lambda: orch.group("g").holder is not None)
    finally:
        await asyncio.to_thread(client.close)  # releases over RPC: not on the server's loop
        await server.stop(0)
        await orch.close()


async def test_unreachable_orchestrator_raises_unavailable_and_says_at_once_that_it_retries(caplog) -> None:
    """`timeslice run` against an orchestrator not up yet was silent for 30 s: the first
    UNAVAILABLE of a call is a warning (once), naming how long it tries again."""
    caplog.set_level(logging.WARNING, "timeslice")
    client = TimeSliceOrchestratorClient("127.0.0.1:1", "a", "g", unavailable_timeout=0.3)
    with pytest.raises(OrchestratorUnavailable):
        await asyncio.to_thread(client.acquire)
    client.close()
    said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(said) == 1 and "trying again for up to 0.3 s" in said[0], said


def test_settings_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("TIMESLICE_ORCHESTRATOR", raising=False)
    with pytest.raises(ValueError, match="TIMESLICE_ORCHESTRATOR"):
        TimeSliceOrchestratorClient(job_id="a")
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR", "127.0.0.1:1")
    monkeypatch.setenv("TIMESLICE_JOB", "env-job")
    client = TimeSliceOrchestratorClient()
    assert client.job_id == "env-job"
    with pytest.raises(ValueError, match="TIMESLICE_GROUP"):
        client.on_accelerators()
    client.close()


def test_client_imports_with_only_grpcio_and_protobuf() -> None:
    """Block every server-side dependency and the frameworks of `timeslice.integrations`;
    `import timeslice` must still work, and so must the Ray decorator (it does not import Ray)."""
    code = (
        "import sys\n"
        "for m in ('pydantic', 'yaml', 'kubernetes', 'cuda', 'pynvml', 'prometheus_client', 'grpc_health',\n"
        "          'torch', 'transformers', 'ray'):\n"
        "    sys.modules[m] = None\n"
        "import timeslice\n"
        "from timeslice import TimeSliceOrchestratorClient, AsyncTimeSliceOrchestratorClient\n"
        "import timeslice.integrations.ray\n"
        "assert not any(k.startswith(('timeslice.driver', 'timeslice.controller', 'timeslice.kubelet_plugin'))"
        " for k in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_a_client_that_gives_up_as_the_grant_comes_leaves_no_grant_behind() -> None:
    """Issue 10, item 6: clients told AcquireTimeout while the server had granted them; each
    ghost hold lasted a full lease. Here the grant's reply is held back past the client's
    timeout, deterministically: the client's CancelAcquire gives the grant back."""
    gave_up = asyncio.Event()

    class SlowReply(OrchestratorServicer):
        async def Acquire(self, request, context):
            resp = await super().Acquire(request, context)
            if request.job_id == "late":  # granted, but the reply comes after the caller gave up
                await asyncio.wait_for(gave_up.wait(), 30)
            return resp

        async def CancelAcquire(self, request, context):
            try:
                return await super().CancelAcquire(request, context)
            finally:
                gave_up.set()

    orch = Orchestrator([GroupSpec(id="g", lease_seconds=60)])
    server, port = await serve(SlowReply(orch))
    late = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "late", "g")
    other = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "other", "g")
    try:
        with pytest.raises(AcquireTimeout):
            await asyncio.to_thread(late.acquire, timeout=0.3)
        await eventually(lambda: orch.group("g").holder is None)  # given back, not held for 60 s
        assert (await asyncio.to_thread(other.acquire, timeout=5)).epoch == 2
    finally:
        await asyncio.to_thread(other.close)
        await asyncio.to_thread(late.close)
        await server.stop(0)
        await orch.close()


async def test_the_pods_of_one_unit_share_a_hold_until_the_last_releases(make_cluster) -> None:
    """Issue 11, item 2: when both pods of one unit held, the first pod's release ended the
    hold while the other pod still computed, and the other pod's release was then refused.
    Each pod (its own client, the same job) acquires; the second joins the hold without a
    switch; the hold ends with the last release, and only then is another job granted."""
    c = await make_cluster()
    pod0, pod1, other = c.client("unit"), c.client("unit"), c.client("other")
    g0 = await pod0.acquire("g")
    g1 = await pod1.acquire("g")  # joins: same lease, same epoch
    assert (g1.lease_id, g1.epoch) == (g0.lease_id, g0.epoch) and g1.request_id != g0.request_id
    waiter = asyncio.ensure_future(other.acquire("g"))
    await eventually(lambda: c.orchestrator.group("g").queue.head() is not None)
    await pod0.release("g")  # pod 1 still computes: the unit keeps the hold
    assert not waiter.done() and c.orchestrator.group("g").holder.job_id == "unit"
    await pod1.release("g")  # accepted, and it ends the hold
    granted = await asyncio.wait_for(waiter, 10)
    assert granted.epoch == g0.epoch + 1
    await other.release("g")
    for cl in (pod0, pod1, other):
        await cl.close()


async def test_a_job_declares_its_memory_from_the_environment_the_client_or_one_acquire(make_cluster,
                                                                                         monkeypatch) -> None:
    """Issue 21, item 1: `TIMESLICE_MEMORY`, `memory=` on the client and on one acquire (bytes
    per GPU, Kubernetes quantities) reach the orchestrator, which reserves it for the job."""
    c = await make_cluster()
    declared = c.orchestrator.group("g").residency.declared
    monkeypatch.setenv("TIMESLICE_MEMORY", "57Gi")
    env = c.client("env")
    assert env.memory == 57 * 2**30
    await env.acquire()
    assert declared["env"] == 57 * 2**30
    await env.release()
    monkeypatch.delenv("TIMESLICE_MEMORY")
    own = c.client("own", memory="60G")
    await own.acquire(memory=1024)  # one acquire overrides it
    assert declared["own"] == 1024
    await own.release()
    await own.acquire()
    assert declared["own"] == 60 * 10**9
    await own.release()
    status = {j.job_id: j for j in (await c.status()).jobs}
    assert status["own"].declared_bytes == 60 * 10**9 and status["own"].settled
    for client in (env, own):
        await client.close()


def test_a_malformed_memory_is_refused_where_it_is_set(monkeypatch) -> None:
    monkeypatch.setenv("TIMESLICE_MEMORY", "57")  # meant as GB, read as 57 bytes before: a unit is asked for
    with pytest.raises(ValueError, match=r"\$TIMESLICE_MEMORY '57': a bare number is ambiguous; give its unit"):
        TimeSliceOrchestratorClient("127.0.0.1:1", "a")
    monkeypatch.setenv("TIMESLICE_MEMORY", "lots")
    with pytest.raises(ValueError, match=r"\$TIMESLICE_MEMORY 'lots': use a quantity"):
        TimeSliceOrchestratorClient("127.0.0.1:1", "a", "g")
    monkeypatch.delenv("TIMESLICE_MEMORY")
    client = TimeSliceOrchestratorClient("127.0.0.1:1", "a", "g", memory="8Gi")
    with pytest.raises(ValueError, match="memory -1"):
        client.memory = -1
    assert client.memory == 8 * 2**30
    client.close()


def test_ray_methods_run_without_holding_when_no_orchestrator_is_configured(monkeypatch, caplog) -> None:
    """An integration with no orchestrator configured raised where it should do nothing: the
    decorated methods run, nothing is held, one warning says so (issue 25, item 4). The
    decorator works on any class (Ray pickles it by reference), so no Ray is needed here."""
    import timeslice.integrations.ray as ts_ray

    monkeypatch.delenv("TIMESLICE_ORCHESTRATOR", raising=False)
    ts_ray._unconfigured.cache_clear()
    caplog.set_level(logging.WARNING, "timeslice")

    class Trainer:
        @ts_ray.on_accelerators("trainer")
        def step(self, x: int) -> int:
            return x + 1

        @ts_ray.on_accelerators("trainer")
        async def astep(self, x: int) -> int:
            return x + 2

    t = Trainer()
    assert t.step(1) == 2 and t.step(2) == 3 and asyncio.run(t.astep(1)) == 3
    assert ts_ray.CLIENT_ATTRIBUTE not in vars(t)
    said = [r.getMessage() for r in caplog.records if "no orchestrator configured" in r.getMessage()]
    assert len(said) == 1, said


class Unanswered(OrchestratorServicer):
    """Answers the first `silent` Releases of each request never: `performed` first (the call
    takes effect, and the caller's try times out: a `timeslice serve` stopped with Ctrl-Z
    after it read the call), else before it takes effect (stopped before). `seen`: the request
    id of every Release."""

    def __init__(self, orch: Orchestrator, silent: int = 1, performed: bool = True) -> None:
        super().__init__(orch)
        self.silent, self.performed = silent, performed
        self.seen: list[str] = []

    async def Release(self, request, context):
        self.seen.append(request.request_id)
        silent = self.seen.count(request.request_id) <= self.silent
        if silent and not self.performed:
            await asyncio.Event().wait()  # cancelled once the caller's deadline passes
        resp = await super().Release(request, context)
        if silent:
            await asyncio.Event().wait()
        return resp


async def test_a_release_answered_too_late_is_asked_again_and_counts_as_done(caplog) -> None:
    """r05: a Release whose answer did not come within the per-call timeout (serve paused) raised
    `AcquireTimeout release g: DEADLINE_EXCEEDED` out of the job's scope. Now it is asked again,
    and the orchestrator's refusal of the repeat (the first try had ended the hold) counts as
    done; a shared hold's part released twice ends only that part (the unit's other pod holds
    on). Both clients."""
    caplog.set_level(logging.WARNING, "timeslice")
    orch = Orchestrator([GroupSpec(id="g", lease_seconds=60)])
    servicer = Unanswered(orch)
    server, port = await serve(servicer)
    target = f"127.0.0.1:{port}"
    try:
        client = TimeSliceOrchestratorClient(target, "a", "g", call_timeout=0.3)
        grant = await asyncio.to_thread(client.acquire)
        assert await asyncio.to_thread(client.release) == 0
        assert servicer.seen == [grant.request_id] * 2 and orch.group("g").holder is None
        said = [r.getMessage() for r in caplog.records if "no answer" in r.getMessage()]
        assert said == ["release g: no answer from the orchestrator within 0.3 s (it may be paused or overloaded): "
                        "trying again for up to 30 s"], said
        await asyncio.to_thread(client.close)

        pod0, pod1 = (TimeSliceOrchestratorClient(target, "unit", "g", call_timeout=0.3) for _ in range(2))
        g0, g1 = await asyncio.to_thread(pod0.acquire), await asyncio.to_thread(pod1.acquire)
        assert g0.lease_id == g1.lease_id
        await asyncio.to_thread(pod0.release)
        assert servicer.seen[-2:] == [g0.request_id] * 2
        assert orch.group("g").holder is not None and orch.group("g").holder.job_id == "unit"
        await asyncio.to_thread(pod1.release)
        assert orch.group("g").holder is None
        for c in (pod0, pod1):
            await asyncio.to_thread(c.close)

        aio = AsyncTimeSliceOrchestratorClient(target, "b", "g", call_timeout=0.3)
        grant = await aio.acquire()
        assert await aio.release() == 0
        assert servicer.seen[-2:] == [grant.request_id] * 2 and orch.group("g").holder is None
        await aio.close()
    finally:
        await server.stop(0)
        await orch.close()


async def test_a_release_never_answered_raises_unavailable_naming_it_within_its_bound() -> None:
    """Past `call_timeout + unavailable_timeout` seconds without an answer a release raises
    OrchestratorUnavailable naming the release (not AcquireTimeout), after several tries."""
    orch = Orchestrator([GroupSpec(id="g", lease_seconds=60)])
    servicer = Unanswered(orch, silent=1000, performed=False)
    server, port = await serve(servicer)
    try:
        client = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g", call_timeout=0.2,
                                             unavailable_timeout=1.0)
        await asyncio.to_thread(client.acquire)
        t0 = time.monotonic()
        with pytest.raises(OrchestratorUnavailable, match=r"^release g: no answer from the orchestrator within "
                                                          r"0.2 s per try, tried for 1 s more \(DEADLINE_EXCEEDED"):
            await asyncio.to_thread(client.release)
        took = time.monotonic() - t0
        assert 1.2 <= took < 1.2 + 1.0, took  # the bound, and some slack for a loaded machine
        assert len(servicer.seen) >= 3
        await asyncio.to_thread(client.close)
    finally:
        await server.stop(0)
        await orch.close()


class Status(grpc.RpcError):
    """A gRPC error value of `code` (the input of `_rpc.Retry`)."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


def test_the_default_retry_rule_asks_a_call_answered_at_once_again_but_not_an_acquire() -> None:
    """With the defaults (10 s a try, 30 s of tries), a Release or KeepAlive not answered in time
    is asked again, and a refusal of the repeat of a release counts as done; an Acquire's own
    DEADLINE_EXCEEDED (its timeout passed) is AcquireTimeout, as before."""
    client = TimeSliceOrchestratorClient("127.0.0.1:1", "a", "g")
    assert (client._s.call_timeout, client._s.unavailable_timeout) == (_rpc.CALL_TIMEOUT, 30.0) == (10.0, 30.0)
    client.close()
    release = _rpc.Retry("release g", None, 30.0, retried_ok=True, call_timeout=_rpc.CALL_TIMEOUT)
    assert release.remaining() == 10.0
    pause = release.pause_after(Status(grpc.StatusCode.DEADLINE_EXCEEDED), release.remaining())
    assert pause is not None and 0 < pause <= _rpc.BACKOFF_FIRST
    assert 9.9 < release.remaining() <= 10.0  # a try is cut only near the window's end
    assert release.pause_after(Status(grpc.StatusCode.FAILED_PRECONDITION), 10.0) is None
    keep_alive = _rpc.Retry("keep-alive g", None, 30.0, call_timeout=_rpc.CALL_TIMEOUT)
    assert keep_alive.pause_after(Status(grpc.StatusCode.DEADLINE_EXCEEDED), 10.0) is not None
    with pytest.raises(LeaseLost):  # a keep-alive refused after a retry is a lost lease
        keep_alive.pause_after(Status(grpc.StatusCode.FAILED_PRECONDITION), 10.0)
    acquire = _rpc.Retry("acquire g", time.monotonic() + 5, 30.0)
    with pytest.raises(AcquireTimeout, match="acquire g: DEADLINE_EXCEEDED"):
        acquire.pause_after(Status(grpc.StatusCode.DEADLINE_EXCEEDED), 1.0)
    with pytest.raises(OrchestratorUnavailable, match="no answer"):  # no window: raised at the first
        _rpc.Retry("release g", None, 0.0, call_timeout=1.0).pause_after(Status(grpc.StatusCode.DEADLINE_EXCEEDED), 1.0)
