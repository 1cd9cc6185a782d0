"""Backend `app`: a hold that ends without its client's release (`maxHoldSeconds`, a lapsed
lease) never puts an engine to sleep under a client that still generates, and every wake
of an engine reaches its client (issue 22, item 3).

The engines and the client that is killed are real processes (`tests/fake_engine.py`;
`POST /v1/completions` stands for a client's rollout requests, logged `generate`, or
`generate-asleep` when the engine sleeps); the orchestrator and the node agents are real
servers, with the agents' NVML read from what the fake engines say they hold.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import aiohttp
import pytest
from timeslice.controller.orchestrator import takeover
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.gone_holders import GoneHolders
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.group_model import SwitchRecord
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.errors import StaleLease
from timeslice.errors import LeaseLost, SwitchFailed

from tests.conftest import eventually, python_child
from tests.test_app_backend import calls, fault, is_sleeping, two_jobs


@pytest.fixture
def engine_dirs(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "memory").mkdir()
    return tmp_path / "calls.log", tmp_path / "memory"


async def generate(engine: AppEngine) -> int:
    """One request of the job's client to its engine; the HTTP status."""
    async with aiohttp.ClientSession() as s, s.post(engine.url + "/v1/completions", json={"prompt": "x"}) as r:
        return r.status


async def preempted(c) -> bool:  # type: ignore[no-untyped-def]
    return (await c.status()).preemptions == 1


@pytest.mark.parametrize("level", [1, 2])
async def test_max_hold_revokes_the_lease_and_sleeps_the_engine_only_after_the_client_released(
        make_cluster, children, engine_dirs, level) -> None:
    """The tester's input: a holds and generates, b waits past maxHoldSeconds. Before the fix,
    a was parked (its lease kept, nothing said) and its engine put to sleep at once, while its
    client went on generating; with level 2 it was then woken and granted again under the
    grant its client still held (the old epoch)."""
    log, _ = engine_dirs
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs, lease_seconds=1.5,
                                 group={"max_hold_seconds": 0.3}, level=level)
    a, b = c.client("a"), c.client("b")
    try:
        ga = await a.acquire(timeout=10)
        assert await generate(a_engine) == 200
        tb = asyncio.create_task(b.acquire(timeout=30))
        await eventually(lambda: preempted(c), what="a preempted")
        status = await c.status()  # the preemption's own turn: nobody is granted, nothing is sent to a's engine
        assert status.phase == "idle" and not status.HasField("holder") and [w.job_id for w in status.waiters] == \
            ["b"], f"a's engine is being put to sleep while its client holds: phase {status.phase}"
        assert await generate(a_engine) == 200  # a's phase goes on: its engine answers
        await eventually(lambda: a.holding() is None, what="a's client told that its lease was revoked")
        assert await generate(a_engine) == 200 and not tb.done() and not await is_sleeping(a_engine)
        with pytest.raises(LeaseLost, match="revoked"):  # its release is refused, and lets its engine sleep
            await a.release()
        gb = await asyncio.wait_for(tb, 10)
        assert calls(log) == ["a generate"] * 3 + [f"a sleep level={level}"]  # b never slept: nothing to wake
        await b.release()
        ga2 = await a.acquire(timeout=10)  # the wake is reported: a new grant, restored
        assert calls(log)[-2:] == ["b sleep", "a wake"]
        assert ga2.restored and ga2.epoch > gb.epoch > ga.epoch and ga2.lease_id != ga.lease_id
        assert await generate(a_engine) == 200
        await a.release()
        status = await c.status()
        assert status.preemptions == 1 and status.failed_switches == 0
        assert "a generate-asleep" not in calls(log)
    finally:
        for cl in (a, b):
            await cl.close()


