"""MemoryMoves: when a lock group moves GPU memory, and what it moves.

Owned by `LockGroup` (one per group); runs the group's switches through its `Switcher`.
Residency (`residency.py`, plans in `placement.py`): several jobs may be resident at once; the lock orders
compute, memory moves only when needed. `auto` (the default, for the backends that move
GPU memory): a resident waiter is granted at once; any other is granted after a plan
over fresh node-agent memory reports checkpoints the least recently held idle residents
it does not fit beside, then restores it when it is checkpointed. A plan without room
fails the waiters with `SwitchFailed` (nothing attempted; their clients ask again, and it
never counts against the job as a failed restore). While a job
holds, the job to be granted next, when checkpointed, is *staged*: room is made for it
beside the holder (never moving the holder, leaving it room to grow to its need: its
peak or what it declared) and it is restored behind the holder's phase, so the hand-off
moves nothing; a staging without room is left to the hand-off. When the group goes idle, checkpointed jobs that fit are
restored in the background. `exclusive` (and
the `freeze` backend, and agents that report no GPU memory): one job is resident, as in
a checkpoint at every hand-off.

Jobs that must leave the GPUs before anyone is granted, whether or not the incoming job
fits beside them (their processes may still compute): preempted holders, *fenced* ones
(dropped while holding) and *lapsed* ones (their lease ran out). *Orphans*: checkpointed
jobs nobody will ask for (dropped, or lapsed while preempted), restored when the group is
idle (`idle_restores.py`) so no process stays stopped, then forgotten.

Backend `app`: a holder whose hold ended without its release leaves the GPUs only once its
client released, or is gone (`awake_engines.py`); nobody is granted in its place until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING, NamedTuple

from timeslice.controller.orchestrator.config import MEMORY_BACKENDS
from timeslice.controller.orchestrator.decisions import (
    DispatchFacts,
    GrantBeside,
    GrantOnGpu,
    ReadRecords,
    SettleUnsure,
    Stage,
    Switch,
    WaitForRelease,
    Waiting,
    decide,
)
from timeslice.controller.orchestrator.group_model import Hold, SwitchError, SwitchRecord
from timeslice.controller.orchestrator.in_flight import on_gpus_after_steps
from timeslice.controller.orchestrator.lock_queue import Waiter
from timeslice.controller.orchestrator.memory_snapshot import MemorySnapshot
from timeslice.controller.orchestrator.move_cost import move_seconds, moves_nothing, pass_remaining, switch_speed
from timeslice.controller.orchestrator.placement import (
    NoRoom,
    as_planned,
    crowded,
    devices_of,
    held_by_others,
    lacking_room,
    moves_may_come,
    place,
)
from timeslice.driver import names
from timeslice.driver.errors import JobFailed, SwitchFailed
from timeslice.driver.headroom import parse_headroom

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

# A job whose restore fails this many times in a row fails (`JobFailed`): its acquires are
# refused with the last cause until it is dropped (its pods restarted), and the group serves
# the others instead of repeating checkpoint(other) -> restore -> rollback at every acquire.
# Only a restore step that ran and failed counts: not a plan without room, nor a checkpoint
# of another job, nor agents that did not answer (none of them is the job's own fault).
MAX_RESTORE_FAILURES = 3
# While a resident's processes are departing (see `SwitchCoordinator.departing`), a plan that
# finds no room asks for a fresh memory report this often, seconds.
DEPARTING_POLL_SECONDS = 0.25
# While a job holds (memory-aware groups), its node agents sample the GPUs every 100 ms
# (`AgentClient.memory(watch=...)`), answering at least this often (seconds) with the
# holder's peak, and at once when a GPU's free memory falls under the headroom.
HOLDER_WATCH_SECONDS = 2.0


class AgentsUnanswered(NoRoom):
    """A memory report a plan needs was not answered by every node agent (`MemoryMoves.snapshot`)."""


class Plan(NamedTuple):
    """What a switch moves: `evict`, the residents to checkpoint, in order; `restore_first`:
    the incoming job's checkpoint is restored before theirs are taken (`plan_room`)."""

    evict: list[str]
    restore_first: bool = False


