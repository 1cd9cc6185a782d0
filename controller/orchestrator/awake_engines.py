"""AwakeEngines: backend `app` engines kept awake for their clients (and `vmm` processes'
memory kept on the GPUs for theirs: `names.UNRELEASED_KEPT_BACKENDS`).

Owned by `LockGroup` (one per group; `MemoryMoves` consults it). The node agent calls a
job's inference engine (vLLM's sleep API, SGLang's memory occupation), it does not stop the
job's client, so a sleep under a client that still generates fails its requests. A holder
whose hold ended without its release (its lease revoked at `maxHoldSeconds` or by a merge,
lapsed, or persisted as one that must leave by an orchestrator that then restarted) is
*unreleased*: its engine is not slept, and nobody who needs its room is granted, until its
client released, its job is dropped, it holds again, or no process of it is left (`watch`:
a client that died never releases; app schedules seed 97: the job left just before an
orchestrator restart that found it persisted as one that must leave, and every other
grant waited for good), or only its engine's are and no client of it called for half a lease
(`gone_holders`: its client was killed, its engine runs on; a live client goes on calling after
its lease was lost, `heard`). An engine woken without a grant (a rollback's wake) is reported
to its client at its next grant (`woken`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.group_model import Hold
from timeslice.driver.tasks import cancel_and_wait

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

# While a grant waits for unreleased engines: how often their jobs' processes are looked for on
# the node agents (a client that dies sends no release and no Leave), seconds.
GONE_CHECK_SECONDS = 2.0


class AwakeEngines:
    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self._unreleased: dict[str, tuple[Hold | None, str]] = {}  # job -> (the hold that ended, or None; why)
        # job -> when (the group's clock) it became unreleased, or a client of it last called since
        self._since: dict[str, float] = {}
        self._woken: set[str] = set()  # engines woken without a grant, reported at the next (`woken`)
        self._left: set[str] = set()  # holders a process of which left (`left_holding`)
        self._watch: asyncio.Task[None] | None = None
        self._closed = False

    def forget(self, job: str) -> None:
        """`job` holds again (a hold of it that ended unreleased is superseded), or it is gone
        (its processes are done: its engine may sleep)."""
        self._unreleased.pop(job, None)
        self._since.pop(job, None)
        self._left.discard(job)

    def lapsed(self, job: str, hold: Hold | None, why: str) -> bool:
        """`job`'s hold (`hold`, None when not known: adopted or carried without it) ended
        without its release, `why`: it is unreleased. Returns True when the job is to be
        dropped instead: a process of it left while it held and nothing renewed the lease
        since (`left_holding`)."""
        self._unreleased[job] = (hold, why)
        self._since.setdefault(job, self._g.clock())
        return job in self._left

    def left_holding(self, job: str) -> None:
        """A process of `job` left (`Leave`) while the job held, with no waiter of it: another
        caller's part of the hold remained. Should the lease then lapse, the job is dropped
        (`lapsed`), not left unreleased for a release that a caller which died will never send
        (app schedules seed 5: a client killed mid-hold, started again, joined its job's hold,
        finished and left; the lease lapsed and every other job's grant waited for the dead
        caller's release). A new grant of the job forgets it."""
        self._left.add(job)

    def unreleased(self, excluding: str = "") -> list[str]:
        """The unreleased jobs still on the GPUs, but `excluding`, sorted."""
        residents = self._g.residency.residents
        return sorted(j for j in self._unreleased if j != excluding and j in residents)

    def unreleased_jobs(self) -> set[str]:
        """Every unreleased job, on the GPUs or not."""
        return set(self._unreleased)

    def why(self, job: str) -> str:
        return self._unreleased[job][1]

    def heard(self, job: str) -> None:
        """A client of `job` called (a keep-alive, accepted or not, or one that only says it lives
        after its lease was lost: orchestrator.proto `KeepAliveRequest.lost`)."""
        if job in self._unreleased:
            self._since[job] = self._g.clock()

    def quiet_seconds(self, job: str) -> float:
        """Seconds since unreleased `job` became so, or a client of it last called since
        (`heard`); 0.0 for a job that is not unreleased."""
        return self._g.clock() - self._since[job] if job in self._unreleased else 0.0

    def unreleased_hold(self, job: str) -> tuple[Hold | None, str] | None:
        """(the hold that ended unreleased, None when not known, and why) of an unreleased
        job; None for any other."""
        return self._unreleased.get(job)

    def released(self, job: str) -> None:
        """Every caller of `job`'s unreleased hold released: its engine may sleep."""
        self._unreleased.pop(job, None)
        self._since.pop(job, None)

    def woke(self, jobs: list[str]) -> None:
        """The engines of `jobs` were woken without a grant: their next grants say restored."""
        self._woken.update(jobs)

    def woken(self, job: str) -> bool:
        """Whether `job`'s engine was woken without a grant since its last one (a failed
        switch's rollback woke it): its next grant says restored,
        so its client learns that its engine reloaded its state (a vLLM sleep of level 2
        discards the weights; a wake does not bring them back). Reported once."""
        if job not in self._woken:
            return False
        self._woken.discard(job)
        return True

    def watch(self, jobs: list[str]) -> None:
        """A grant waits for the unreleased `jobs`: look for their processes on the group's
        node agents now and every `GONE_CHECK_SECONDS` while it waits; a job none of whose
        processes is left on any node (every agent answered) is dropped, which lets the
        group move its engine's memory (a switch finds it gone) and grant. Without a switcher
        that reports memory, or in a cluster, nothing is looked for: there the agents find a
        job's processes through its claims, a failed API read leaves them out of a report as if
        there were none, and the job is dropped when its pods are gone."""
        if self._g.spec.members or self._closed:  # (cluster mode: members name the claim sets)
            return
        if (self._watch is None or self._watch.done()) and hasattr(self._g.switcher, "memory"):
            self._watch = asyncio.get_running_loop().create_task(self._look(jobs), name=f"awake-{self._g.id}")

    async def _look(self, jobs: list[str]) -> None:
        g = self._g
        gone: list[str] = []
        try:
            snap = await g.switcher.memory(g.spec, jobs, for_plan=False)  # type: ignore[attr-defined]
            if g.spec.agents and not snap.unanswered:
                gone = [j for j in jobs if not snap.processes.get(j)]
        except Exception as err:  # an agent that does not answer: look again later
            log.debug("unreleased engines not looked for group=%s: %s", g.id, err)
        gone = [j for j in gone if j in self._unreleased]  # (released or dropped meanwhile)
        for job in gone:
            log.warning("job dropped group=%s job=%s: its hold ended unreleased (%s) and no process of it is left "
                        "on its nodes: nothing will release it", g.id, job, self._unreleased[job][1])
            g.drop_job(job, "its hold ended unreleased and no process of it is left on its nodes", gone=True)
        if not gone:
            await asyncio.sleep(GONE_CHECK_SECONDS)
        self._watch = None
        g.dispatch()

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(self._watch)