async def test_a_level2_engine_is_never_woken_under_the_grant_its_client_holds(make_cluster, children,
                                                                                 engine_dirs) -> None:
    """The tester's input for the silent wake: a (vLLM, sleep level 2: its weights are
    discarded) holds past maxHoldSeconds while b waits and holds only briefly. Before the
    fix a was slept, b held and released, and a's engine was woken and a granted again
    under its client's old lease: its client saw no change (its epoch), with its weights gone."""
    log, _ = engine_dirs
    c, _ = await two_jobs(make_cluster, children, engine_dirs, lease_seconds=1.5,
                          group={"max_hold_seconds": 0.3}, level=2)
    a, b = c.client("a"), c.client("b")

    async def b_phase():  # type: ignore[no-untyped-def]
        g = await b.acquire(timeout=30)
        await b.release()
        return g

    try:
        ga = await a.acquire(timeout=10)
        tb = asyncio.create_task(b_phase())
        await eventually(lambda: preempted(c), what="a preempted")
        await eventually(lambda: a.holding() is None or "a wake" in calls(log), what="a told, or its engine woken")
        assert "a wake" not in calls(log), (f"a's level-2 engine was woken under the grant its client still holds "
                                            f"(epoch {ga.epoch}): {calls(log)}")
        with pytest.raises(LeaseLost):
            await a.release()
        gb = await asyncio.wait_for(tb, 10)
        ga2 = await a.acquire(timeout=10)
        assert calls(log) == ["a sleep level=2", "b sleep", "a wake"]
        assert ga2.restored and ga2.epoch > gb.epoch
        await a.release()
    finally:
        for cl in (a, b):
            await cl.close()


async def test_a_level2_engine_woken_by_a_rollback_is_reported_restored(make_cluster, children,
                                                                         engine_dirs) -> None:
    """A switch that slept a (level 2) and failed to wake b wakes a again (the rollback): a's
    next grant, with nothing to move, says restored (its engine reloaded; before the fix:
    restored=False, as if its engine had kept its weights)."""
    log, _ = engine_dirs
    c, _ = await two_jobs(make_cluster, children, engine_dirs, level=2)
    b_engine = c.orchestrator.group("g").spec.app("b")
    assert b_engine is not None
    a, b = c.client("a"), c.client("b", retry_failed_switches=False)
    try:
        for client in (a, b, a):  # a resident and awake, b asleep
            await client.acquire(timeout=10)
            await client.release()
        await fault(b_engine, wake="fail")
        with pytest.raises(SwitchFailed, match="rolled back"):
            await b.acquire(timeout=10)
        assert calls(log)[-3:] == ["a sleep level=2", "b wake-failed", "a wake"]
        grant = await a.acquire(timeout=10)
        assert calls(log)[-1] == "a wake"  # nothing moved for this grant
        assert grant.restored, "a's engine was woken (its level-2 weights discarded) and its grant said restored=False"
        await a.release()
        again = await a.acquire(timeout=10)  # reported once
        assert not again.restored
        await a.release()
    finally:
        for cl in (a, b):
            await cl.close()


def client_process(target: str, engine: AppEngine, job: str = "a"):  # type: ignore[no-untyped-def]
    """A real client of `job`: acquires, says `granted <epoch>`, then generates on `engine`
    until killed."""
    return python_child(textwrap.dedent(f"""
        import urllib.request
        from timeslice import TimeSliceOrchestratorClient
        c = TimeSliceOrchestratorClient({target!r}, {job!r}, "g")
        g = c.acquire(timeout=10)
        print("granted", g.epoch, flush=True)
        while True:
            urllib.request.urlopen(urllib.request.Request({engine.url + "/v1/completions"!r}, data=b"{{}}",
                                                          method="POST")).read()
    """))


async def _killed_holder(make_cluster, children, engine_dirs):  # type: ignore[no-untyped-def]
    """a's client, a real process, holds and generates and is killed (SIGKILL: no release, no
    Leave); b waits; a's lease lapses. Returns (cluster, a's engine, b's client, b's acquire)."""
    log, _ = engine_dirs
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs, lease_seconds=1.0)
    p = client_process(c.target, a_engine)
    children.append(p)
    line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 30)  # type: ignore[union-attr]
    assert line.startswith("granted"), line
    await eventually(lambda: "a generate" in calls(log), what="a's client generating")
    b = c.client("b")
    tb = asyncio.create_task(b.acquire(timeout=30))
    await eventually(lambda: _waiting(c, "b"), what="b waiting")
    p.kill()
    p.wait()
    await eventually(lambda: _lapsed(c), what="a's lease lapsed")
    status = await c.status()  # the lapse's own turn: its engine is not slept on that alone
    assert status.phase == "idle" and [w.job_id for w in status.waiters] == ["b"], status.phase
    assert not await is_sleeping(a_engine) and not tb.done()
    return c, a_engine, b, tb


