"""The cooperative backend's protocol on the CPU: a real orchestrator server, real clients
(`TimeSliceOrchestratorClient.serve_memory_commands`) and a fake tensor store whose
"device" state is a bytearray. Checks that state leaves only while its job does not
hold, comes back bit for bit before acquire() returns, lands in the shared pinned pool
(a real file both processes map), falls back to the store's own memory when the pool is
too small, and that a failing store fails the switch cleanly.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from timeslice import TimeSliceOrchestratorClient
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.cooperative import CooperativeJobs
from timeslice.controller.orchestrator.group_model import SwitchError
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.pinned_pool import PinnedPool
from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server
from timeslice.controller.orchestrator.service import OrchestratorServicer
from timeslice.errors import SwitchFailed
from timeslice.kubelet_plugin.agent.gpu_memory import GpuInfo
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server
from timeslice.memory_commands import pieces
from timeslice.v1 import orchestrator_pb2 as pb

from tests.conftest import eventually
from tests.test_client import serve

ROOT = Path(__file__).resolve().parent.parent


class FakeStore:
    """A job's "GPU" state: `device` (None while checkpointed)."""

    def __init__(self, seed: str, size: int = 64 * 1024, fail: bool = False, delay: float = 0.0) -> None:
        self.original = (hashlib.sha256(seed.encode()).digest() * (size // 32 + 1))[:size]
        self.device: bytearray | None = bytearray(self.original)
        self.pool: mmap.mmap | None = None
        self.own: bytes | None = None
        self.fail = fail
        self.delay = delay  # seconds each command takes
        self.ranges: list[tuple[int, int]] = []
        self.commands: list[str] = []

    def nbytes(self) -> int:
        return len(self.original)

    def use_pool(self, pool: mmap.mmap) -> None:
        self.pool = pool

    def checkpoint(self, ranges: list[tuple[int, int]]) -> tuple[int, bool]:
        self.commands.append("checkpoint")
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("injected copy failure")
        assert self.device is not None
        n = len(self.device)
        in_pool = self.pool is not None and n <= sum(k for _, k in ranges)
        if in_pool:
            self.ranges = ranges
            for off, src, k in pieces(ranges, 0, n):
                self.pool[off:off + k] = self.device[src:src + k]  # type: ignore[index]
        else:
            self.own = bytes(self.device)
        self.device = None
        return n, in_pool

    def restore(self, ranges: list[tuple[int, int]]) -> int:
        self.commands.append("restore")
        time.sleep(self.delay)
        if self.device is not None:
            return 0
        ranges = ranges or self.ranges
        if self.own is not None:
            self.device, self.own = bytearray(self.own), None
        else:
            self.device = bytearray(len(self.original))
            for off, src, k in pieces(ranges, 0, len(self.original)):
                self.device[src:src + k] = self.pool[off:off + k]  # type: ignore[index]
        return len(self.device)


@pytest.fixture
async def coop(short_tmp: Path) -> AsyncIterator[Callable[..., object]]:
    """`await coop(pool_bytes=..., backend="cooperative", agent=None, residency="auto")` -> (orchestrator, target)."""
    closers: list[Callable[[], object]] = []

    async def make(pool_bytes: int = 1 << 20, backend: str = "cooperative",
                   agent: NodeAgent | None = None, residency: str = "auto") -> tuple[Orchestrator, str]:
        agent_target = f"unix://{short_tmp / 'agent.sock'}"
        agent_server, _ = await create_agent_server(agent or NodeAgent(StaticProcessResolver()), agent_target)
        pool = PinnedPool(short_tmp / "pinned-pool", pool_bytes) if pool_bytes else None
        orch = Orchestrator([GroupSpec(id="g", backend=backend, agents=(agent_target,), residency=residency)],
                            pinned_pool=pool)
        server, port = await create_orchestrator_server(orch, "127.0.0.1:0")
        closers.extend([lambda: agent_server.stop(0), lambda: server.stop(0), orch.close])
        return orch, f"127.0.0.1:{port}"

    yield make
    for close in reversed(closers):
        result = close()
        if asyncio.iscoroutine(result):
            await result


# Client arguments of a job that raises a failed switch at once (by default it asks again until
# its timeout): for the tests of the failure itself.
AT_ONCE = {"retry_failed_switches": False}


def job(target: str, name: str, store: FakeStore, **kw: object) -> TimeSliceOrchestratorClient:
    client = TimeSliceOrchestratorClient(target, name, "g", **kw)  # type: ignore[arg-type]
    client.serve_memory_commands(store)
    return client


async def connected(client: TimeSliceOrchestratorClient) -> None:
    """Wait until the client's newest command stream is open (fail after 10 s)."""
    assert await asyncio.to_thread(client._memory_loops[-1].connected.wait, 10), "command stream not connected"


async def jobs(target: str, sa: FakeStore, sb: FakeStore, **kw: object) -> tuple[TimeSliceOrchestratorClient, ...]:
    """Clients of jobs "a" and "b" serving `sa` and `sb`, their command streams open (`kw`:
    client arguments)."""
    clients = job(target, "a", sa, **kw), job(target, "b", sb, **kw)
    for c in clients:
        await connected(c)
    return clients


async def jobs_a_and_b(coop, **fields: object) -> tuple[Orchestrator, FakeStore, FakeStore,
                                                       TimeSliceOrchestratorClient, TimeSliceOrchestratorClient]:
    """Jobs a and b (`FakeStore`s, clients that raise a failed switch at once) on group g with
    `fields` of its GroupSpec changed."""
    orch, target = await coop()
    spec = orch.group("g").spec
    orch.add_group(type(spec)(**{**spec.model_dump(), **fields}))
    sa, sb = FakeStore("a"), FakeStore("b")
    a, b = await jobs(target, sa, sb, **AT_ONCE)
    return orch, sa, sb, a, b


async def test_state_leaves_only_for_a_waiter_and_comes_back_bit_for_bit_through_the_pool(coop) -> None:
    orch, target = await coop()
    sa, sb = FakeStore("a"), FakeStore("b")
    a, b = await jobs(target, sa, sb)
    try:
        for _ in range(3):
            await asyncio.to_thread(a.acquire)
            assert sa.device == bytearray(sa.original)
            assert sb.device is None or not sb.commands  # b vacated for a, once b has run
            await asyncio.to_thread(a.release)
            await asyncio.to_thread(b.acquire)
            assert sb.device == bytearray(sb.original) and sa.device is None  # a vacated for b
            await asyncio.to_thread(b.release)
        assert sa.pool is not None and sa.own is None and sb.own is None  # the shared pool, not own copies
        status = orch.group("g").view()
        assert status.counters.switches >= 5 and status.counters.failed_switches == 0
        assert all(r.bytes_checkpointed == 64 * 1024 for r in status.recent_switches)
        assert orch.cooperative.pool is not None and orch.cooperative.pool.used_bytes == 64 * 1024  # b's state
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


class PinningStore(FakeStore):
    """Has `chunks` parts of the pool to pin ahead; records, at each `pin_ahead`, whether its
    job held the group (`holding`, set once its client exists)."""

    def __init__(self, seed: str, chunks: int = 5) -> None:
        super().__init__(seed)
        self.left = chunks
        self.calls: list[bool] = []
        self.holding: Callable[[], bool] = lambda: False

    def pin_ahead(self) -> bool:
        self.calls.append(self.holding())
        if not self.left:
            return False
        self.left -= 1
        return True


async def test_the_pool_is_pinned_ahead_once_a_move_may_come_and_only_while_the_job_does_not_hold(coop) -> None:
    """Pinning the pool ahead of need (`timeslice.torch`) waits for the orchestrator's "pin"
    (a grant may move memory: `CooperativeJobs.pin_ahead`), runs between the job's phases,
    never inside them, and stops once all of it is pinned; a process that connects later in
    that group is told at once."""
    orch, target = await coop()
    store = PinningStore("a")
    client = TimeSliceOrchestratorClient(target, "a", "g")
    store.holding = lambda: client.holding("g") is not None
    late = PinningStore("b")
    try:
        await asyncio.to_thread(client.acquire)  # it holds before its command stream opens
        client.serve_memory_commands(store)
        await connected(client)  # the pool is mapped and the pinning thread started
        assert orch.group("g").view().holder.job_id == "a"
        await asyncio.to_thread(client.release)
        await asyncio.to_thread(client.acquire)  # a round trip after "hello": no "pin" came, nothing pinned
        assert store.calls == [] and not client._memory_loops[-1]._pin_wanted.is_set()
        orch.cooperative.pin_ahead("g")
        await eventually(lambda: client._memory_loops[-1]._pin_wanted.is_set(), what="the pin command")
        assert store.calls == []  # it holds: nothing pins under its phase
        await asyncio.to_thread(client.release)
        await eventually(lambda: len(store.calls) == 6, what="the five chunks pinned, then none left")
        assert store.left == 0 and not any(store.calls)
        other = job(target, "b", late)
        await eventually(lambda: len(late.calls) == 6, what="a process connecting later pins too")
        await asyncio.to_thread(other.close)
    finally:
        await asyncio.to_thread(client.close)


async def test_a_pool_too_small_falls_back_to_the_process_memory_with_a_warning(coop, caplog) -> None:
    orch, target = await coop(pool_bytes=1024)
    sa, sb = FakeStore("a"), FakeStore("b")
    a, b = job(target, "a", sa), job(target, "b", sb)
    caplog.set_level(logging.WARNING, "timeslice.cooperative")
    try:
        await connected(a)
        await connected(b)
        await asyncio.to_thread(a.acquire)
        await asyncio.to_thread(a.release)
        await asyncio.to_thread(b.acquire)
        assert sa.device is None and sa.own == sa.original
        await asyncio.to_thread(b.release)
        await asyncio.to_thread(a.acquire)
        assert sa.device == bytearray(sa.original)
        assert "own host memory" in caplog.text and orch.cooperative.pool.used_bytes == 0  # type: ignore[union-attr]
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


async def test_a_store_that_fails_fails_the_switch_and_the_group_serves_on(coop) -> None:
    orch, target = await coop()
    sa, sb = FakeStore("a", fail=True), FakeStore("b")
    a, b = await jobs(target, sa, sb, **AT_ONCE)
    try:
        await asyncio.to_thread(a.acquire)
        await asyncio.to_thread(a.release)
        with pytest.raises(SwitchFailed, match="injected copy failure"):
            await asyncio.to_thread(b.acquire)
        assert sa.device == bytearray(sa.original)  # a kept its state on the "GPU"
        assert orch.group("g").resident == "a" and orch.group("g").view().counters.failed_switches == 1
        await asyncio.to_thread(a.acquire)  # a resident: granted at once
        await asyncio.to_thread(a.release)
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


class FailsOnce(FakeStore):
    """Its first checkpoint fails (a copy that ran out of host memory, say), later ones work."""

    def checkpoint(self, ranges: list[tuple[int, int]]) -> tuple[int, bool]:
        self.fail = "checkpoint" not in self.commands  # `commands`: the earlier ones
        return super().checkpoint(ranges)


async def test_a_copy_that_fails_once_costs_the_waiter_a_wait_not_its_acquire(coop) -> None:
    """Issue 21, item 4: the acquire asks again after the failed switch (rolled back) and
    succeeds, with the states where they belong."""
    orch, target = await coop()
    sa, sb = FailsOnce("a"), FakeStore("b")
    a, b = await jobs(target, sa, sb)
    try:
        await asyncio.to_thread(a.acquire)
        await asyncio.to_thread(a.release)
        grant = await asyncio.to_thread(b.acquire, timeout=60)
        assert sa.commands.count("checkpoint") == 2 and sa.device is None  # failed, then moved
        assert sb.device == bytearray(sb.original) and grant.epoch == 2
        assert orch.group("g").view().counters.failed_switches == 1
        await asyncio.to_thread(b.release)
        await asyncio.to_thread(a.acquire)
        assert sa.device == bytearray(sa.original)
        await asyncio.to_thread(a.release)
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


async def test_a_process_that_closes_its_stream_while_checkpointed_keeps_its_pool_range(coop) -> None:
    orch, target = await coop()
    sa, sb = FakeStore("a"), FakeStore("b")
    a, b = await jobs(target, sa, sb)
    try:
        await asyncio.to_thread(a.acquire)
        await asyncio.to_thread(a.release)
        await asyncio.to_thread(b.acquire)
        assert orch.cooperative.pool.used_bytes == 64 * 1024  # type: ignore[union-attr]
        a._memory_loops[0].close()
        await eventually(lambda: not orch.cooperative._processes.of("g", "a")[a._memory_loops[0].stream_id].connected)
        assert orch.cooperative.pool.used_bytes == 64 * 1024  # type: ignore[union-attr]  # its bytes still there
        orch.drop_job("g", "a", "finished")
        assert orch.cooperative.pool.used_bytes == 0  # type: ignore[union-attr]
        await asyncio.to_thread(b.release)
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


async def test_registering_on_a_group_that_is_not_cooperative_is_refused_clearly(coop) -> None:
    _, target = await coop(backend="freeze")
    client = TimeSliceOrchestratorClient(target, "a", "g")
    try:
        loop = client.serve_memory_commands(FakeStore("a"))
        assert await asyncio.to_thread(loop.ready.wait, 10)  # at once, not after register()'s 30 s
        assert loop.error is not None
        assert loop.error.startswith("FAILED_PRECONDITION: group g uses backend freeze, not cooperative")
    finally:
        await asyncio.to_thread(client.close)


def test_pinned_pool_hands_out_every_free_range_and_merges_what_comes_back(short_tmp: Path) -> None:
    pool = PinnedPool(short_tmp / "pool", 100)
    a = pool.keep(pool.take_all(), 30)
    b = pool.keep(pool.take_all(), 50)
    assert a == [(0, 30)] and b == [(30, 50)] and pool.used_bytes == 80
    pool.release(a)  # free: [0, 30) and [80, 100): fragmented
    c = pool.take_all()
    assert c == [(0, 30), (80, 20)]  # largest first
    assert pool.keep(c, 40) == [(0, 30), (80, 10)] and pool.used_bytes == 90
    pool.release(b)
    pool.release(pool.keep(pool.take_all(), 0))
    assert pool.take_all() == [(30, 50), (90, 10)]  # c still holds [0, 30) and [80, 90)
    assert (short_tmp / "pool").stat().st_size == 100
    with pytest.raises(ValueError):
        PinnedPool(short_tmp / "p2", 0)


def test_pinned_pool_take_reserves_just_enough_largest_first_or_nothing(short_tmp: Path) -> None:
    pool = PinnedPool(short_tmp / "pool", 100)
    a = pool.take(30)
    b = pool.take(50)
    assert a == [(0, 30)] and b == [(30, 50)] and pool.used_bytes == 80
    assert pool.take(21) == [] and pool.used_bytes == 80  # 20 free: nothing reserved
    pool.release(a)  # free: [0, 30) and [80, 100)
    assert pool.take(40) == [(0, 30), (80, 10)] and pool.take_all() == [(90, 10)]


def test_a_populated_pool_is_written_through_once(short_tmp: Path) -> None:
    """Every page written (tmpfs clears fallocated pages only at their first touch, which
    would otherwise fall inside the first checkpoint), in slices that need not divide evenly."""
    size = (64 << 20) * 3 + 12345
    pool = PinnedPool(short_tmp / "pool", size, populate=True)
    data = (short_tmp / "pool").read_bytes()
    assert len(data) == size and data.count(0) == size
    assert os.stat(short_tmp / "pool").st_blocks * 512 >= size  # allocated, not sparse
    pool.close()


def test_pieces_spans_ranges_in_order() -> None:
    ranges = [(100, 10), (0, 5), (50, 20)]
    assert pieces(ranges, 0, 10) == [(100, 0, 10)]
    assert pieces(ranges, 8, 10) == [(108, 0, 2), (0, 2, 5), (50, 7, 3)]
    with pytest.raises(ValueError, match="hold 35 bytes"):
        pieces(ranges, 30, 10)


async def test_three_jobs_rotate_through_a_pool_sized_for_their_states(coop) -> None:
    orch, target = await coop(pool_bytes=3 * 64 * 1024)
    stores = {j: FakeStore(j) for j in ("a", "b", "c")}
    clients = {j: job(target, j, s) for j, s in stores.items()}
    try:
        for c in clients.values():
            await connected(c)
        for j in ("a", "b", "c", "a", "c", "b", "a"):  # exclusive: each hand-off checkpoints the resident
            await asyncio.to_thread(clients[j].acquire)
            assert stores[j].device == bytearray(stores[j].original)
            await asyncio.to_thread(clients[j].release)
        assert all(s.own is None for s in stores.values())  # always the pool, never the fallback
        assert orch.group("g").view().counters.failed_switches == 0
    finally:
        for c in clients.values():
            await asyncio.to_thread(c.close)


async def test_state_never_leaves_a_job_inside_its_hold_even_when_its_lease_is_revoked(coop) -> None:
    """maxHoldSeconds revokes a cooperative holder (it cannot be switched out mid-phase); its
    process must refuse to move state while its code is still inside the hold (before: its
    storages were freed under a running phase)."""
    _, sa, _, a, b = await jobs_a_and_b(coop, max_hold_seconds=0.2, residency="exclusive")
    try:
        await asyncio.to_thread(a.acquire)  # a stays inside its phase
        with pytest.raises(SwitchFailed, match="inside its GPU phase"):
            await asyncio.to_thread(b.acquire)
        assert sa.device == bytearray(sa.original)  # never taken
    finally:
        a._holds.pop("g").stop.set()  # its lease was revoked
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


async def test_a_grant_received_after_the_acquires_timeout_is_used_not_thrown_away(coop) -> None:
    """The grant's lease is confirmed before it is used (issue 22, case 4), in a window of its
    own: a grant that arrives as the acquire's timeout ends is kept (the review of that fix
    found it cancelled, its restore wasted, and the caller told "no grant before the timeout")."""
    _, target = await coop()
    a = job(target, "a", FakeStore("a"))
    await connected(a)
    acquire = a._stub.Acquire

    def reply_past_the_timeout(*args: object, **kw: object) -> object:
        reply = acquire(*args, **kw)
        end = time.monotonic() + float(kw["timeout"])  # type: ignore[arg-type]
        while time.monotonic() <= end:  # the caller's whole timeout passes before it sees the reply
            time.sleep(0.01)
        return reply

    a._stub.Acquire = reply_past_the_timeout  # type: ignore[method-assign]
    try:
        grant = await asyncio.to_thread(a.acquire, timeout=0.3)
        assert a.holding() == grant
        await asyncio.to_thread(a.release)
    finally:
        await asyncio.to_thread(a.close)


async def test_a_command_answered_late_settles_the_state_and_leaks_no_pool(coop, monkeypatch) -> None:
    """A store slower than the step timeout: the switch fails, the process is not moved
    again until it answers, its late answers are recorded, nothing leaks, and a later
    eviction really moves it (before: the pool stayed reserved and an eviction moved 0 bytes)."""
    orch, target = await coop()
    spec = orch.group("g").spec
    orch.add_group(type(spec)(**{**spec.model_dump(), "step_timeout_seconds": 0.3, "residency": "exclusive"}))
    sa, sb = FakeStore("a", delay=0.6), FakeStore("b")
    a, b = await jobs(target, sa, sb, **AT_ONCE)
    try:
        await asyncio.to_thread(a.acquire)
        await asyncio.to_thread(a.release)
        with pytest.raises(SwitchFailed, match=r"no answer within 0\.3 s"):
            await asyncio.to_thread(b.acquire)
        # a's late checkpoint answer arrives, is rolled back at once: a is on its "GPU" again
        await eventually(lambda: sa.commands[-2:] == ["checkpoint", "restore"] and sa.device is not None, timeout=10)
        await eventually(lambda: orch.cooperative.pool.used_bytes == 0, timeout=10)  # type: ignore[union-attr]
        sa.delay = 0.0
        await asyncio.to_thread(b.acquire)  # now a really leaves
        assert sa.device is None and sb.device == bytearray(sb.original)
        await asyncio.to_thread(b.release)
        await asyncio.to_thread(a.acquire)
        assert sa.device == bytearray(sa.original)
        await asyncio.to_thread(a.release)
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


async def test_a_restore_answered_late_is_checkpointed_again_not_left_on_a_gpu_given_to_others(coop) -> None:
    """Issue 22: a restore command that timed out still ran later, onto a GPU the group had
    given to others (it counted the job checkpointed). Its late answer is undone like a late
    checkpoint's: the process is checkpointed again, and its next grant restores it."""
    orch, sa, _, a, b = await jobs_a_and_b(coop, step_timeout_seconds=0.3, residency="exclusive")
    try:
        await asyncio.to_thread(a.acquire)
        await asyncio.to_thread(a.release)
        await asyncio.to_thread(b.acquire)  # a is checkpointed
        await asyncio.to_thread(b.release)
        assert sa.device is None
        sa.delay = 0.6  # a's restore outlasts the step timeout
        with pytest.raises(SwitchFailed, match=r"no answer within 0\.3 s"):
            await asyncio.to_thread(a.acquire)
        await eventually(lambda: sa.commands[-2:] == ["restore", "checkpoint"] and sa.device is None
                         and not orch.cooperative.departing("g", "a"), timeout=10)
        sa.delay = 0.0
        await asyncio.to_thread(a.acquire)
        assert sa.device == bytearray(sa.original)
        await asyncio.to_thread(a.release)
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


async def test_a_job_whose_checkpointed_process_died_runs_again_with_a_new_process(coop, monkeypatch) -> None:
    """Before: every acquire of the job failed for good ("hold a checkpoint but are not
    connected"), after evicting and restoring the other job each time, and its pool range leaked."""
    from timeslice.controller.orchestrator import cooperative_processes

    monkeypatch.setattr(cooperative_processes, "RECONNECT_GRACE_SECONDS", 0.2)
    orch, target = await coop(backend="cooperative")
    spec = orch.group("g").spec
    orch.add_group(type(spec)(**{**spec.model_dump(), "residency": "exclusive"}))
    sa, sb = FakeStore("a"), FakeStore("b")
    a, b = await jobs(target, sa, sb, **AT_ONCE)
    try:
        await asyncio.to_thread(a.acquire)
        await asyncio.to_thread(a.release)
        await asyncio.to_thread(b.acquire)  # a checkpointed into the pool
        await asyncio.to_thread(b.release)
        a._memory_loops[0].close()  # a's process "dies" while checkpointed
        a._memory_loops.clear()
        with pytest.raises(SwitchFailed, match="reconnecting"):  # within the grace: nothing moved
            await asyncio.to_thread(a.acquire)
        assert sb.device == bytearray(sb.original) and "checkpoint" not in sb.commands
        s2 = FakeStore("a-new")
        a2 = job(target, "a", s2)
        await connected(a2)
        # a2 asks again (its failed switches retried) until the old process is past the grace
        # and its state counts as gone with it: then a2 is granted
        await asyncio.to_thread(a2.acquire, timeout=30)
        assert orch.cooperative.pool.used_bytes == 64 * 1024  # type: ignore[union-attr]  # b's, not a's
        await asyncio.to_thread(a2.release)
        await asyncio.to_thread(a2.close)
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


GB = 10**9


class GpuModel:
    """NVML as a 100 GB GPU would report the jobs' processes: `sizes` bytes for each job
    whose store holds its state and whose process has not exited."""

    def __init__(self, stores: dict[str, FakeStore], sizes: dict[str, int], pids: dict[str, int]) -> None:
        self.stores, self.sizes, self.pids = stores, sizes, pids
        self.exited: set[str] = set()
        self.probes = 0
        self.failing = False  # NVML failing: the node agent's reports fail

    def on_gpu(self) -> dict[int, int]:
        return {self.pids[j]: self.sizes[j] for j, s in self.stores.items()
                if s.device is not None and j not in self.exited}

    def free(self) -> int:
        return 100 * GB - sum(self.on_gpu().values())

    def probe(self) -> list[GpuInfo]:
        if self.failing:
            raise RuntimeError("NVML: the GPU query failed")
        self.probes += 1
        return [GpuInfo("GPU-0", 0, 100 * GB, self.free(), self.on_gpu())]


class SizedStore(FakeStore):
    """Registers `size` bytes (what the orchestrator plans with); checks at each restore
    that the GPU model had room for it."""

    def __init__(self, seed: str, size: int, gpu: GpuModel) -> None:
        super().__init__(seed)
        self.size, self.gpu = size, gpu
        self.free_at_restore: list[int] = []

    def nbytes(self) -> int:
        return self.size

    def restore(self, ranges: list[tuple[int, int]]) -> int:
        if self.device is None:
            self.free_at_restore.append(self.gpu.free())
        return super().restore(ranges)


async def sized_jobs(coop, monkeypatch, grace: float, **kw: object) -> tuple[Orchestrator, GpuModel, dict, dict]:
    """Jobs "c" and "a", 60 GB each on a 100 GB GPU (10% headroom): one fits at a time. c
    has run once; a loads its state inside its first hold (c is checkpointed for it), then
    registers it, and releases. `kw`: c's client arguments."""
    from timeslice.controller.orchestrator import cooperative_processes

    monkeypatch.setattr(cooperative_processes, "RECONNECT_GRACE_SECONDS", grace)
    stores: dict[str, FakeStore] = {}
    gpu = GpuModel(stores, {"a": 60 * GB, "c": 60 * GB}, {"a": 101, "c": 103})
    stores["c"] = SizedStore("c", 60 * GB, gpu)
    gpu.resolver = StaticProcessResolver({"a": [101], "c": [103]})  # type: ignore[attr-defined]
    agent = NodeAgent(gpu.resolver, memory_probe=gpu.probe,  # type: ignore[attr-defined]
                      host_probe=lambda: 1000 * GB)  # the host holds any checkpoint: the GPU is the limit here
    orch, target = await coop(agent=agent)
    c = job(target, "c", stores["c"], **kw)
    await connected(c)
    await asyncio.to_thread(c.acquire)
    await asyncio.to_thread(c.release)
    await eventually(lambda: orch.group("g").residency.peaks.get("c"))  # c's 60 GB seen: a is sized like it
    a = TimeSliceOrchestratorClient(target, "a", "g")
    await asyncio.to_thread(a.acquire)
    assert stores["c"].device is None  # c was checkpointed for a
    stores["a"] = SizedStore("a", 60 * GB, gpu)  # a loads its state, then registers it
    a.serve_memory_commands(stores["a"])
    await connected(a)
    await asyncio.to_thread(a.release)
    return orch, gpu, stores, {"a": a, "c": c}


async def test_a_resident_whose_process_closed_its_stream_is_waited_for_never_restored_over(coop, monkeypatch) -> None:
    """Seen on the H200 (3 x 46 GB): a finished job closed its client while its process still
    held its memory; the plan evicted it, the checkpoint found no stream ("nothing to move")
    and the waiter's restore ran out of GPU memory. Now a resident nothing can move is never
    counted as room: the waiter waits for its process to exit (it frees the memory), bounded
    by the reconnect grace."""
    orch, gpu, stores, clients = await sized_jobs(coop, monkeypatch, grace=30.0)
    a, c = clients["a"], clients["c"]
    try:
        a._memory_loops[0].close()  # a finished: its stream closes, its process still holds 60 GB
        await eventually(lambda: orch.cooperative.departing("g", "a"))
        reports = orch.group("g").residency.snapshot
        waiter = asyncio.create_task(asyncio.to_thread(c.acquire))
        await eventually(lambda: orch.group("g").residency.snapshot is not reports and not waiter.done())
        assert stores["c"].device is None  # nothing restored over a
        gpu.exited.add("a")  # a's process exits: NVML shows its memory free
        await asyncio.wait_for(waiter, 10)
        assert stores["c"].device == bytearray(stores["c"].original)
        assert all(free >= 60 * GB for free in stores["c"].free_at_restore)  # type: ignore[attr-defined]
        await asyncio.to_thread(c.release)
    finally:
        for client in clients.values():
            await asyncio.to_thread(client.close)


async def test_a_resident_that_stays_unmovable_past_the_grace_fails_the_waiter_with_no_room(coop, monkeypatch) -> None:
    orch, _, stores, clients = await sized_jobs(coop, monkeypatch, grace=0.5, **AT_ONCE)
    a, c = clients["a"], clients["c"]
    try:
        a._memory_loops[0].close()  # its process keeps its 60 GB and never exits
        await eventually(lambda: orch.cooperative.departing("g", "a"))
        with pytest.raises(SwitchFailed, match=r"no room for c|c runs alone .* would stay held by others"):
            await asyncio.to_thread(c.acquire)
        assert stores["c"].device is None and stores["c"].free_at_restore == []  # type: ignore[attr-defined]
        assert orch.group("g").holder is None  # the group serves on
    finally:
        for client in clients.values():
            await asyncio.to_thread(client.close)


@pytest.mark.parametrize("comes_back", [False, True])
async def test_a_resident_that_exits_or_reconnects_is_waited_for_not_failed(coop, monkeypatch, comes_back) -> None:
    """Seen on two H200s (issue 14, residency exclusive): job b finished, its streams closed
    with its state on the GPU, and a's next acquire failed at once ("cannot be checkpointed:
    exiting or reconnecting"), killing a. Now the switch waits: b's process exited (the
    grace passes: nothing of it to move, a is granted) or it reconnects (then it is
    checkpointed as usual)."""
    from timeslice.controller.orchestrator import cooperative_processes

    monkeypatch.setattr(cooperative_processes, "RECONNECT_GRACE_SECONDS", 5.0 if comes_back else 0.3)
    orch, target = await coop(residency="exclusive")
    sa, sb = FakeStore("a"), FakeStore("b")
    a, b = await jobs(target, sa, sb)
    try:
        await asyncio.to_thread(a.acquire)
        await asyncio.to_thread(a.release)
        await asyncio.to_thread(b.acquire)  # a checkpointed for b
        await asyncio.to_thread(b.release)
        loop = b._memory_loops[0]
        loop.close()  # b is done (or its connection dropped): its state is still on the GPU
        await eventually(lambda: orch.cooperative.departing("g", "b"))
        waiter = asyncio.create_task(asyncio.to_thread(a.acquire))
        if comes_back:
            await eventually(lambda: orch.group("g").switching is not None)
            b.serve_memory_commands(sb)  # a new stream of b's process: its state can move again
            await connected(b)
        await asyncio.wait_for(waiter, 10)
        assert sa.device == bytearray(sa.original)
        (last,) = orch.group("g").view().recent_switches[-1:]
        assert last.ok and last.bytes_checkpointed == (64 * 1024 if comes_back else 0), last
        assert (sb.device is None) == comes_back
        await asyncio.to_thread(a.release)
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


class GatedStore(FakeStore):
    """Its checkpoint says when it starts and waits for the test's go."""

    def __init__(self, seed: str) -> None:
        super().__init__(seed)
        self.started, self.go = threading.Event(), threading.Event()

    def checkpoint(self, ranges: list[tuple[int, int]]) -> tuple[int, bool]:
        self.started.set()
        assert self.go.wait(30)
        return super().checkpoint(ranges)


async def test_a_job_that_ends_while_it_is_being_checkpointed_answers_before_it_closes(coop) -> None:
    """Seen on two H200s (issue 14): a job ended (client.close()) while a switch was
    checkpointing it for the other job; close() cancelled its command stream under the
    running command, the switch failed ("closed its command stream; ROLLBACK FAILED") and
    the waiting job died of SwitchFailed. Now close() lets the command finish and answer."""
    orch, target = await coop()
    sa, sb = GatedStore("a"), FakeStore("b")
    a, b = await jobs(target, sa, sb)
    try:
        sa.go.set()
        for client in (a, b, a):  # each vacates for the other
            await asyncio.to_thread(client.acquire)
            await asyncio.to_thread(client.release)
        sa.go.clear()
        sa.started.clear()
        waiter = asyncio.create_task(asyncio.to_thread(b.acquire))  # a is checkpointed for b ...
        assert await asyncio.to_thread(sa.started.wait, 10)
        closing = asyncio.create_task(asyncio.to_thread(a.close))  # ... as a ends
        sa.go.set()
        await asyncio.wait_for(closing, 10)
        await asyncio.wait_for(waiter, 10)
        assert sb.device == bytearray(sb.original)
        assert orch.group("g").view().counters.failed_switches == 0
        await asyncio.to_thread(b.release)
    finally:
        sa.go.set()
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


async def test_leave_of_a_cooperative_job_with_another_process_still_connected_changes_nothing(coop) -> None:
    """A unit of two processes: one ends (its stream closed, then Leave) while the other still
    has its command stream open: the job stays, and so do the other process's entries."""
    orch, target = await coop()
    first, second = (TimeSliceOrchestratorClient(target, "a", "g") for _ in range(2))
    try:
        for c in (first, second):
            c.serve_memory_commands(FakeStore("a"))
            await connected(c)
        await asyncio.to_thread(first.acquire)
        await asyncio.to_thread(first.release)
        await asyncio.to_thread(first.close)  # its Leave: "busy", the other process is connected
        assert orch.cooperative.connected("g", "a") and "a" in orch.group("g").residency.residents
    finally:
        await asyncio.to_thread(first.close)
        await asyncio.to_thread(second.close)


class MeetingStore(FakeStore):
    """Its checkpoint waits until every store of `group` has started its own: it passes only
    when the processes of a job are checkpointed at once."""

    def __init__(self, seed: str, group: list[MeetingStore]) -> None:
        super().__init__(seed)
        self.started = threading.Event()
        self.group = group
        group.append(self)

    def checkpoint(self, ranges: list[tuple[int, int]]) -> tuple[int, bool]:
        self.started.set()
        assert all(s.started.wait(10) for s in self.group), "checkpointed one after the other"
        return super().checkpoint(ranges)


async def test_the_processes_of_a_job_are_checkpointed_at_once_each_into_its_own_pool_ranges(coop) -> None:
    """Issue 14: a 2-rank job's ranks were checkpointed one after the other (the first one was
    offered the whole pool), so a switch took the sum of their copies; on two H200s the second
    rank then found the pool short and used its own pageable memory."""
    orch, target = await coop()
    ranks: list[MeetingStore] = []
    stores = [MeetingStore(f"a{i}", ranks) for i in range(2)]
    a_ranks = [TimeSliceOrchestratorClient(target, "a", "g") for _ in stores]
    b = job(target, "b", FakeStore("b"))
    try:
        for c, store in zip(a_ranks, stores):
            c.serve_memory_commands(store)
            await connected(c)
        await connected(b)
        await asyncio.to_thread(a_ranks[0].acquire)
        await asyncio.to_thread(a_ranks[0].release)
        await asyncio.to_thread(b.acquire)  # both ranks of a are checkpointed for b, at once
        assert all(s.device is None and s.own is None for s in stores)  # both in the pinned pool
        (first, second) = sorted(r for p in orch.cooperative._processes.of("g", "a").values() for r in p.pool_ranges)
        assert first[0] + first[1] <= second[0]  # one range each, disjoint
        await asyncio.to_thread(b.release)
        await asyncio.to_thread(a_ranks[1].acquire)
        assert all(s.device == bytearray(s.original) for s in stores)
        await asyncio.to_thread(a_ranks[1].release)
    finally:
        for c in (*a_ranks, b):
            await asyncio.to_thread(c.close)


# A rank of job "a" in its own process (argv: target, seed, "gated" or not): prints "ready"
# once its command stream is open and "answered KIND" once the orchestrator has its answer
# to a command. A gated rank's first checkpoint prints "in checkpoint", waits for a line on
# stdin, then fails.
RANK = textwrap.dedent("""
    import sys, threading
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.memory_commands import MemoryCommandLoop
    from tests.test_cooperative import FakeStore
    target, seed, gated = sys.argv[1], sys.argv[2], sys.argv[3] == "gated"
    class Store(FakeStore):
        def checkpoint(self, ranges):
            if gated and "checkpoint" not in self.commands:
                self.commands.append("checkpoint")
                print("in checkpoint", flush=True)
                sys.stdin.readline()
                raise RuntimeError("injected copy failure")
            return super().checkpoint(ranges)
    run = MemoryCommandLoop._command
    def answered(self, command, *args):
        run(self, command, *args)  # runs it and acknowledges it
        print(f"answered {command.kind}", flush=True)
    MemoryCommandLoop._command = answered
    loop = TimeSliceOrchestratorClient(target, "a", "g").serve_memory_commands(Store(seed))
    assert loop.connected.wait(30), loop.error
    print("ready", flush=True)
    threading.Event().wait()  # until the test kills it
""")


def rank(children: list[subprocess.Popen[str]], target: str, mode: str) -> subprocess.Popen[str]:
    """A `RANK` process of job a, killed at teardown (`children`)."""
    p = subprocess.Popen([sys.executable, "-c", RANK, target, "a", mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    children.append(p)
    return p


async def said(proc: subprocess.Popen[str], line: str, timeout: float = 30.0) -> None:
    """Wait until the child `proc` prints `line` (at most `timeout` seconds)."""
    assert proc.stdout is not None
    while (got := await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)) != f"{line}\n":
        assert got, f"the child exited before it said {line!r}"


async def test_a_command_for_a_process_whose_stream_closed_fails_at_once_and_the_group_serves_on(
        coop, children, caplog) -> None:
    """Randomized schedules, seed 1076 (the agent and a job killed): a switch that restored
    job 2 after checkpointing job 1 never ended, and no job was granted again. A command was
    queued for a process whose command stream had closed: job 2's, killed while the switch
    awaited between its check that the process was connected and the queueing of the restore
    (the close fails only the commands already out). Nobody read or failed it: the switch
    waited out the whole step timeout (300 s). The same wait, made certain with real
    processes: rank 1 of job a answers its checkpoint and is killed, rank 2 fails its own,
    and the checkpoint's rollback commands rank 1 to restore. Now a command for a closed
    stream fails at once: the switch fails ("ROLLBACK FAILED"), and the next one
    checkpoints the rank that is left."""
    caplog.set_level(logging.INFO, logger="timeslice.cooperative")
    orch, target = await coop()
    ranks = [rank(children, target, mode) for mode in ("plain", "gated")]
    for p in ranks:
        await said(p, "ready")
    a, sb = TimeSliceOrchestratorClient(target, "a", "g"), FakeStore("b")
    b = job(target, "b", sb, **AT_ONCE)
    try:
        await connected(b)
        await asyncio.to_thread(a.acquire)  # a is resident
        await asyncio.to_thread(a.release)
        waiter = asyncio.create_task(asyncio.to_thread(b.acquire, timeout=30))  # a's ranks are checkpointed for b
        await said(ranks[0], "answered checkpoint")
        await said(ranks[1], "in checkpoint")
        ranks[0].kill()
        await asyncio.to_thread(ranks[0].wait)
        await eventually(lambda: f"disconnected group=g job=a pid={ranks[0].pid} " in caplog.text, timeout=30,
                         what="the orchestrator saw rank 1's command stream close")
        ranks[1].stdin.write("fail\n")  # type: ignore[union-attr]
        ranks[1].stdin.flush()  # type: ignore[union-attr]
        with pytest.raises(SwitchFailed, match=rf"ROLLBACK FAILED \(pid {ranks[0].pid}: .* closed its command stream"):
            await waiter  # before: AcquireTimeout, the switch waiting 300 s for rank 1's restore
        assert orch.group("g").switching is None
        await asyncio.to_thread(b.acquire, timeout=30)  # rank 2 is checkpointed alone
        assert sb.device == bytearray(sb.original)
        await asyncio.to_thread(b.release)
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)
        for p in ranks:  # `children` kills them and closes their stdout
            p.stdin.close()  # type: ignore[union-attr]


async def test_a_plan_asks_the_processes_for_what_they_registered_now(coop) -> None:
    """Issue 21: a process registers before its model and optimizer exist; the size it sent
    when its stream opened said 0, so a resident looked empty and was never moved out. A
    plan asks for a "report" first: the fresh size stands."""
    orch, target = await coop()

    class Growing(FakeStore):
        size = 0

        def nbytes(self) -> int:
            return self.size

    store = Growing("a")
    a = job(target, "a", store)
    await connected(a)
    try:
        coop_jobs = orch.cooperative
        assert coop_jobs.registered_bytes("g", "a") == 0
        await asyncio.to_thread(a.acquire)
        store.size = 5 * 2**20  # its model and optimizer are on the GPU now, built inside its hold
        await asyncio.to_thread(a.release)  # measured here, in the job's thread (a report never walks its tensors)
        assert coop_jobs.registered_bytes("g", "a") == 0
        g = orch.group("g")
        await g.switcher.memory(g.spec, ["a"])  # type: ignore[attr-defined]
        assert coop_jobs.registered_bytes("g", "a") == 5 * 2**20
    finally:
        await asyncio.to_thread(a.close)


async def test_a_cooperative_plan_counts_the_pools_free_bytes_and_the_hosts_not_more(coop) -> None:
    """H200, 3 x 57 GB, `serve`'s 67 GB pool: a second job's checkpoint did not fit in the pool,
    went to its process's own host memory, and the kernel killed the job (SIGKILL). A plan
    now checks each checkpoint against the pool's free bytes or else the node's available host
    memory (`placement._take_host_memory`: a checkpoint is never split between them)."""
    agent = NodeAgent(StaticProcessResolver(), memory_probe=lambda: [GpuInfo("GPU-0", 0, 100 * 2**20, 100 * 2**20, {})],
                      host_probe=lambda: 5)
    orch, _ = await coop(agent=agent, pool_bytes=1 << 20)
    g = orch.group("g")
    snap = await g.switcher.memory(g.spec, [])  # type: ignore[attr-defined]
    assert list(snap.host_available.values()) == [5] and list(snap.pool_free.values()) == [1 << 20]
    assert orch.cooperative.pool is not None
    orch.cooperative.pool.take(1 << 19)
    snap = await g.switcher.memory(g.spec, [])  # type: ignore[attr-defined]
    assert list(snap.host_available.values()) == [5] and list(snap.pool_free.values()) == [1 << 19]


@pytest.mark.parametrize(("exits", "seen", "vanishes"),
                         [(True, True, False), (False, True, False), (True, False, False), (True, True, True)])
async def test_a_job_that_left_during_its_switch_is_waited_for_until_nvml_shows_its_memory_free(
        coop, monkeypatch, exits, seen, vanishes) -> None:
    """Randomized schedules, seed 9: the plan evicted a (connected, 60 GB), then a finished
    (its stream closed, `Leave`) before its checkpoint command: "no process connected,
    nothing to move", and c's restore ran out of GPU memory while a's process still held
    it. Now the switch waits until NVML shows the memory of an evicted job that had no
    process to command freed (its process exits), or rolls back (c stays checkpointed).
    Not `seen` (seed 3299): the node agent no longer told a's exiting process as a's (NVML
    showed the bytes, not whose); the restore waits until the GPU has room for what c
    registered. `vanishes` (cooperative schedules seed 36, with exit delays): seen at first,
    then a's PID left /proc while the driver still freed its memory; the switch took a's bytes
    for freed, and c grew into them. Now the devices' free bytes must show it."""
    from timeslice.controller.orchestrator import memory_reports

    monkeypatch.setattr(memory_reports, "FREED_TIMEOUT_SECONDS", 30.0 if exits else 0.5)
    orch, gpu, stores, clients = await sized_jobs(coop, monkeypatch, grace=30.0)
    a = clients["a"]
    g = orch.group("g")
    monkeypatch.setattr(g.idle, "refresh_memory", lambda: None)  # the test runs the switches, not the idle group
    try:
        await asyncio.to_thread(a.close)  # a ends: its stream closes and it leaves; its process holds 60 GB
        assert "a" not in g.residency.residents and not orch.cooperative.connected("g", "a")
        if not seen:
            gpu.resolver._jobs.pop("a")  # type: ignore[attr-defined]
        moving = asyncio.create_task(g.switcher(g.spec, ("a",), "c", True))  # as planned while a was connected
        if exits:
            polls = gpu.probes
            await eventually(lambda: gpu.probes >= polls + 3 or moving.done())  # it polls NVML
            assert not moving.done() and stores["c"].device is None
            if vanishes:
                gpu.resolver._jobs.pop("a")  # type: ignore[attr-defined]  # its PID is gone, its 60 GB not yet
                polls = gpu.probes
                await eventually(lambda: gpu.probes >= polls + 3 or moving.done())
                assert not moving.done() and stores["c"].device is None
            gpu.exited.add("a")  # a's process exits: NVML shows its memory free
            record = await asyncio.wait_for(moving, 10)
            assert record.ok and stores["c"].device == bytearray(stores["c"].original)
            assert all(free >= 60 * GB for free in stores["c"].free_at_restore)  # type: ignore[attr-defined]
        else:
            with pytest.raises(SwitchError, match="not freed"):
                await asyncio.wait_for(moving, 10)
            assert stores["c"].device is None and stores["c"].free_at_restore == []  # type: ignore[attr-defined]
    finally:
        for client in clients.values():
            await asyncio.to_thread(client.close)


@pytest.mark.parametrize("incoming", ["c", "newcomer"])
async def test_a_switch_whose_node_agent_does_not_answer_adds_nothing_beside_a_job_that_left(
        coop, monkeypatch, incoming) -> None:
    """Randomized schedules, seed 5112: the node agent was killed as job a ended (its
    process still held its memory); the switch that moved a out for c read the failed
    memory report as "no NVML, nothing to check", restored c beside a's 60 GB and c ran out
    of memory; seed 6004: the same for a newcomer's grant (nothing to restore, nothing was
    checked). A report that fails shows nothing freed: the switch fails, c stays
    checkpointed (the newcomer waits) and asks again; once the agent answers and a's
    memory is free, it goes through."""
    orch, gpu, stores, clients = await sized_jobs(coop, monkeypatch, grace=30.0)
    g = orch.group("g")
    # the test runs the switches: the idle group's background restore of c raced them under load
    monkeypatch.setattr(g.idle, "refresh_memory", lambda: None)
    restore = incoming == "c"
    try:
        await asyncio.to_thread(clients["a"].close)  # a ends; its process holds 60 GB until it exits
        gpu.failing = True
        with pytest.raises(SwitchError, match="did not answer"):
            await asyncio.wait_for(g.switcher(g.spec, ("a",), incoming, restore), 10)
        assert stores["c"].device is None and stores["c"].free_at_restore == []  # type: ignore[attr-defined]
        gpu.failing = False
        gpu.exited.add("a")
        record = await asyncio.wait_for(g.switcher(g.spec, ("a",), incoming, restore), 10)
        assert record.ok
        if restore:
            assert stores["c"].device == bytearray(stores["c"].original)
            assert all(free >= 60 * GB for free in stores["c"].free_at_restore)  # type: ignore[attr-defined]
    finally:
        for client in clients.values():
            await asyncio.to_thread(client.close)


async def test_a_job_started_again_settles_its_memory_afresh(coop) -> None:
    """Randomized schedules, seed 8370: job a, SIGTERMed while checkpointed and started again,
    was still taken as settled on its first process's early phases; the new process repeated
    them and its first generate beside another job ran out of memory. A new process of the
    job with no checkpoint, none of the job's connected, starts its settling over; another
    process of a running job does not."""
    orch, target = await coop()
    r = orch.group("g").residency
    first = job(target, "a", FakeStore("a"))
    try:
        await connected(first)
        r.settled.add("a")
        r.holds["a"] = 5
        second = job(target, "a", FakeStore("a-rank-1"))  # another process of the running job
        await connected(second)
        assert "a" in r.settled and r.holds["a"] == 5
        await asyncio.to_thread(second.close)
    finally:
        await asyncio.to_thread(first.close)
    again = job(target, "a", FakeStore("a-again"))  # the job started again
    try:
        await connected(again)
        await eventually(lambda: "a" not in r.settled, what="a's settling started over")
        assert "a" not in r.holds
    finally:
        await asyncio.to_thread(again.close)


async def test_a_newcomer_that_runs_alone_waits_for_the_memory_of_a_job_that_left(coop, monkeypatch) -> None:
    """Randomized schedules, seed 1252: a finished and left (the group forgot it) while its
    process still held its memory; a newcomer that declared nothing was granted at once
    and ran out of GPU memory. It now waits (its client asks again) until NVML shows that
    memory freed."""
    orch, gpu, _, clients = await sized_jobs(coop, monkeypatch, grace=30.0)
    g = orch.group("g")
    b = TimeSliceOrchestratorClient(clients["c"]._s.target, "b", "g")  # the same orchestrator
    try:
        await asyncio.to_thread(clients["a"].close)  # a ends and leaves; its process still holds 60 GB
        assert "a" not in g.residency.residents
        failed = g.counters.failed_switches
        waiter = asyncio.create_task(asyncio.to_thread(b.acquire))
        await eventually(lambda: g.recent and "would stay held by others" in g.recent[-1].error)
        assert not waiter.done() and g.counters.failed_switches == failed
        gpu.exited.add("a")  # a's process exits: NVML shows its memory free
        await asyncio.wait_for(waiter, 20)
        await asyncio.to_thread(b.release)
    finally:
        for client in (*clients.values(), b):
            await asyncio.to_thread(client.close)


async def test_a_reconnect_fails_the_commands_its_old_stream_never_sent() -> None:
    """The kind of schedules seed 1076 (a command nobody reads waits out the step timeout):
    a process reconnects under the same stream id while a checkpoint is queued for its old
    stream; the new stream owns the process, so the old one's close fails nothing: the
    command fails at the reconnect and the checkpoint is sent on the new stream."""
    jobs = CooperativeJobs()
    old = jobs.stream("g", "a", "s1", os.getpid(), 10)
    assert (await anext(old)).kind == "hello"
    checkpoint = asyncio.create_task(jobs.checkpoint("g", "a", timeout=300))  # queued for the old stream
    await eventually(lambda: jobs._processes.of("g", "a")["s1"].commands.qsize() == 1)
    new = jobs.stream("g", "a", "s1", os.getpid(), 10)
    assert (await anext(new)).kind == "hello"
    again = await asyncio.wait_for(anext(new), 20)  # sent again on the new stream, not left on the old one
    assert again.kind == "checkpoint"
    jobs.ack(pb.MemoryCommandAck(job_id="a", group_id="g", op_id=again.op_id, ok=True, bytes=10))
    assert (await asyncio.wait_for(checkpoint, 20)).bytes == 10
    await old.aclose()
    await new.aclose()
    await jobs.close()


async def test_a_checkpoint_whose_stream_closed_before_its_answer_keeps_its_ranges_until_the_process_says(
        short_tmp: Path, caplog) -> None:
    """The kind of schedules seed 30039 (a state lost): an orchestrator stopped while a
    process copied its state into the pinned pool; the stream closed before the answer, the
    offered ranges were freed and written so, and the next orchestrator handed them to
    another job's checkpoint over the first one's state. Now ranges offered to a checkpoint
    whose answer never came stay reserved, and on disk, until the process reconnects and
    says what it did (or the reconnect grace passes)."""
    from timeslice.controller.orchestrator import state_format
    from timeslice.controller.orchestrator.state_file import StateFile

    caplog.set_level(logging.INFO, logger="timeslice")
    state = StateFile(short_tmp / "state.json")
    pool = PinnedPool(short_tmp / "pool", 1 << 16)
    jobs = CooperativeJobs(pool=pool, state=state)
    a = jobs.stream("g", "a", "s1", os.getpid(), 100)
    assert (await anext(a)).kind == "hello"
    checkpoint_a = asyncio.create_task(jobs.checkpoint("g", "a", timeout=300))
    command = await asyncio.wait_for(anext(a), 20)
    offered = [(r.offset, r.length) for r in command.ranges]
    assert command.kind == "checkpoint" and offered
    await a.aclose()  # the stream closes before the answer (the process copied its state to the ranges)
    await eventually(lambda: "process left while checkpointed for a switch group=g job=a" in caplog.text, timeout=20)
    await state.written()
    doc, _ = state_format.read(short_tmp / "state.json")  # what a restarted orchestrator reads
    assert doc is not None and doc.pool is not None
    assert [[tuple(r) for r in c.ranges] for c in doc.pool.checkpoints if c.job == "a"] == [offered]

    b = jobs.stream("g", "b", "t1", os.getpid(), 100)
    assert (await anext(b)).kind == "hello"
    checkpoint_b = asyncio.create_task(jobs.checkpoint("g", "b", timeout=300))
    command_b = await asyncio.wait_for(anext(b), 20)
    taken_by_b = [(r.offset, r.length) for r in command_b.ranges]
    # (a single process is offered every free range: a's offer took the whole pool, so b keeps its own host copy)
    assert not any(o < ob + nb and ob < o + n for o, n in offered for ob, nb in taken_by_b), (offered, taken_by_b)
    jobs.ack(pb.MemoryCommandAck(job_id="b", group_id="g", op_id=command_b.op_id, ok=True, bytes=100,
                                 pinned=bool(taken_by_b)))
    assert (await asyncio.wait_for(checkpoint_b, 20)).bytes == 100

    report = pb.PoolCheckpoint(ranges=[pb.PoolRange(offset=offered[0][0], length=100)], bytes=100, checksum=7)
    again = jobs.stream("g", "a", "s1", os.getpid(), 100, report)  # it reconnects: checkpointed there
    assert (await anext(again)).kind == "hello"
    await asyncio.wait_for(checkpoint_a, 20)
    assert jobs.checkpointed("g", "a")
    assert jobs._processes.of("g", "a")["s1"].pool_ranges == [(offered[0][0], 100)]
    await again.aclose()
    await b.aclose()
    await jobs.close()
    state.close()


async def test_three_jobs_of_which_two_fit_swap_through_a_host_that_holds_two_states(coop) -> None:
    """H200, 3 x 47 GB states, two fit on the GPU, host memory for two states: once two were
    out, the third could not be checkpointed ("no host memory") and ran all its phases alone
    while the others waited (bench/results/rl-grpo-b-serve-cooperative-h200.json). The
    waiter is now restored first, beside the resident (nobody computes during a switch), and
    the resident checkpointed into the host memory that freed: every job is served, the
    host never holds three states, and every restore had room."""
    stores: dict[str, FakeStore] = {}
    gpu = GpuModel(stores, {j: 40 * GB for j in "abc"}, {"a": 101, "b": 102, "c": 103})
    out = lambda: sum(s.device is None for s in stores.values())  # noqa: E731
    most_out = [0]

    def host() -> int:  # the host holds 100 GB of checkpoints: two states
        most_out[0] = max(most_out[0], out())
        return 100 * GB - 40 * GB * out()

    agent = NodeAgent(StaticProcessResolver({"a": [101], "b": [102], "c": [103]}), memory_probe=gpu.probe,
                      host_probe=host)
    orch, target = await coop(agent=agent, pool_bytes=0)
    clients = {}
    try:
        for name in "abc":  # nothing declared: each runs alone at first, so the others go out for it
            stores[name] = SizedStore(name, 40 * GB, gpu)
            clients[name] = job(target, name, stores[name])
            await connected(clients[name])
            await asyncio.to_thread(clients[name].acquire)
            await asyncio.to_thread(clients[name].release)
        assert out() == 2
        for name in "abab":
            await asyncio.to_thread(clients[name].acquire, timeout=30)
            assert stores[name].device == bytearray(stores[name].original)
            await asyncio.to_thread(clients[name].release)
        g = orch.group("g")
        assert any(r.ok and r.bytes_restored and r.evicted for r in g.recent)
        assert most_out[0] <= 2 and all(free >= 40 * GB for s in stores.values()
                                         for free in s.free_at_restore)  # type: ignore[attr-defined]
    finally:
        for client in clients.values():
            await asyncio.to_thread(client.close)


async def test_a_grant_whose_keep_alive_check_is_answered_too_late_is_used(short_tmp, caplog) -> None:
    """The kind's other member: on a `cooperative` group the client confirms its grant with a
    KeepAlive before using it; one not answered in time raised `AcquireTimeout keep-alive g`
    out of acquire(). Now it is asked again and the grant is used."""
    seen: list[str] = []

    class LateKeepAlive(OrchestratorServicer):
        async def KeepAlive(self, request, context):
            resp = await super().KeepAlive(request, context)
            seen.append(request.request_id)
            if len(seen) == 1:
                await asyncio.Event().wait()  # renewed, but answered never
            return resp

    caplog.set_level(logging.WARNING, "timeslice")
    agent_target = f"unix://{short_tmp / 'agent.sock'}"
    agent_server, _ = await create_agent_server(NodeAgent(StaticProcessResolver()), agent_target)
    orch = Orchestrator([GroupSpec(id="g", backend="cooperative", agents=(agent_target,), lease_seconds=60)])
    server, port = await serve(LateKeepAlive(orch))
    client = TimeSliceOrchestratorClient(f"127.0.0.1:{port}", "a", "g", call_timeout=0.3)
    try:
        client.serve_memory_commands(FakeStore("a"))
        assert await asyncio.to_thread(client._memory_loops[-1].connected.wait, 10), "command stream not connected"
        grant = await asyncio.to_thread(client.acquire, timeout=30)
        assert seen == [grant.request_id] * 2 and client.holding() == grant
        assert any("keep-alive g: no answer" in r.getMessage() for r in caplog.records)
        assert await asyncio.to_thread(client.release) == 0
    finally:
        await asyncio.to_thread(client.close)
        await server.stop(0)
        await orch.close()
        await agent_server.stop(0)
