"""Property-based runs (hypothesis) of one `auto` group whose jobs grow after their first hold
(issue 21's reservations, issue 22's invariants): random schedules of acquires, releases,
give-ups, drops and lease lapses, on a model GPU of 100 GB. A job
allocates 40% of its peak when first granted (its model) and reaches its peak at the start of
each later hold (optimizer state, activations); it declares its peak (`acquire(memory=)`) or nothing.
The holder watch (`memory(watch=...)`) answers once per schedule step with what the model
holds. Invariants after every step: no allocation ever finds the GPU short (an OOM: the
placement kept room for every declared need, and a job that declared nothing ran alone until
its peak was seen), at most one holder, the holder's state is on the GPU, a job's state is
in one place, epochs strictly increase; and at the end, once holders release, every waiter is granted.
`TIMESLICE_SCHEDULE_EXAMPLES` sets the number of schedules (default 500; `make stress-test`: 10 000)."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.group_model import SwitchRecord
from timeslice.controller.orchestrator.memory_snapshot import DeviceMemory, MemorySnapshot
from timeslice.driver.errors import AcquireTimeout, StaleLease, SwitchFailed

GB = 10**9
TOTAL = 100 * GB
DEV = "agent/GPU-0"
JOBS = ("a", "b", "c")


class GrowingGpu:
    """On-device and checkpointed bytes per job; `oom` lists every allocation that did not fit."""

    def __init__(self, peaks: dict[str, int]) -> None:
        self.peaks = peaks
        self.on: dict[str, int] = {}
        self.off: dict[str, int] = {}
        self.oom: list[str] = []
        self.step = asyncio.Event()  # set once per schedule step: the holder watch answers then

    def allocate(self, job: str, n: int, why: str) -> None:
        before = self.on.get(job, 0)
        self.on[job] = max(before, n)
        if sum(self.on.values()) > TOTAL:
            self.oom.append(f"{why}: {job} to {n / GB:.0f} GB beside {self._show()}")

    def _show(self) -> str:
        return ", ".join(f"{j}={b / GB:.0f}" for j, b in sorted(self.on.items()))

    async def __call__(self, spec, evict, incoming, restore) -> SwitchRecord:
        for job in evict:
            self.off[job] = self.on.pop(job, 0)
        if restore and incoming in self.off:
            self.allocate(incoming, self.off.pop(incoming), "restore")
        return SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict))

    async def confirm(self, spec, job) -> bool:
        return job not in self.off

    async def memory(self, spec, jobs, watch: float = 0.0, low_free: int = 0, **_: object) -> MemorySnapshot:
        if watch:
            await self.step.wait()
        return MemorySnapshot(devices={DEV: DeviceMemory(TOTAL, TOTAL - sum(self.on.values()))},
                              device_bytes={j: {DEV: b} for j, b in self.on.items()},
                              checkpointed_bytes={j: {DEV: b} for j, b in self.off.items()},
                              host_available={"agent": 1000 * GB})


OPS = st.lists(st.tuples(st.sampled_from(["acquire", "acquire", "release", "release", "give-up", "drop", "lapse"]),
                         st.sampled_from(JOBS)), min_size=1, max_size=40)
PEAKS = st.fixed_dictionaries({j: st.sampled_from([20, 35, 50, 70]) for j in JOBS})
DECLARES = st.fixed_dictionaries({j: st.booleans() for j in JOBS})


@settings(max_examples=int(os.environ.get("TIMESLICE_SCHEDULE_EXAMPLES", "500")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, peaks=PEAKS, declares=DECLARES)
@pytest.mark.slow  # > 5 s: left out of `make unit`, run by `make test`
def test_jobs_that_grow_after_their_first_hold_are_never_placed_into_an_oom(ops, peaks, declares) -> None:
    asyncio.run(_schedule(ops, {j: p * GB for j, p in peaks.items()}, declares))


async def _schedule(ops, peaks: dict[str, int], declares: dict[str, bool]) -> None:
    gpu = GrowingGpu(peaks)
    g = LockGroup(GroupSpec(id="g", backend="cuda", agents=("agent",), residency="auto", lease_seconds=60),
                  gpu)  # type: ignore[arg-type]
    grants: dict[str, object] = {}
    pending: dict[str, asyncio.Task] = {}
    epochs: list[int] = []
    held: set[str] = set()  # jobs granted once: they built their model

    def check() -> None:
        assert not gpu.oom, gpu.oom
        if g.holder is not None:
            assert g.holder.job_id not in g.residency.checkpointed and g.holder.job_id not in gpu.off
        assert not (set(g.residency.residents) & g.residency.checkpointed)
        assert epochs == sorted(set(epochs))

    def collect() -> set[str]:
        """Acquires that ended: a grant starts a hold (the job allocates), a failure is one we
        know. Returns the jobs granted."""
        nonlocal grants
        granted = set()
        for j, task in list(pending.items()):
            if task.done():
                pending.pop(j)
                if not task.cancelled() and task.exception() is None:
                    granted.add(j)
                    grants[j] = task.result()
                    epochs.append(task.result().epoch)
                    if j not in held:  # its first hold: it builds its model
                        gpu.allocate(j, int(peaks[j] * 0.4), "first hold")
                        held.add(j)
                    else:  # a later one: it grows to its peak (optimizer state, activations)
                        gpu.allocate(j, peaks[j], "growth inside its hold")
                elif not task.cancelled():
                    assert isinstance(task.exception(), SwitchFailed | StaleLease | AcquireTimeout)
        grants = {j: gr for j, gr in grants.items() if g.holder is not None and g.holder.job_id == j}
        return granted

    async def settle() -> None:
        for _ in range(8):  # let switches, grants and the holder watch run
            gpu.step.set()
            await asyncio.sleep(0)
            gpu.step.clear()
            await asyncio.sleep(0)

    for i, (op, job) in enumerate(ops):
        if op == "acquire" and job not in pending and job not in grants:
            memory = peaks[job] if declares[job] else 0
            pending[job] = asyncio.ensure_future(g.acquire(job, 0, f"{job}-{i}", timeout=None, memory=memory))
        elif op == "give-up" and job in pending:
            pending.pop(job).cancel()
        elif op == "release" and job in grants:
            grant = grants.pop(job)
            try:
                g.release(job, grant.lease_id, grant.epoch)  # type: ignore[attr-defined]
            except StaleLease:
                pass
        elif op == "drop":
            g.drop_job(job, "schedule")
            grants.pop(job, None)
            gpu.on.pop(job, None)  # its processes ended: their memory is freed
            gpu.off.pop(job, None)
            held.discard(job)
        elif op == "lapse" and g.holder is not None:
            g.holder.lease_deadline = 0.0
            g.leases.on_timer(g.holder)
        await settle()
        collect()
        check()
    wanting = set(pending)  # the end: holders release; each job still waiting is granted in turn,
    for _ in range(6 * len(JOBS)):  # asking again after a failed switch, as its client does
        for j, grant in list(grants.items()):
            with contextlib.suppress(StaleLease):
                g.release(j, grant.lease_id, grant.epoch)  # type: ignore[attr-defined]
            del grants[j]
        for j in wanting - set(pending):
            pending[j] = asyncio.ensure_future(g.acquire(j, 0, f"{j}-end", timeout=None,
                                                         memory=peaks[j] if declares[j] else 0))
        if g.holder is not None and g.holder.job_id not in grants:  # a grant nobody took (a kept waiter's
            g.holder.lease_deadline = 0.0  # whose caller gave up) lapses with its lease
            g.leases.on_timer(g.holder)
        await settle()
        wanting -= collect()
        check()
        if not wanting:
            break
    assert not wanting, f"never granted while the others released: {sorted(wanting)}"
    await g.close()