async def _waiting(c, job: str) -> bool:  # type: ignore[no-untyped-def]
    return job in [w.job_id for w in (await c.status()).waiters]


async def _lapsed(c) -> bool:  # type: ignore[no-untyped-def]
    return (await c.status()).lease_expiries == 1


async def test_a_lapsed_holder_whose_job_is_dropped_is_slept_then(make_cluster, children, engine_dirs) -> None:
    """Its lease lapsed, and its processes are known to be done (the job dropped: its pods
    gone): now its engine may sleep, and b is granted."""
    log, _ = engine_dirs
    c, _, b, tb = await _killed_holder(make_cluster, children, engine_dirs)
    try:
        c.orchestrator.drop_job("g", "a", "its pods are gone")
        await asyncio.wait_for(tb, 10)
        assert calls(log)[-1] == "a sleep level=1" and "a generate-asleep" not in calls(log)
        await b.release()
    finally:
        await b.close()


async def test_a_lapsed_holder_that_asks_again_holds_first_then_sleeps_after_its_release(
        make_cluster, children, engine_dirs) -> None:
    """The killed client's job asks again (its client restarted) while b waits for its engine:
    it is granted at once (its engine is awake: nothing moves, so the group does not wait
    for a release that will never come); its release lets its engine sleep for b."""
    log, _ = engine_dirs
    c, a_engine, b, tb = await _killed_holder(make_cluster, children, engine_dirs)
    a = c.client("a")
    try:
        ga = await a.acquire(timeout=10)
        assert not ga.restored and not tb.done() and not await is_sleeping(a_engine)
        assert await generate(a_engine) == 200
        await a.release()
        await asyncio.wait_for(tb, 10)
        assert calls(log)[-1] == "a sleep level=1" and "a generate-asleep" not in calls(log)
        await b.release()
    finally:
        for cl in (a, b):
            await cl.close()


async def test_a_merge_revokes_an_app_holders_lease_and_sleeps_its_engine_after_its_release() -> None:
    """Groups that merge keep one holder; the other, on `app`, is not parked (its engine slept
    under its client): its lease is revoked, and its engine leaves only after its release."""
    moves: list[tuple[tuple[str, ...], str, bool]] = []

    async def switcher(spec: GroupSpec, evict, incoming: str, restore: bool) -> SwitchRecord:  # type: ignore[no-untyped-def]
        moves.append((tuple(evict), incoming, restore))
        return SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict))

    engines = {j: AppEngine(engine="vllm", url=f"http://127.0.0.1:{port}") for j, port in (("a", 1), ("b", 2))}
    old, new = (LockGroup(GroupSpec(id=g, backend="app", agents=("unix:///x",), apps=engines), switcher)
                for g in ("old", "new"))
    try:
        ga = await old.acquire("a", 0, "a-1", None)
        gb = await new.acquire("b", 0, "b-1", None)
        takeover.carry(new, old, {"a"})
        with pytest.raises(StaleLease, match=r"revoked .*moved to group new"):
            new.keep_alive("a", ga.lease_id, ga.epoch)
        assert new.holder is not None and new.holder.job_id == "b" and new.awake.unreleased() == ["a"]
        new.release("b", gb.lease_id, gb.epoch, "b-1")
        again = asyncio.create_task(new.acquire("b", 0, "b-2", None))
        await eventually(lambda: len(new.queue) == 1, what="b waiting")
        assert not moves and new.switching is None  # a's engine stays awake for its client
        with pytest.raises(StaleLease, match="noted: its memory may now move off the GPUs"):
            new.release("a", ga.lease_id, ga.epoch, "a-1")
        await asyncio.wait_for(again, 5)
        assert moves == [(("a",), "b", False)]
    finally:
        await old.close()
        await new.close()


