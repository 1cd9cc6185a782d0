"""Backend `app`: what an engine answers is not trusted (issue 22, item 3).

Found by an attacker-minded try: the agent followed an engine's redirects to any host and
port and put the reply text into group status; it read reply bodies with no bound (a
400 MB body took it to 938 MB); it took `is_sleeping: true` with no sleep sent and no
memory check. The engines are real processes (`tests/fake_engine.py`) with those faults;
NVML is the one stand-in, as in tests/test_app_backend.py.
"""

from __future__ import annotations

import asyncio
import resource
from pathlib import Path

import aiohttp
import grpc
import grpc.aio
import pytest
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.errors import BackendError
from timeslice.errors import SwitchFailed
from timeslice.kubelet_plugin.agent.backends import make_backend
from timeslice.kubelet_plugin.agent.backends.app import MAX_ERROR_TEXT, MAX_REPLY_BYTES
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server

from tests.conftest import eventually
from tests.fake_engine import ASLEEP_BYTES, AWAKE_BYTES, HUGE_BODY_BYTES, nvml_stand_in
from tests.test_app_backend import calls, fault, is_sleeping, start_engine, two_jobs


@pytest.fixture
def engine_dirs(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "memory").mkdir()
    return tmp_path / "calls.log", tmp_path / "memory"


async def stats(engine: AppEngine) -> dict:
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/fake/stats") as r:
        return await r.json()  # type: ignore[no-any-return]


async def send(engine: AppEngine, path: str) -> None:
    """A call of the engine's API by someone other than the agent (the job's own framework)."""
    async with aiohttp.ClientSession() as s, s.post(engine.url + path) as r:
        assert r.status == 200


def assert_printable_and_short(text: str) -> None:
    assert all(" " <= c <= "~" for c in text), f"unprintable engine text in {text!r}"


async def test_engine_redirects_are_not_followed(make_cluster, children, engine_dirs, tmp_path) -> None:
    """A 3xx fails the call, naming its status; the host it points to is never called, by
    the switch (GET /is_sleeping) nor by a restore (POST /wake_up)."""
    log, memory = engine_dirs
    (tmp_path / "other").mkdir()
    _, other = await start_engine(children, "vllm", "other", log, tmp_path / "other")  # records any call it gets
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs, "vllm")
    a, b = c.client("a"), c.client("b", retry_failed_switches=False)
    try:
        await a.acquire(timeout=10)
        await a.release()
        await fault(a_engine, redirect=other.url)
        with pytest.raises(SwitchFailed, match=r"checkpoint of a failed.*GET /is_sleeping answered HTTP 307, a "
                                               r"redirect .*not followed"):
            await b.acquire(timeout=10)
        assert set((await stats(a_engine))["hits"]) == {"GET /is_sleeping"}  # answered 307, nothing sent after
        status = await c.status()
        error = status.recent_switches[-1].error
        assert not status.recent_switches[-1].ok and "HTTP 307" in error
        assert other.url + "/is_sleeping" in error and len(error) < 1000  # the Location, quoted short
        # a restore of an engine that redirects: POST /wake_up is not sent on either
        backend = make_backend("app", memory_probe=nvml_stand_in(memory)).bind(a_engine)
        with pytest.raises(BackendError, match=r"POST /wake_up answered HTTP 307, a redirect"):
            await backend.restore([children[1].pid], timeout=5)  # a's engine process
        assert (await stats(other))["hits"] == [] and calls(log) == []  # nothing reached the other engine
        assert not await is_sleeping(other)
        await fault(a_engine, redirect="ok")
        await b.acquire(timeout=10)  # the engine answers again: the switch runs
        assert calls(log) == ["a sleep level=1"]
        await b.release()
    finally:
        for cl in (a, b):
            await cl.close()


