"""Property-based runs (hypothesis) of groups that re-form (issue 11, item 3): claim sets
join and leave a node of four GPUs at random (each on one to three of them, one seat per
GPU), so groups merge and split, while their jobs acquire and release. The real grouping,
reconciler and orchestrator run; the switcher models what is computing (a checkpoint stops a
job, a restore lets it run again). After every step: at most one claim set computes on any
physical GPU (a holder whose group merged into one with another holder was revoked and
stopped before anyone else was granted, or it still holds alone), and no waiter is lost:
every acquire of a claim set still present is queued in the group its claim set is in now,
or granted; only a claim set that left sees its acquire refused."""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from timeslice.controller.orchestrator.group_model import SwitchRecord
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.reconciler import Reconciler
from timeslice.driver.errors import StaleLease

from tests.cluster_objects import World

JOBS = ("a", "b", "c", "d", "e")
GPUS = 4


class StopModel:
    """The `freeze`-like switcher: a checkpoint stops a job's processes, a restore resumes them.
    `stopped` holds claim-set ids (`cs_id`), as the switcher is called with."""

    def __init__(self) -> None:
        self.stopped: set[str] = set()

    async def __call__(self, spec, evict, incoming, restore) -> SwitchRecord:
        self.stopped.update(evict)
        if restore:
            self.stopped.discard(incoming)
        return SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict))


class Cluster:
    """One node; each job is at most one pod with one claim (template "gpu") on some GPUs."""

    def __init__(self) -> None:
        self.world = World()
        self.world.node("node-a", gpus=GPUS, seats=len(JOBS))
        self.pods: dict[str, dict] = {}
        self.gpus: dict[str, tuple[int, ...]] = {}  # job -> the GPUs of its claim
        self._seat = itertools.count()

    def join(self, job: str, gpus: tuple[int, ...]) -> None:
        pod = self.world.pod(f"{job}-{next(self._seat)}", owner=("Job", job))
        seat = JOBS.index(job)  # one seat index per job: never two jobs on one seat
        self.world.claim(pod, "gpu", [("node-a", f"gpu-{g}-seat-{seat}") for g in gpus])
        self.pods[job], self.gpus[job] = pod, gpus

    def leave(self, job: str) -> None:
        pod = self.pods.pop(job)
        self.world.pods.remove(pod)
        name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        self.world.claims[:] = [c for c in self.world.claims if c["metadata"]["name"] != name]
        del self.gpus[job]


def cs_id(job: str) -> str:
    return f"ns/job/{job}:gpu"


async def settle(orch: Orchestrator) -> None:
    """Let switches and grants that are due run (the switcher answers at once): bounded yields."""
    for _ in range(200):
        await asyncio.sleep(0)
        if all(g.switching is None for g in orch.groups()):
            break
    for _ in range(5):  # and the acquires whose futures a grant resolved return
        await asyncio.sleep(0)


async def run(steps: list[tuple[str, str, tuple[int, ...]]]) -> None:
    model = StopModel()
    orch = Orchestrator(switcher=model)
    rec = Reconciler(orch, agent_template="{node}:1", default_backend="freeze")
    cluster = Cluster()
    pending: dict[str, tuple[str, asyncio.Task]] = {}  # job -> (request id, its acquire)
    left: list[asyncio.Task] = []  # acquires of pods that left: refused (or granted as they left)
    holds: dict[str, object] = {}  # job -> the grant its client holds (until it releases or leaves)
    ids = itertools.count()

    async def apply() -> None:
        await rec.apply(cluster.world.snapshot())
        await settle(orch)

    def collect() -> None:
        for job, (_, task) in list(pending.items()):
            if task.done():
                del pending[job]
                if task.exception() is None:
                    if job in cluster.pods:  # a grant that came as its pod left ends with the pod
                        holds[job] = task.result()
                else:
                    assert isinstance(task.exception(), StaleLease) and job not in cluster.pods, task.exception()

    def check() -> None:
        collect()
        computing: dict[int, list[str]] = {}
        for job in holds:
            if job in cluster.pods and cs_id(job) not in model.stopped:
                for g in cluster.gpus[job]:
                    computing.setdefault(g, []).append(job)
        assert all(len(jobs) <= 1 for jobs in computing.values()), computing
        snap = rec.snapshot
        for job, (request_id, _) in pending.items():
            if job not in cluster.pods:
                continue  # it left: its acquire is refused (checked when it ends)
            group = orch.group(snap.group_of[cs_id(job)])
            granted = group.holder is not None and group.holder.job_id == cs_id(job)  # its task ends next
            assert granted or group.queue.by_request(cs_id(job), request_id) is not None, (job, group.id)

    try:
        for op, job, gpus in steps:
            if op == "join" and job not in cluster.pods:
                cluster.join(job, gpus)
                await apply()
            elif op == "leave" and job in cluster.pods:
                cluster.leave(job)
                holds.pop(job, None)
                if job in pending:  # a pod of the same job may join again: this acquire is the old pod's
                    left.append(pending.pop(job)[1])
                await apply()
            elif op == "acquire" and job in cluster.pods and job not in pending and job not in holds:
                group, member = orch.group_for(f"ns/job/{job}", "gpu")
                request_id = f"r{next(ids)}"
                pending[job] = (request_id, asyncio.create_task(group.acquire(member, 0, request_id, None)))
                await settle(orch)
            elif op == "release" and job in holds:
                grant = holds.pop(job)
                group, member = orch.group_for(f"ns/job/{job}", "gpu")
                try:
                    group.release(member, grant.lease_id, grant.epoch)  # type: ignore[attr-defined]
                except StaleLease:
                    assert cs_id(job) in model.stopped  # revoked when its group merged: it was stopped first
                await settle(orch)
            check()
        for job in list(cluster.pods):  # everyone leaves: every acquire ends
            cluster.leave(job)
            holds.pop(job, None)
            if job in pending:
                left.append(pending.pop(job)[1])
            await apply()
            check()
        await settle(orch)
        collect()
        assert not pending
        for task in left:
            assert task.done() and (task.cancelled() or task.exception() is None
                                    or isinstance(task.exception(), StaleLease)), task
    finally:
        for task in [t for _, t in pending.values()] + left:
            task.cancel()
        await orch.close()