class MemoryMoves:
    """The switch in progress of `group` (`switching`: (first evicted job or None, incoming
    job)), its background memory refresh, and the jobs that must leave or be restored."""

    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self.switching: tuple[str | None, str] | None = None
        self._evicting: frozenset[str] = frozenset()  # the jobs the switch in flight moves off the GPUs
        self._switch_task: asyncio.Task[None] | None = None
        self._restore_failures: dict[str, int] = {}  # job -> restores failed in a row
        self._fenced: set[str] = set()  # dropped holders to checkpoint before anyone is granted
        self._lapsed: set[str] = set()  # holders whose lease lapsed: checkpointed before anyone is granted
        # jobs a rollback could not put back: on the GPUs or not (settled before a grant: `_settle_unsure`;
        # else until the next answered memory report)
        self._unsure: set[str] = set()
        # node agents whose checkpoint records a takeover could not read: read before a grant (`records_unknown`)
        self.records_unknown: set[str] = set()
        self._records_task: asyncio.Task[None] | None = None
        self._settle_task: asyncio.Task[None] | None = None  # `_settle_unsure`
        self._unstaged: tuple[int, str] | None = None  # (holder's epoch, job) a staging found no room for
        self._beside: str | None = None  # while a staging runs: the job it makes room beside
        self._watch_task: asyncio.Task[None] | None = None
        self._granted_at: dict[str, float] = {}  # job -> clock() at its last grant
        self._deferred: asyncio.TimerHandle | None = None  # dispatches again when a deferral ends
        self._report_task: asyncio.Task[None] | None = None  # a deferral's memory report
        self._reported_at_epoch = -1  # the epoch a deferral last asked for a memory report at

    @property
    def memory_aware(self) -> bool:
        """Residency `auto` on a backend that moves GPU memory, with a switcher that reports it."""
        spec = self._g.spec
        return spec.residency == "auto" and spec.backend in MEMORY_BACKENDS and hasattr(self._g.switcher, "memory")

    # -- what happened to a job ------------------------------------------------------
    def granted(self, job: str) -> None:
        """`job` holds the lock with its state on the GPUs: nothing pending about it (a hold of
        it that ended unreleased is superseded: its client holds again)."""
        self._granted_at[job] = self._g.clock()
        self._restore_failures.pop(job, None)
        self._fenced.discard(job)
        self._lapsed.discard(job)
        self._g.awake.forget(job)

    def lapsed(self, job: str, hold: Hold | None = None, why: str = "its lease lapsed") -> bool:
        """`job`'s lease lapsed while it held (or was revoked: `hold`, the hold that ended, and
        `why`): cut off, not gone, it may still compute, so it leaves the GPUs before anyone is
        granted. On backend `app` only once its client released (`AwakeEngines.lapsed`, whose
        answer it returns: whether the job is to be dropped instead)."""
        if self._g.spec.backend == names.BACKEND_APP:
            return self._g.awake.lapsed(job, hold, why)
        if self._g.spec.backend != names.BACKEND_NONE:
            self._lapsed.add(job)
        return False

    def evicting(self, job: str) -> bool:
        """Whether the switch in flight moves `job` off the GPUs (its outcome says where it is)."""
        return job in self._evicting

    def unconfirmed(self, job: str) -> bool:
        """Whether a process of `job` has not said since a restart whether its state is on the
        GPUs or checkpointed (`SwitchCoordinator.unconfirmed`; the state file alone does not
        tell: the orchestrator may have died after a restore ran and before its answer was
        recorded). Such a job counts as resident: its memory counts against the GPUs, and room
        made beside it checkpoints it, which waits for its processes. It is never granted as
        resident: its grant restores it, refused (its client asks again) until they have
        reconnected."""
        unconfirmed = getattr(self._g.switcher, "unconfirmed", None)
        return unconfirmed is not None and bool(unconfirmed(self._g.spec, job))

    def dropped(self, job: str, held: bool) -> None:
        """`job` is gone (`held`: while it held the lock). A holder (or a lapsed or fenced job,
        or one the switch in flight moves off) still resident is fenced: nobody is granted
        until a switch has checkpointed (or frozen, or found gone) its processes; then, like
        one dropped while checkpointed, it is restored when the group is idle, then forgotten."""
        g = self._g
        if (held or job in self._lapsed | self._fenced | self._evicting | g.awake.unreleased_jobs()) \
                and g.spec.backend != "none" and job in g.residency.residents:  # dropped again while fenced: it stays
            self._fenced.add(job)  # (being evicted: an orphan once out)
        elif job in g.residency.checkpointed and g.spec.backend != "none":
            g.idle.unowned(job)
        else:
            g.residency.forget(job)
        self._lapsed.discard(job)
        g.awake.forget(job)
        self._restore_failures.pop(job, None)
        self._granted_at.pop(job, None)

    # -- grants ------------------------------------------------------------------------
    def facts(self) -> DispatchFacts:
        """What the group knows now, for `decisions.decide`. The memory-aware facts (room by
        the last report, how long resident waiters may pass the head) only on memory-aware
        groups: the others decide without them."""
        g, r = self._g, self._g.residency
        aware = self.memory_aware
        head = g.queue.head()
        queued = {w.job_id for w in g.queue}
        leaving = tuple(self.must_leave())
        return DispatchFacts(
            backend=g.spec.backend, memory_aware=aware,
            holder=g.holder.job_id if g.holder else None, holder_epoch=g.holder.epoch if g.holder else 0,
            switching=self.switching is not None, beside=self._beside,
            queue=tuple(Waiting(w.job_id, w.priority) for w in g.queue),
            residents=tuple(r.residents), checkpointed=frozenset(r.checkpointed),
            unconfirmed=frozenset(j for j in queued if self.unconfirmed(j)),
            known=frozenset(j for j in queued | ({g.holder.job_id} if g.holder else set()) if r.known(j)),
            roomy=frozenset(j for j in queued if j in r.residents and roomy(g, j)) if aware else frozenset(),
            leaving=leaving, unreleased=tuple(g.awake.unreleased()), failed=frozenset(g.failed_jobs),
            unstaged=self._unstaged,
            records_unknown=bool(self.records_unknown) and hasattr(g.switcher, "checkpointed"),
            unsure=bool(self._unsure) and self._settles_unsure,
            pass_remaining=pass_remaining(g, head) if aware and head is not None and not leaving else 0.0,
            head_moves_nothing=aware and head is not None and moves_nothing(g, head.job_id))

    def dispatch(self) -> None:
        """Run what `decisions.decide` says the group does now."""
        g = self._g
        d = decide(self.facts())
        head = g.queue.head()
        if isinstance(d, (GrantOnGpu, Switch)) and head is not None and d.job != head.job_id:
            log.debug("resident first group=%s job=%s before=%s", g.id, d.job, head.job_id)
        if isinstance(d, ReadRecords):
            self._read_records()
        elif isinstance(d, SettleUnsure):
            self._settle_unsure()
        elif isinstance(d, WaitForRelease):
            log.info("grant waits group=%s: the engine of %s stays awake until its client releases (%s)",
                     g.id, ", ".join(d.jobs), "; ".join(g.awake.why(j) for j in d.jobs))
            g.awake.watch(list(d.jobs))
        elif isinstance(d, GrantOnGpu):
            self._grant_on_gpu(d.job)
        elif isinstance(d, Switch):
            if not (d.may_defer and head is not None and self._defer(head)):
                self.start_switch(None if d.evict is None else list(d.evict), d.job, d.restore, grant=True)
        elif isinstance(d, Stage):
            self.switching, self._beside = (None, d.job), d.beside
            self._switch_task = asyncio.get_running_loop().create_task(
                self._switch(None, d.job, restore=True, grant=False, beside=d.beside), name=f"stage-{g.id}")
        elif isinstance(d, GrantBeside):
            log.debug("granted beside a staging group=%s job=%s", g.id, d.job)
            g.grant(d.job, restored=False, switch_seconds=0.0)

    def _defer(self, head: Waiter) -> bool:
        """Whether `head`'s grant, which moves memory, waits (one job after the other on
        purpose): while resident waiters may pass `head` (`pass_remaining`) and an idle resident on
        its GPUs was granted more recently than the move would take (`move_seconds`): it is
        between its phases and will be back before moving it out pays. The lock stays free
        for the residents; a timer dispatches again when the deferral ends. Without a memory
        report yet, or with one older than a hold of a job whose need is not known (it may
        have grown since: on the H200 an undeclared job built 48 GB in its first hold after the
        report at its grant, the next job's move looked free, and three jobs of 57 GB moved
        22-29 s each at their first holds, 0.66x; bench/results/rl-grpo-b-serve-cuda-h200.json),
        one is asked for first (once per epoch). Measured on the H200 with the
        driver's checkpoint (`cuda`): 3 jobs of 57 GB (two fit) switched every phase at ~30 s
        a switch, 0.54x of one after the other (bench/results/rl-grpo-b-serve-cuda-h200.json),
        and 2 jobs of 19 GB that fit, while unsettled, every phase at 5-15 s, 0.67x (a run
        not kept); with the deferral 0.83x, now 1.05x (bench/results/rl-grpo-a-serve-h200.json)."""
        g = self._g
        r = g.residency
        if (r.snapshot is None or r.unsettled_held_since_report(excluding=head.job_id)) and \
                switch_speed(g) is not None:
            if self._reported_at_epoch != g.epoch:  # measure first, then decide
                self._reported_at_epoch = g.epoch
                self._report_task = asyncio.get_running_loop().create_task(self._report_then_dispatch())
                return True
            if r.snapshot is None:
                return False
        seconds = move_seconds(g, head.job_id)
        now = g.clock()
        left = pass_remaining(g, head)
        if seconds is None or left <= 0:
            return False
        active = [now - self._granted_at[j] for j in g.residency.lru(excluding=[head.job_id])
                  if now - self._granted_at.get(j, -math.inf) < seconds]
        if not active:
            return False
        wait = min(left, seconds - max(active))
        if self._deferred is not None:
            self._deferred.cancel()
        self._deferred = asyncio.get_running_loop().call_later(wait, g.dispatch)
        log.info("deferred group=%s job=%s for %.1f s: its grant moves memory (about %.1f s) and the residents "
                 "are between phases", g.id, head.job_id, wait, seconds)
        return True

    async def _report_then_dispatch(self) -> None:
        try:
            await self.snapshot()
        except Exception as err:  # an agent that does not answer: decide without a report
            log.warning("no memory report group=%s: %s", self._g.id, err)
        self._g.dispatch()

    def _grant_on_gpu(self, incoming: str) -> None:
        """Grant `incoming`, which the group believes has its state on the GPUs, once its node
        agents confirm it (`Switcher.confirm`: none holds a checkpoint record of it). A job an
        agent reports checkpointed after all is restored first; an agent that does not answer
        fails the waiters (nothing is granted on a guess). Immediate: without agents (`none`),
        for a switcher that cannot confirm, and for a job this group never placed (no step of
        it ran here; after a restart or a leader change the agents' records were adopted)."""
        g = self._g
        if g.spec.backend == "none" or not hasattr(g.switcher, "confirm") or incoming not in g.residency.residents:
            g.grant(incoming, restored=False, switch_seconds=0.0)
            return
        self.switching = (None, incoming)
        self._switch_task = asyncio.get_running_loop().create_task(self._confirm_then_grant(incoming),
                                                                   name=f"confirm-{g.id}")

    async def _confirm_then_grant(self, incoming: str) -> None:
        g = self._g
        try:
            on_gpu = await g.switcher.confirm(g.spec, incoming)  # type: ignore[attr-defined]
        except Exception as err:  # an agent that does not answer (or a switcher bug): no grant on a guess
            log.warning("cannot confirm group=%s job=%s is on the GPUs: %s", g.id, incoming, err)
            g.fail_job(incoming, SwitchFailed(f"group {g.id}: cannot confirm that job {incoming} has its state "
                                              f"on the GPUs: {err}; nothing was granted"))
            on_gpu = None
        finally:
            self.switching = None
            self._switch_task = None
        if on_gpu is False:
            log.warning("job %s is checkpointed on its node agents, not resident as this group believed "
                        "group=%s: restoring it before the grant", incoming, g.id)
            g.residency.moved_out(incoming)
        elif on_gpu and g.holder is None:  # (a job granted meanwhile holds: this one waits its turn)
            g.grant(incoming, restored=False, switch_seconds=0.0)
        g.dispatch()

    def _read_records(self) -> None:
        """Before any grant after a takeover that could not read some node agents' checkpoint
        records (`records_unknown`): read them, and restore the jobs they hold checkpointed
        before their grants. Until they answer nothing is granted on a guess: the waiters get
        `SwitchFailed` and their clients ask again (app schedules seed 97: the orchestrator
        restarted while the agent was down, took a sleeping engine for awake, and granted its
        job with its state off the GPU)."""
        if self._records_task is None or self._records_task.done():
            self._records_task = asyncio.get_running_loop().create_task(self._records(), name=f"records-{self._g.id}")

    async def _records(self) -> None:
        g = self._g
        targets = sorted(self.records_unknown)
        try:
            found = await g.switcher.checkpointed(g.spec, targets)  # type: ignore[attr-defined]
        except Exception as err:  # still unreadable: nothing is granted on a guess
            log.warning("checkpoint records still unknown group=%s agents=%s: %s", g.id, targets, err)
            self._fail_waiters(f"the checkpoint records of node agent(s) {', '.join(targets)} cannot be read since "
                               f"this orchestrator took over ({err}); nothing is granted until they answer")
            return
        self.records_unknown.difference_update(targets)
        for job in sorted(found):
            if (g.holder is None or g.holder.job_id != job) and job not in g.residency.checkpointed:
                log.info("checkpoint record read group=%s job=%s: restored before its grant", g.id, job)
                g.residency.moved_out(job)
        g.dispatch()

    @property
    def _settles_unsure(self) -> bool:
        """Whether the jobs a rollback could not put back (`_unsure`) are settled with their node
        agents before any grant (`in_flight.py`): the agents step them (not `cooperative`, whose
        processes answer for themselves) and the switcher reads their records and memory."""
        g = self._g
        return g.spec.backend not in (names.BACKEND_COOPERATIVE, names.BACKEND_NONE) and \
            hasattr(g.switcher, "checkpointed") and hasattr(g.switcher, "memory")

    def _settle_unsure(self) -> None:
        if self._settle_task is None or self._settle_task.done():
            self._settle_task = asyncio.get_running_loop().create_task(self._settle(), name=f"settle-{self._g.id}")

    async def _settle(self) -> None:
        """Once no step of the unsure jobs runs on their node agents, each is where its records
        say; until then nothing is granted: the waiters get `SwitchFailed` and their clients ask
        again (`in_flight.on_gpus_after_steps`)."""
        g = self._g
        jobs = set(self._unsure)
        try:
            on_gpus = await on_gpus_after_steps(g.switcher, g.spec, jobs)
        except Exception as err:  # a step still runs, or an agent does not answer: no grant on a guess
            log.warning("not settled group=%s jobs=%s: %s", g.id, sorted(jobs), err)
            self._fail_waiters(str(err))
            return
        for job in sorted(on_gpus & g.residency.checkpointed):
            log.warning("job %s is on the GPUs after all group=%s: a step of its rollback ended late", job, g.id)
            g.residency.moved_in(job)
        self._unsure -= jobs
        g.dispatch()

    def _fail_waiters(self, why: str) -> None:
        """Nothing is granted on a guess: every waiter gets `SwitchFailed` and its client asks again."""
        g = self._g
        for job in {w.job_id for w in g.queue}:
            g.fail_job(job, SwitchFailed(f"group {g.id}: {why}"))

    def must_leave(self, incoming: str = "") -> list[str]:
        """Holders preempted mid-phase, dropped, or whose lease lapsed, that are still on the
        GPUs: they must leave whether or not the incoming job fits beside them (their
        processes may still be computing; on backend `app` once their client released:
        `unreleased`)."""
        jobs = self._g.preemption.parked_jobs() + sorted(self._fenced | self._lapsed | self._g.awake.unreleased_jobs())
        return [j for j in dict.fromkeys(jobs) if j != incoming and j in self._g.residency.residents]

    # -- the holder's growth ------------------------------------------------------------------
    def watch_holder(self) -> None:
        """While a job holds (memory-aware groups): learn its peak as it grows, and when a
        GPU's free memory falls under the headroom (the holder outgrew its reservation),
        checkpoint idle residents there, least recently held first, never the holder, before
        the holder runs out."""
        if self.memory_aware and (self._watch_task is None or self._watch_task.done()):
            self._watch_task = asyncio.get_running_loop().create_task(self._watch(), name=f"watch-{self._g.id}")

    async def _watch(self) -> None:
        """Watch the holder without a gap (`Residency.unobserved` where one is left): a report
        is observed also when the hold it began in has ended (it carries the peaks since the
        agent's last report, the next holder's included), and a watch that answered early for
        low memory, nothing being able to leave, is followed by one that does not."""
        g = self._g
        quiet = False  # the last watch answered for low memory: watch on without the threshold
        while g.holder is not None:
            h, r = g.holder, g.residency
            fraction, fixed = parse_headroom(g.spec.memory_headroom)
            totals = [d.total for d in r.snapshot.devices.values()] if r.snapshot else []
            low = int(fraction * min(totals)) + fixed if totals and not quiet else 0
            jobs = sorted({*r.residents, *r.checkpointed})
            started = time.monotonic()
            try:
                snap = await g.switcher.memory(g.spec, jobs, watch=HOLDER_WATCH_SECONDS,  # type: ignore[attr-defined]
                                               low_free=low)
            except Exception as err:  # an agent that does not answer: the next grant plans afresh
                log.warning("memory watch failed group=%s holder=%s: %s", g.id, h.job_id, err)
                r.unobserved()
                await asyncio.sleep(HOLDER_WATCH_SECONDS)
                continue
            if snap is not None:
                r.observe(snap)
                self._pin_if_moves_may_come()
                if g.holder is h and snap.devices and await self._room_for_holder(snap, h.job_id):
                    continue
            quiet = bool(low) and snap is not None and any(m.free < low for m in snap.devices.values())
            if not quiet:  # an agent that answers at once (a test double) is asked again later
                await asyncio.sleep(max(0.0, HOLDER_WATCH_SECONDS - (time.monotonic() - started)))

    async def _room_for_holder(self, snap: MemorySnapshot, holder: str) -> bool:
        """Checkpoint idle residents on the GPUs where `snap` shows less free than the
        headroom; True when it did."""
        g, r = self._g, self._g.residency
        fraction, fixed = parse_headroom(g.spec.memory_headroom)
        short = {dev: int(fraction * m.total) + fixed - m.free for dev, m in snap.devices.items()
                 if m.free < int(fraction * m.total) + fixed}
        if not short or self.switching is not None:
            return False
        evict = []
        for job in r.lru(excluding=[holder]):
            held = snap.movable_bytes.get(job, snap.on_device(job))
            if any(held.get(dev, 0) > 0 for dev in short):
                evict.append(job)
                for dev in short:
                    short[dev] -= held.get(dev, 0)
                if all(v <= 0 for v in short.values()):
                    break
        if not evict:
            return False
        log.warning("holder %s outgrew its reservation group=%s (free %s): checkpointing idle %s", holder,
                    g.id, {d: m.free for d, m in snap.devices.items()}, evict)
        r.unobserved()  # nothing samples the holder while they leave
        await self._make_room_now(evict, holder)
        return True

    async def _make_room_now(self, evict: list[str], holder: str) -> None:
        """Checkpoint idle residents `evict` beside the holder (no restore, no grant)."""
        g = self._g
        self.switching = (evict[0], holder)
        self._evicting = frozenset(evict)
        try:
            record = await g.switcher(g.spec, tuple(evict), holder, False)
        except SwitchError as err:
            record = err.record
            g.counters.failed_switches += 1
            for job in err.off_gpu:
                g.residency.moved_out(job)
            log.warning("room for the holder not made group=%s evict=%s: %s", g.id, evict, err)
        else:
            for job in evict:
                g.residency.moved_out(job)
            g.counters.switches += 1
        finally:
            self.switching, self._evicting = None, frozenset()
        record.finished_at_unix = time.time()
        g.recent.append(record)
        g.notify("switched" if record.ok else "switch-failed", holder, record=record)
        g.dispatch()

    # -- the switch ------------------------------------------------------------------------
    def start_switch(self, evict: list[str] | None, incoming: str, restore: bool, grant: bool) -> None:
        self.switching = (evict[0] if evict else None, incoming)
        self._switch_task = asyncio.get_running_loop().create_task(
            self._switch(evict, incoming, restore, grant), name=f"switch-{self._g.id}")

    def _pin_if_moves_may_come(self) -> None:
        """Once a grant of this group may move memory by the last report (`moves_may_come`
        over its jobs), let the switcher prepare for it (`Switcher.pin_ahead`)."""
        g = self._g
        r = g.residency
        pin = getattr(g.switcher, "pin_ahead", None)
        if pin is None or r.snapshot is None:
            return
        if moves_may_come(self._jobs(), r.snapshot, r.peaks, parse_headroom(g.spec.memory_headroom), r.known,
                          r.declared):
            pin(g.spec)

    def _jobs(self) -> list[str]:
        """The group's jobs: resident (the holder among them), checkpointed or waiting."""
        g = self._g
        return sorted({*g.residency.residents, *g.residency.checkpointed, *(w.job_id for w in g.queue)})

    async def snapshot(self) -> MemorySnapshot | None:
        """Fresh memory reports of the group's jobs (None: the agents report no GPU memory).
        Raises AgentsUnanswered when a node agent did not answer: its GPUs' memory is unknown, not
        absent (schedules seed 5112: with the agent killed, an idle group's plan read "no
        memory reports" and restored a job beside one that had ended and still held 60 GB)."""
        g = self._g
        snap = await g.switcher.memory(g.spec, self._jobs())  # type: ignore[attr-defined]
        if snap is None:
            return None
        g.residency.observe(snap)  # without devices too: the holds a failed report missed are unobserved
        self._pin_if_moves_may_come()
        if snap.devices and not snap.unanswered and not self._settles_unsure:
            self._unsure.clear()
        if snap.unanswered:
            raise AgentsUnanswered(f"node agent(s) {', '.join(sorted(snap.unanswered))} did not answer a memory "
                                   "report: no memory is added to their GPUs until they do")
        return snap if snap.devices else None

    async def plan(self, incoming: str, allow_evictions: bool, beside: str | None = None,
                   residents_grow: bool = False) -> Plan:
        """Residents to checkpoint so that `incoming` fits (memory-aware groups), preempted
        holders first. `beside`: a holder that stays, with room to grow to its need (its peak
        or what it declared, `need_of`); `residents_grow`: so does every idle resident (a
        background restore: each may grow at its next grant, which is at once). When their
        checkpoints lack host memory and `incoming` is checkpointed, it is restored first
        where its checkpoint fits beside
        them (H200, 3 jobs of 47 GB checkpoints, a 101 GB pool: two were out, and the third
        ran all its phases alone while they waited, bench/results/
        rl-grpo-b-serve-cooperative-h200.json). Raises NoRoom."""
        g = self._g
        forced = self.must_leave(incoming) if allow_evictions else []
        waited = False
        while True:
            try:
                snap = await self.snapshot()
            except AgentsUnanswered:  # a resident's grant only frees memory: one resident at a time
                if beside is not None or not allow_evictions or incoming in g.residency.checkpointed or \
                        self.unconfirmed(incoming) or self._unsure or g.residency.left_since_report() or \
                        any(g.residency.started_since_report(j) for j in self._jobs()):
                    raise  # (a job started again or left: its ended processes' bytes may linger; an unsure job's may)
                snap = None
            if snap is None:  # no memory information: one resident at a time
                if beside is not None:
                    raise NoRoom(f"no memory reports: {incoming} is not restored beside {beside}")
                return Plan(g.residency.lru(excluding=[incoming]) if allow_evictions else [])
            residents = g.residency.lru(excluding=[incoming, *forced, *([beside] if beside else [])]) \
                if allow_evictions else []
            r = g.residency
            growing = [beside] if beside is not None else r.lru(excluding=[incoming]) if residents_grow else []
            snap = as_planned(snap, forced, growing, r.peaks, r.declared)
            if beside is not None and not (r.known(incoming) and r.known(beside)):
                raise NoRoom(f"{incoming if not r.known(incoming) else beside} has not settled its memory (it "
                             f"declared none and its holds still grow it): {incoming} is not restored beside {beside}")
            try:
                evict, first = place(incoming, residents, snap, r.peaks, r.declared,
                                     parse_headroom(g.spec.memory_headroom), known=r.known(incoming),
                                     checkpointed=incoming in r.checkpointed, first_ok=beside is None and not forced)
            except NoRoom:
                departing = g.switcher.departing(g.spec, g.residency.residents) \
                    if hasattr(g.switcher, "departing") else []
                if not departing or not allow_evictions:
                    raise
                if not waited:  # bounded: a job stops departing after the reconnect grace
                    log.info("no room for %s yet group=%s: waiting for departing %s to free the GPU memory",
                             incoming, g.id, departing)
                    waited = True
                await asyncio.sleep(DEPARTING_POLL_SECONDS)
                continue
            return Plan([*forced, *evict], first)

    async def _switch(self, evict: list[str] | None, incoming: str, restore: bool, grant: bool,
                      beside: str | None = None) -> None:
        """Plan (when `evict` is None), run the switch, record what moved, then grant, count a
        failure or dispatch (`_ended`). `beside`: a staging (`decisions.Stage`) next to this holder."""
        g = self._g
        record: SwitchRecord | None = None
        first = False
        vanished: list[str] = []  # evicted jobs with no process left anywhere: dropped once it ends
        try:
            if evict is None:
                evict, first = await self.plan(incoming, allow_evictions=True, beside=beside)
                self.switching = (evict[0] if evict else None, incoming)
            record = await self._run(evict, incoming, restore, first, beside)
        except NoRoom as err:
            record = self._no_room(incoming, beside, err)
        except SwitchError as err:
            record = self._failed(evict or [], incoming, err)
        except Exception as err:  # a Switcher bug: keep the group serving, say so loudly
            log.exception("switch crashed group=%s evict=%s to=%s", g.id, evict, incoming)
            record = SwitchRecord(None, incoming, ok=False, error=f"internal error: {err!r}")
            g.counters.failed_switches += 1
            g.fail_job(incoming, SwitchFailed(f"group {g.id}: internal error: {err!r}"))
        else:
            vanished = self._moved(evict, record, incoming, restore, grant, beside)
        finally:
            self.switching, self._beside = None, None
            self._switch_task = None
        self._ended(incoming, record, vanished, restore, grant, beside)

    async def _run(self, evict: list[str], incoming: str, restore: bool, first: bool,
                   beside: str | None) -> SwitchRecord | None:
        """The switcher's checkpoints of `evict` and restore of `incoming`; None when nothing
        moves. Raises what the switcher raises (SwitchError, NoRoom)."""
        g = self._g
        if not evict and not restore:
            return None
        log.info("switch start group=%s evict=%s to=%s restore=%s%s%s", g.id, evict, incoming, restore,
                 " (restore first)" if first else "", f" beside={beside}" if beside else "")
        g.record_placement(incoming)  # a restore may finish after a crash here: it may be on the GPUs
        self._evicting = frozenset(evict)
        try:
            if g.state is not None:  # a failed write is logged: the next grant writes again or is refused
                await g.state.written()
            return await g.switcher(g.spec, tuple(evict), incoming, restore,
                                    **({"restore_first": True} if first else {}))
        finally:
            self._evicting = frozenset()

    def _no_room(self, incoming: str, beside: str | None, err: NoRoom) -> SwitchRecord | None:
        g = self._g
        if beside is not None:  # not now: the hand-off plans again, without the holder
            log.info("not staged group=%s job=%s beside %s: %s", g.id, incoming, beside, err)
            self._unstaged = (g.holder.epoch if g.holder else 0, incoming)
            return None
        log.warning("no room group=%s job=%s: %s", g.id, incoming, err)
        g.fail_job(incoming, SwitchFailed(f"group {g.id}: {err}"))
        return SwitchRecord(None, incoming, ok=False, error=str(err))

    def _failed(self, evict: list[str], incoming: str, err: SwitchError) -> SwitchRecord:
        g = self._g
        g.counters.failed_switches += 1
        for job in err.off_gpu:
            g.residency.moved_out(job)
        self._unsure.update(err.off_gpu)  # an agent may still finish the rollback (its undo at a restart)
        if g.spec.backend == names.BACKEND_APP:  # put back by a wake (those it did not reach: a reload more)
            g.awake.woke([j for j in evict if j not in err.off_gpu])
        log.warning("switch failed group=%s evict=%s to=%s: %s", g.id, evict, incoming, err)
        g.fail_job(incoming, SwitchFailed(f"group {g.id}: {err}"))
        return err.record

    def _moved(self, evict: list[str], record: SwitchRecord | None, incoming: str, restore: bool, grant: bool,
               beside: str | None) -> list[str]:
        """Record a switch that succeeded; returns the evicted jobs found gone everywhere."""
        g, r = self._g, self._g.residency
        vanished = []
        for job in evict:
            if record is not None and job in record.gone and not any(w.job_id == job for w in g.queue):
                vanished.append(job)
                continue
            r.moved_out(job)
            self._lapsed.discard(job)
            if job in self._fenced:  # fenced, and checkpointed: restored when idle, then forgotten
                self._fenced.discard(job)
                g.idle.unowned(job)
        if record is not None:
            g.counters.switches += 1
            log.info("switch done group=%s evict=%s to=%s seconds=%.3f bytes_out=%d bytes_in=%d", g.id,
                     evict, incoming, record.seconds, record.bytes_checkpointed, record.bytes_restored)
        if grant:
            r.held(incoming)
        elif g.idle.restored_for_nobody(incoming):  # its processes run on, unowned
            r.forget(incoming)
            if g.spec.backend == names.BACKEND_APP:  # a client of it that asks again is told
                g.awake.woke([incoming])
        elif restore and record is not None:
            r.moved_in(incoming, next_up=beside is not None)
        return vanished

    def _ended(self, incoming: str, record: SwitchRecord | None, vanished: list[str], restore: bool, grant: bool,
               beside: str | None) -> None:
        """After a switch, whatever its outcome: drop the jobs it found gone, keep its record,
        grant, count a failed restore, and dispatch."""
        g = self._g
        if record is not None:
            record.finished_at_unix = time.time()
            g.recent.append(record)
            g.notify("switched" if record.ok else "switch-failed", incoming, record=record)
        if grant and (record is None or record.ok):  # before the drops below, which dispatch (seed 252)
            g.grant(incoming, restored=restore, switch_seconds=record.seconds if record else 0.0)
        for job in vanished:  # nothing of it is anywhere: a one-box job killed with its client took part
            self._lapsed.discard(job)  # in every later hand-off ("nothing to restore"), for good
            self._fenced.discard(job)
            g.drop_job(job, "no process of it is left on its nodes")
        if not grant and beside is None and (record is None or not record.ok):
            g.idle.failed(incoming)
        elif record is not None and record.failed_step == "restore" and not record.unreachable:
            self._count_restore_failure(incoming, record)
        g.preemption.switch_ended()
        g.dispatch()
        if g.idle.now() and (record is None or record.ok):
            g.idle.refresh_memory()

    def _count_restore_failure(self, job: str, record: SwitchRecord) -> None:
        g = self._g
        n = self._restore_failures[job] = self._restore_failures.get(job, 0) + 1
        if n < MAX_RESTORE_FAILURES:
            return
        g.failed_jobs[job] = f"{n} restores in a row failed, the last: {record.error}"
        log.error("job failed group=%s job=%s: %s", g.id, job, g.failed_jobs[job])
        g.fail_job(job, JobFailed(f"group {g.id}: job {job} failed: {g.failed_jobs[job]} (it is not retried: "
                                  "restart the job, which drops it)"))
        g.notify("job-failed", job, record=record)

    async def close(self) -> None:
        if self._deferred is not None:
            self._deferred.cancel()
        for task in (self._report_task, self._watch_task, self._records_task, self._settle_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._switch_task is not None:
            self._switch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._switch_task


def roomy(g: LockGroup, incoming: str) -> bool:
    """The last memory report leaves a resident `incoming` its growth plus twice the
    headroom (the holder that just released may have grown since that report), and its
    growth plus the headroom once the jobs that held since that report are taken to have
    grown to their need (`Residency.worst_case`: that holder may have built its model or
    optimizer state since): grant at once. Otherwise the grant waits for a fresh report
    and a plan (also for a job whose state may be checkpointed: `MemoryMoves.unconfirmed`,
    and for one whose processes started after that report: `Residency.started_since_report`;
    after a resident job left since that report: `Residency.left_since_report`; and after a job
    whose need is not known held since that report: `Residency.unsettled_held_since_report`)."""
    r = g.residency
    fraction, fixed = parse_headroom(g.spec.memory_headroom)
    last = r.snapshot
    if not r.known(incoming) and (r.lru(excluding=[incoming]) or (last is not None and crowded(
            last, held_by_others(incoming, last, devices_of(incoming, last, r.peaks)), (fraction, fixed)))):
        return False  # unsettled: granted alone (none of others' memory: schedules seed 30039), after a plan
    if g.moves.unconfirmed(incoming) or r.started_since_report(incoming) or r.left_since_report() \
            or r.unsettled_held_since_report(excluding=incoming):
        return False
    snap = r.worst_case(excluding=incoming)
    if snap is None or last is None:
        return True
    if lacking_room(incoming, last, r.peaks, (2 * fraction, 2 * fixed), r.declared):
        return False
    return not any(must for _, must in lacking_room(incoming, snap, r.peaks, (fraction, fixed), r.declared).values())
