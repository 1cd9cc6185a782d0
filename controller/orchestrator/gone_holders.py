"""Holders whose processes are gone: dropped at once, not after their lease.

Run beside the orchestrator by `timeslice orchestrator` and `timeslice serve` (server.py
`running`). Every `CHECK_SECONDS` each group's holder is looked up on the group's node agents
(`GetLiveJobs`, one call per agent for every group it serves), and at once after a grant the
holders of the groups granted since the last look: an agent calls a job gone only once it saw a
process of it, so the look at a grant shortens the window where a holder killed at once after
its grant still costs its lease. A look at a grant covers only the groups granted (a round over
every group at each grant took 22% of an orchestrator's CPU at 1000 groups and ~900 hand-offs/s,
`bench/handoff.py`), and groups with no node agents are never looked at. A holder that no
agent reports live and at least one reports gone (it had processes there and none is left: killed with its
process group, crashed, exited without a release) is dropped (`LockGroup.drop_job`; an
adopted holder `LockGroup.adopted_holder_gone`), and the next job is granted: a new user's
trial of `kill -9 -- -PGID` on a holding job stalled the other job for the whole lease (10 s
by default). A holder an agent reports live (a worker that outlives its client) keeps its hold
until its lease lapses (on `vmm` and `app`, whose processes nothing stops, also past it while
reported live: `decisions.lease_timer`), and so does one no agent knows (never seen there; a cluster's claims,
which the agents do not look at here) or one whose agent does not answer. On `app`, a holder
whose only live processes serve its inference engine, once its client was seen (`clientless`:
the client was killed, the engine runs on), is dropped too, its engine kept, once no keep-alive
came for half its lease (a client that renews is alive, whatever /proc says); before, such a
holder kept the lock for as long as its engine ran, every other job waiting (a helper's attack).
The same holds for an `app` job whose hold ended unreleased (`AwakeEngines`: its lease revoked
or lapsed, its engine kept awake for its client): gone, it is dropped; clientless, once no
client of it called for half a lease (a live client goes on calling after its lease was lost:
`KeepAliveRequest.lost`; before, a client killed after its hold was revoked at
`maxHoldSeconds` left every other job waiting for a release that never came).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from timeslice.controller.orchestrator.config import MemberSpec
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.group_model import GroupEvent, Hold
from timeslice.driver import names
from timeslice.driver.app_engine import AppEngine

log = logging.getLogger("timeslice.orchestrator")

# How often (seconds) each group's holder is looked up on its node agents.
CHECK_SECONDS = 0.5


# An agent's answer: (live, gone, clientless) jobs (`NodeAgent.live_jobs`).
Answer = tuple[set[str], set[str], set[str]]


class LiveJobs(Protocol):
    async def live_jobs(self, jobs: Sequence[tuple[str, MemberSpec | None, AppEngine | None]]) -> Answer: ...


class GoneHolders:
    """The watch of `groups()`'s holders over `agent(target)`'s answers."""

    def __init__(self, groups: Callable[[], list[LockGroup]], agent: Callable[[str], LiveJobs],
                 every: float = CHECK_SECONDS) -> None:
        self._groups = groups
        self._agent = agent
        self._every = every
        self._granted: dict[str, LockGroup] = {}  # the groups granted since the last look, by id
        self._wake = asyncio.Event()

    def observe(self, group: LockGroup, event: GroupEvent) -> None:
        """An orchestrator observer: a grant in a group with node agents wakes the watch for it."""
        if event.kind == "granted" and group.spec.agents:
            self._granted[group.id] = group
            self._wake.set()

    async def watch(self) -> None:
        """Drop gone holders (`drop_gone`): of every group every `every` seconds, of the
        groups granted since the last look at once, until cancelled; a failed round is
        logged and the next one runs."""
        loop = asyncio.get_running_loop()
        due = loop.time()  # the next round over every group
        while True:
            if loop.time() >= due:
                groups, due = [g for g in self._groups() if g.spec.agents], loop.time() + self._every
            else:
                groups = list(self._granted.values())
            self._granted.clear()
            self._wake.clear()
            try:
                await drop_gone(groups, self._agent)
            except Exception:  # (a bug here must not end the watch of every group)
                log.exception("holder watch failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, due - loop.time()))


async def drop_gone(groups: Sequence[LockGroup], agent: Callable[[str], LiveJobs]) -> list[tuple[str, str]]:
    """One round: ask each agent about the holders of the groups it serves (and on `app` the
    unreleased jobs: `AwakeEngines`), then drop each that is gone on its group's agents (`gone`)
    and still holds (or is still unreleased). Returns the (group id, job) pairs dropped."""
    # (group, job, its hold as holder or None, what must still be current once the agents answered)
    asked: list[tuple[LockGroup, str, Hold | None, object]] = [
        (g, g.holder.job_id, g.holder, g.holder) for g in groups if g.holder is not None and g.spec.agents]
    asked += [(g, job, None, g.awake.unreleased_hold(job)) for g in groups
              if g.spec.agents and g.spec.backend == names.BACKEND_APP for job in g.awake.unreleased()]
    targets = sorted({t for g, *_ in asked for t in g.spec.agents})
    answers = await asyncio.gather(*(agent(t).live_jobs([(j, g.spec.member(j), g.spec.app(j)) for g, j, *_ in asked
                                                         if t in g.spec.agents]) for t in targets),
                                   return_exceptions=True)
    by_target: dict[str, Answer | None] = {}
    for t, answer in zip(targets, answers, strict=True):
        if isinstance(answer, BaseException):
            log.debug("holder watch: agent %s did not answer: %s", t, answer)
            by_target[t] = None
        else:
            by_target[t] = answer
    dropped = []
    for g, job, h, was in asked:
        said = [by_target[t] for t in g.spec.agents]
        if h is not None and g.holder is h and any(a is not None and job in a[0] for a in said):
            g.seen_live(job)
        if (g.holder if h is not None else g.awake.unreleased_hold(job)) is not was:
            continue  # (it released, or was dropped or granted, or its hold ended again, while the agents answered)
        if gone(job, said, 1):
            log.warning("%s gone group=%s job=%s: none of its processes is left", "holder" if h else "unreleased job",
                        g.id, job)
            if h is None or not g.adopted_holder_gone(job):
                g.drop_job(job, "its processes are gone", gone=True)
        elif gone(job, said, 2) and _quiet(g, job, h):
            log.warning("%s's client gone group=%s job=%s: only its engine's processes are left and %s",
                        "holder" if h else "unreleased job", g.id, job,
                        "no keep-alive came for half its lease" if h else "no client of it called for half a lease")
            g.drop_job(job, "its client's processes are gone (its engine runs on)")
        else:
            continue
        dropped.append((g.id, job))
    return dropped


def _quiet(g: LockGroup, job: str, h: Hold | None) -> bool:
    """Whether a clientless `job` (its holder's hold `h`, None: it is unreleased) said nothing
    for half a lease: a holder renewed no keep-alive, no client of an unreleased job called
    (`AwakeEngines.heard`). A client that calls is alive, whatever /proc says (an agent cannot
    always tell it apart: a short-lived process of the job, seen once, looks like a client
    that died)."""
    half = g.spec.lease_seconds / 2
    return g.clock() >= h.lease_deadline - half if h is not None else g.awake.quiet_seconds(job) >= half


def gone(job: str, answers: Sequence[Answer | None], which: int = 1) -> bool:
    """Whether `job` is gone by its group's agents' `answers` ((live, gone, clientless) each;
    None: that agent did not answer): every agent answered, none has it live, and one has it
    gone (`which` 1), or clientless (2: its client is gone, its engine is not)."""
    return all(a is not None for a in answers) and not any(job in a[0] for a in answers if a is not None) \
        and any(job in a[which] for a in answers if a is not None)