gpu_sets = st.lists(st.integers(0, GPUS - 1), min_size=1, max_size=3, unique=True).map(lambda g: tuple(sorted(g)))
step = st.tuples(st.sampled_from(["join", "join", "leave", "acquire", "acquire", "release"]), st.sampled_from(JOBS),
                 gpu_sets)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=4, max_size=40))
@example([("join", "a", (0,)), ("join", "d", (0,)), ("acquire", "a", (0,)), ("leave", "a", (0,)),
          ("acquire", "d", (0,)), ("leave", "d", (0,)), ("release", "d", (0,))])  # granted as its pod left
@example([("join", "a", (0,)), ("join", "b", (0,)), ("acquire", "b", (0,)), ("acquire", "a", (0,)),
          ("leave", "a", (0,)), ("join", "a", (0,))])  # a new pod of a job whose old pod's acquire was refused
@example([("join", "a", (0,)), ("join", "b", (0,)), ("join", "d", (1,)), ("acquire", "b", (0,)),
          ("acquire", "a", (0,)), ("acquire", "d", (0,)), ("leave", "b", (0,)),
          ("join", "b", (0, 1))])  # a granted as b left, then preempted when b's return merged the groups
@example([("join", "a", (0,)), ("join", "a", (0,)), ("join", "b", (1,)), ("join", "c", (1,)),
          ("acquire", "a", (0,)), ("acquire", "b", (0,)), ("acquire", "c", (0,)),
          ("join", "d", (0, 1))])  # seen in CI: the model compared job names with claim-set ids, so b, frozen
# for c once a left the merged group, counted as computing beside c
def test_groups_that_re_form_keep_one_computing_claim_set_per_gpu_and_every_waiter(steps) -> None:
    asyncio.run(run(steps))


async def test_a_merge_keeps_one_holder_and_preempts_the_other_under_its_lease() -> None:
    """a holds GPU 0, b holds GPU 1; c joins on both GPUs and the groups merge. a (granted
    first) goes on holding; b is preempted, not failed: its keep-alives and release stay
    valid, it is frozen before anyone else is granted and holds again in its turn under its
    lease; c waits behind both."""
    model = StopModel()
    orch = Orchestrator(switcher=model)
    rec = Reconciler(orch, agent_template="{node}:1", default_backend="freeze")
    cluster = Cluster()
    try:
        cluster.join("a", (0,))
        cluster.join("b", (1,))
        await rec.apply(cluster.world.snapshot())
        grants = {}
        for job in ("a", "b"):
            group, member = orch.group_for(f"ns/job/{job}", "gpu")
            grants[job] = await group.acquire(member, 0, f"{job}-1", None)
        cluster.join("c", (0, 1))
        await rec.apply(cluster.world.snapshot())
        merged, c = orch.group_for("ns/job/c", "gpu")
        assert orch.group_for("ns/job/a", "gpu")[0] is merged and len(orch.groups()) == 1
        assert merged.holder.job_id == cs_id("a") and merged.holder.lease_id == grants["a"].lease_id
        assert merged.keep_alive(cs_id("b"), grants["b"].lease_id, grants["b"].epoch) > 0  # still its lease
        c_waits = asyncio.create_task(merged.acquire(c, 0, "c-1", None))
        await settle(orch)
        merged.release(cs_id("a"), grants["a"].lease_id, grants["a"].epoch)
        await settle(orch)
        assert merged.holder.job_id == cs_id("b") and merged.holder.lease_id == grants["b"].lease_id
        assert "ns/job/a:gpu" in model.stopped and not c_waits.done()
        merged.release(cs_id("b"), grants["b"].lease_id, merged.holder.epoch)
        grant_c = await c_waits
        assert grant_c.epoch > max(g.epoch for g in grants.values()) and cs_id("b") in model.stopped
    finally:
        await orch.close()