async def test_a_huge_engine_reply_is_read_to_a_bound_and_quoted_short(children, engine_dirs, short_tmp) -> None:
    """An engine that answers a sleep with a 1 GiB body (control characters first): the step
    fails at once with a short, printable excerpt; the agent reads a bounded share of the
    body (the engine sees the connection closed long before the end) and its memory stays
    flat; another job's step on the same agent runs meanwhile."""
    log, memory = engine_dirs
    pa, a_engine = await start_engine(children, "vllm", "a", log, memory)
    pb, b_engine = await start_engine(children, "vllm", "b", log, memory)
    await fault(a_engine, sleep="huge-body")
    agent = NodeAgent(StaticProcessResolver({"a": [pa.pid], "b": [pb.pid]}), backends=["app"],
                      memory_probe=nvml_stand_in(memory))
    server, _ = await create_server(agent, f"unix://{short_tmp / 'agent.sock'}")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp / 'agent.sock'}") as ch:
            stub = apb_grpc.NodeAgentStub(ch)

            def step(job: str, engine: AppEngine) -> object:
                return stub.Checkpoint(apb.SwitchStepRequest(job_id=job, backend="app", app=apb.AppEngine(
                    engine="vllm", url=engine.url)), timeout=20)

            a_step, b_step = await asyncio.gather(step("a", a_engine), step("b", b_engine), return_exceptions=True)
            assert isinstance(b_step, apb.SwitchStepResponse) and b_step.bytes == AWAKE_BYTES - ASLEEP_BYTES
            assert isinstance(a_step, grpc.aio.AioRpcError), a_step
            details = a_step.details() or ""
            assert "POST /sleep answered HTTP 500: boom?[31m X-Injected: 1?? " in details
            assert f"a body over {MAX_REPLY_BYTES} bytes, read no further" in details
            assert "the engine reports it is awake" in details  # it never slept: nothing to undo
            assert_printable_and_short(details)
            assert len(details) < 2 * MAX_ERROR_TEXT + 400  # the excerpt, and the agent's own words
            await eventually(lambda: _ended(a_engine), timeout=10, what="the engine saw the connection closed")
            sent = await stats(a_engine)
            assert sent["body_sent"] < 64 << 20 < HUGE_BODY_BYTES, sent  # socket buffers, not the body
            # an answer of is_sleeping over the bound is an error, not an answer
            await fault(a_engine, sleep="ok", is_sleeping="huge-body")
            with pytest.raises(BackendError, match=rf"GET /is_sleeping answered HTTP 200 with a body over "
                                                   rf"{MAX_REPLY_BYTES} bytes"):
                await make_backend("app").bind(a_engine).state([pa.pid])
            await eventually(lambda: _ended(a_engine), timeout=10, what="the engine saw the connection closed")
            assert (await stats(a_engine))["body_sent"] < 64 << 20
            await stub.Restore(apb.SwitchStepRequest(job_id="b", backend="app"), timeout=20)  # still serving
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        assert grown < 256 << 20, f"the agent's peak memory grew by {grown >> 20} MiB"
        assert calls(log) == ["b sleep level=1", "b wake"]
    finally:
        await server.stop(0)


async def _ended(engine: AppEngine) -> bool:
    return bool((await stats(engine))["body_ended"])


async def test_an_engine_that_says_it_sleeps_is_not_taken_at_its_word(children, engine_dirs) -> None:
    """`is_sleeping: true` alone sends nothing only when NVML shows the engine's memory freed
    since this agent saw it awake; else the sleep is sent and checked as any other."""
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "vllm", "a", log, memory)
    backend = make_backend("app", memory_probe=nvml_stand_in(memory)).bind(engine)
    await fault(engine, is_sleeping="lie")  # awake, holding AWAKE_BYTES, and says it sleeps
    states = await backend.checkpoint([proc.pid], timeout=5)
    assert calls(log) == ["a sleep level=1"]  # sent, and NVML saw the memory drop
    assert [(s.state, s.gpu_bytes) for s in states] == [("checkpointed", AWAKE_BYTES - ASLEEP_BYTES)]
    await backend.restore([proc.pid], timeout=5)
    assert calls(log)[-1] == "a wake"

    # it says it sleeps, and a sleep frees nothing: not a checkpoint, and the engine is left as found
    await fault(engine, sleep="keep-memory")
    with pytest.raises(BackendError, match=rf"did not drop: {AWAKE_BYTES} bytes before, {AWAKE_BYTES} after.*"
                                           r"answered is_sleeping: true before this sleep was sent.*left as it "
                                           r"was found"):
        await backend.checkpoint([proc.pid], timeout=5)
    assert calls(log)[-2:] == ["a wake", "a sleep level=1"]  # no wake after it

    # asleep by its framework's own call (not the agent's): taken, with nothing sent, as NVML
    # shows what it held awake freed
    await fault(engine, sleep="ok", is_sleeping="ok")
    await send(engine, "/wake_up")
    await send(engine, "/sleep?level=1")
    sent = len(calls(log))
    states = await backend.checkpoint([proc.pid], timeout=5)
    assert [(s.state, s.gpu_bytes) for s in states] == [("checkpointed", AWAKE_BYTES - ASLEEP_BYTES)]
    assert len(calls(log)) == sent  # nothing sent

    # an agent that never saw it awake (a fresh one) sends the sleep (a no-op for a sleeping
    # vLLM) and sees nothing freed: as its processes hold no more than a sleep keeps, that is
    # all there was to free (an engine that holds more and frees none fails: above)
    fresh = make_backend("app", memory_probe=nvml_stand_in(memory)).bind(engine)
    states = await fresh.checkpoint([proc.pid], timeout=5)
    assert [(s.state, s.gpu_bytes) for s in states] == [("checkpointed", 0)]
    assert calls(log)[sent:] == ["a sleep level=1"] and await is_sleeping(engine)