async def test_a_dead_clients_waiter_leaves_and_its_hold_left_by_the_jobs_next_process_ends_at_its_lapse() -> None:
    """Randomized schedules with backend `app`, seed 5: a's client was killed mid-hold and
    started again. The dead client's waiter had been kept when its connection dropped, as if
    its processes were frozen (an engine's sleep stops no client), and was granted; the new
    process's calls joined that hold, it finished and left, and the dead caller's part kept
    the hold until its lease lapsed, then kept a's engine awake for a release that never
    came: every other job waited for good. Now the waiter leaves with its connection, and a
    job that left while only another caller's part of its hold remained is dropped at the
    lapse (its engine slept, b granted)."""
    moves: list[tuple[tuple[str, ...], str, bool]] = []

    async def switcher(spec: GroupSpec, evict, incoming: str, restore: bool) -> SwitchRecord:  # type: ignore[no-untyped-def]
        moves.append((tuple(evict), incoming, restore))
        return SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict))

    engines = {j: AppEngine(engine="vllm", url=f"http://127.0.0.1:{port}") for j, port in (("a", 1), ("b", 2))}
    g = LockGroup(GroupSpec(id="g", backend="app", agents=("unix:///x",), apps=engines, residency="exclusive",
                            lease_seconds=0.5), switcher)
    try:
        gb = await g.acquire("b", 0, "b-1", None)
        g.release("b", gb.lease_id, gb.epoch, "b-1")
        ga = await g.acquire("a", 0, "a-1", None)  # b's engine sleeps: b is checkpointed
        assert "b" in g.residency.checkpointed
        b_waits = asyncio.create_task(g.acquire("b", 0, "b-2", None))
        await eventually(lambda: len(g.queue) == 1, what="b waiting")
        b_waits.cancel()  # its connection dropped (the client was killed): its engine sleeps, its client does not
        await eventually(lambda: not g.queue, what="b's waiter gone with its connection")
        again = await g.acquire("a", 0, "a-2", None)  # a's next process joins the hold of the one killed in it
        assert again.epoch == ga.epoch
        g.release("a", again.lease_id, again.epoch, "a-2")
        assert g.leave("a") == "busy"  # the next process is done; the killed one's part remains
        b_asks = asyncio.create_task(g.acquire("b", 0, "b-3", None))
        await asyncio.wait_for(b_asks, 10)  # after a's lease lapsed: a dropped, its engine slept
        assert moves[-1] == (("a",), "b", True)
    finally:
        await g.close()


async def test_a_lapsed_holder_whose_processes_all_ended_is_dropped_and_the_waiter_granted(
        make_cluster, children, engine_dirs) -> None:
    """a's client was killed (no release, no Leave), then its engine process ended: nothing
    will ever release a's hold. The node agents find no process of a left; a is dropped and
    b granted (it waited for good)."""
    c, _, b, tb = await _killed_holder(make_cluster, children, engine_dirs)
    a_engine_process = children[0]
    try:
        a_engine_process.kill()
        a_engine_process.wait()
        grant = await asyncio.wait_for(tb, 15)
        assert grant.epoch > 1 and "a" not in (await c.status()).resident_job_ids
        await b.release()
    finally:
        await b.close()


async def test_a_restarted_orchestrator_drops_a_job_that_must_leave_and_has_no_process_left(
        make_cluster, children, engine_dirs) -> None:
    """App schedules seed 97 (failing in CI): a left (its client's `Leave`) while a switch was
    moving it off the GPUs; the orchestrator was killed before that switch ended and its
    state file named a as a job that must leave. The restarted orchestrator adopted a as
    unreleased (its client may still generate) and every later grant waited for a release
    that could never come. a's processes are all gone: a is dropped and b granted."""
    c, _ = await two_jobs(make_cluster, children, engine_dirs)
    a_engine_process = children[0]
    a_engine_process.kill()
    a_engine_process.wait()
    c.orchestrator.group("g").adopt(None, set(), 1000, must_leave={"a"}, residents={"a"})
    b = c.client("b")
    try:
        grant = await asyncio.wait_for(b.acquire(timeout=30), 15)
        assert grant.epoch == 1001 and "a" not in (await c.status()).resident_job_ids
        await b.release()
    finally:
        await b.close()


async def _watched_client(make_cluster, children, engine_dirs, **two_jobs_args):  # type: ignore[no-untyped-def]
    """a's client as a process of its own beside a's engine (both a's processes), granted and
    generating, and the holders' watch as `timeslice orchestrator` runs it (`gone_holders`):
    (cluster, a's engine, a's client, the watch's task)."""
    log, _ = engine_dirs
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs, **two_jobs_args)
    engine_pid = c.resolvers["node-0"].pids  # (the engine's process, as two_jobs told it)
    p = client_process(c.target, a_engine)
    children.append(p)
    c.resolvers["node-0"].set("a", [*(await engine_pid("a")), p.pid])
    line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 30)  # type: ignore[union-attr]
    assert line.startswith("granted"), line
    await eventually(lambda: "a generate" in calls(log), what="a's client generating")
    holders = GoneHolders(c.orchestrator.groups, c.orchestrator.agent, every=0.2)
    c.orchestrator.add_observer(holders.observe)
    return c, a_engine, p, asyncio.get_running_loop().create_task(holders.watch())


async def _killed_then_b_granted(p, b_acquire, a_engine: AppEngine, log: Path) -> None:  # type: ignore[no-untyped-def]
    """Kill a's client; b is granted once a's engine slept."""
    p.kill()
    p.wait()
    grant = await asyncio.wait_for(b_acquire, 30)
    assert grant.job_id == "b" and await is_sleeping(a_engine) and "a sleep level=1" in calls(log)


async def test_a_holder_whose_client_was_killed_is_dropped_and_its_engine_slept_for_the_next_job(
        make_cluster, children, engine_dirs) -> None:
    """A helper's attack through `timeslice node-agent` + `timeslice orchestrator`: a's client,
    a process of its own beside a's engine (a vLLM server outlives its client), was killed
    while it held. The agents reported a live (its engine), so the orchestrator kept a as
    holder past its lease for as long as the engine ran: b waited out its whole timeout. Now
    the agent reports a *clientless* once only the engine's processes are left, the holders'
    watch (`gone_holders`, as `timeslice orchestrator` runs it) drops a once no keep-alive came
    for half its lease, keeping its engine, and b is granted once a's engine sleeps. While the
    client renews, a holds on, past any number of looks."""
    c, a_engine, p, watch = await _watched_client(make_cluster, children, engine_dirs, lease_seconds=4)
    b = c.client("b")
    try:
        assert (await c.status()).holder.job_id == "a"  # its client and engine live: it holds on
        tb = asyncio.create_task(b.acquire(timeout=60))
        await eventually(lambda: _waiting(c, "b"), what="b waiting")
        await _killed_then_b_granted(p, tb, a_engine, engine_dirs[0])
        await b.release()
    finally:
        watch.cancel()
        await b.close()


async def test_a_revoked_holder_whose_client_was_then_killed_is_dropped_and_its_engine_slept(
        make_cluster, children, engine_dirs) -> None:
    """a's hold was revoked at `maxHoldSeconds` (b waits), its engine kept awake for its client,
    which was then killed before it released (its engine runs on). Nothing would ever release
    a, and b waited for good. Now the holders' watch (as `timeslice orchestrator` runs it) finds
    a clientless and drops it once it did not release for half a lease, keeping its engine,
    which sleeps before b is granted."""
    c, a_engine, p, watch = await _watched_client(make_cluster, children, engine_dirs, lease_seconds=2,
                                                  group={"max_hold_seconds": 0.3})
    b = c.client("b")
    try:
        tb = asyncio.create_task(b.acquire(timeout=60))
        await eventually(lambda: preempted(c), what="a preempted")
        assert not tb.done() and not await is_sleeping(a_engine)  # its client may still generate
        await _killed_then_b_granted(p, tb, a_engine, engine_dirs[0])
        await b.release()
    finally:
        watch.cancel()
        await b.close()


async def test_an_asleep_engine_is_kept_for_its_job_unless_the_job_is_gone() -> None:
    """Dropped while asleep, an app job stays checkpointed (its engine sleeps until the job asks
    again) when only its client left; when nothing of it is left (no process, or its claim set
    dropped in a cluster) it is forgotten. A review found it kept then too, a record nobody
    would ask for again."""
    async def switcher(spec: GroupSpec, evict, incoming: str, restore: bool) -> SwitchRecord:  # type: ignore[no-untyped-def]
        return SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict))

    engines = {j: AppEngine(engine="vllm", url=f"http://127.0.0.1:{port}") for j, port in (("a", 1), ("b", 2))}
    g = LockGroup(GroupSpec(id="g", backend="app", agents=("unix:///x",), apps=engines), switcher)
    try:
        for job in ("a", "b"):
            g.residency.moved_out(job)
        g.drop_job("a", "its claim set was dropped", gone=True)
        g.drop_job("b", "its processes are done with the group")
        assert g.residency.checkpointed == {"b"} and not g.idle.is_orphan("b")
    finally:
        await g.close()
