"""SwitchRunner: a lock group's switch in flight, and what its outcome changes.

Owned by `MemoryMoves` (one per group), which decides what moves (`decisions.decide`); this
runs it through the group's `Switcher`: a switch (planned here when the decision leaves what
leaves to a plan, `memory_plan.plan`), a staging beside the holder, the confirmation that a
resident is on the GPUs before its grant, or room made for a holder that outgrew its
reservation (holder_watch.py). Then it records what moved, grants, counts a failed restore
(a job whose restores keep failing fails) and dispatches again; what the outcome changes is
decided by `switch_outcome.outcome` (pure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.group_model import SwitchError, SwitchRecord
from timeslice.controller.orchestrator.memory_plan import plan
from timeslice.controller.orchestrator.placement import NoRoom
from timeslice.controller.orchestrator.switch_outcome import (
    CheckedOut,
    Counted,
    Dropped,
    Effect,
    FailWaiters,
    Grant,
    Held,
    IdleFailed,
    MovedIn,
    OffGpu,
    OutcomeFacts,
    Recorded,
    RestoredForNobody,
    RestoreFailed,
    SwitchResult,
    Unstaged,
    Unsure,
    Woke,
    outcome,
)
from timeslice.driver.errors import JobFailed, SwitchFailed

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")



class SwitchRunner:
    """The switch in progress of `group` (`switching`: (first evicted job or None, incoming
    job); `beside`: while a staging runs, the job it makes room beside; `evicting`: the jobs
    it moves off the GPUs), its outcome, and the restores failed in a row of each job."""

    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self.switching: tuple[str | None, str] | None = None
        self.beside: str | None = None
        self.evicting: frozenset[str] = frozenset()  # the jobs the switch in flight moves off the GPUs
        self.task: asyncio.Task[None] | None = None
        self._incoming_dropped = False  # the incoming job of the switch in flight was dropped meanwhile
        self._began = 0.0  # when (monotonic seconds) the switch or confirmation in flight began
        self.unstaged: tuple[int, str] | None = None  # (holder's epoch, job) a staging found no room for
        self._restore_failures: dict[str, tuple[int, float]] = {}  # job -> (restores failed in a row, clock() of
        # the first)

    def forget(self, job: str) -> None:
        """`job` was granted or dropped: its failed restores no longer count."""
        self._restore_failures.pop(job, None)

    def dropped(self, job: str) -> None:
        """`job` was dropped: the switch or confirmation in flight for it grants nobody (its waiters
        now are a later incarnation's: `switch_outcome`'s rules)."""
        self.forget(job)
        if self.switching is not None and self.switching[1] == job:
            self._incoming_dropped = True

    def _restarted(self, incoming: str) -> bool:
        """`incoming`'s processes started again (a new one connected, or a report named one) since
        the switch or confirmation in flight began: what it planned on is an earlier incarnation's."""
        at = self._g.residency.started_at(incoming)
        return at is not None and at >= self._began

    def _begin(self, incoming: str, evict: str | None = None, beside: str | None = None) -> None:
        self.switching, self.beside, self._incoming_dropped, self._began = (evict, incoming), beside, False, \
            time.monotonic()

    def start(self, evict: list[str] | None, incoming: str, restore: bool, grant: bool) -> None:
        self._begin(incoming, evict[0] if evict else None)
        self.task = asyncio.get_running_loop().create_task(
            self._switch(evict, incoming, restore, grant), name=f"switch-{self._g.id}")

    def stage(self, job: str, beside: str) -> None:
        """Restore `job` without a grant, with room beside the holder `beside` (`decisions.Stage`)."""
        self._begin(job, beside=beside)
        self.task = asyncio.get_running_loop().create_task(
            self._switch(None, job, restore=True, grant=False, beside=beside), name=f"stage-{self._g.id}")

    def confirm(self, incoming: str) -> None:
        """Grant `incoming` once its node agents confirm it is on the GPUs (`MemoryMoves._grant_on_gpu`)."""
        self._begin(incoming)
        self.task = asyncio.get_running_loop().create_task(self._confirm_then_grant(incoming),
                                                           name=f"confirm-{self._g.id}")

    async def _confirm_then_grant(self, incoming: str) -> None:
        g = self._g
        failure: Exception | None = None
        try:
            on_gpu = await g.switcher.confirm(g.spec, incoming)  # type: ignore[attr-defined]
        except Exception as err:  # an agent that does not answer (or a switcher bug): no grant on a guess
            log.warning("cannot confirm group=%s job=%s is on the GPUs: %s", g.id, incoming, err)
            on_gpu, failure = None, err
        finally:
            self.switching = None
            self.task = None
        if self._incoming_dropped or self._restarted(incoming):  # its waiters are a later incarnation's: they
            # wait, planned afresh
            g.dispatch()
            return
        if failure is not None:
            g.fail_job(incoming, SwitchFailed(f"group {g.id}: cannot confirm that job {incoming} has its state "
                                              f"on the GPUs: {failure}; nothing was granted"))
        elif on_gpu is False:
            log.warning("job %s is checkpointed on its node agents, not resident as this group believed "
                        "group=%s: restoring it before the grant", incoming, g.id)
            g.residency.moved_out(incoming)
        elif on_gpu and g.holder is None:  # (a job granted meanwhile holds: this one waits its turn)
            g.grant(incoming, restored=False, switch_seconds=0.0)
        g.dispatch()

    async def make_room(self, evict: list[str], holder: str) -> None:
        """Checkpoint idle residents `evict` beside the holder (no restore, no grant)."""
        g = self._g
        self.switching = (evict[0], holder)
        self.evicting = frozenset(evict)
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
            self.switching, self.evicting = None, frozenset()
        record.finished_at_unix = time.time()
        g.recent.append(record)
        g.notify("switched" if record.ok else "switch-failed", holder, record=record)
        g.dispatch()

    async def _switch(self, evict: list[str] | None, incoming: str, restore: bool, grant: bool,
                      beside: str | None = None) -> None:
        """Plan (when `evict` is None) and run the switch, then perform what its outcome changes
        (`switch_outcome.outcome`) and dispatch. `beside`: a staging (`decisions.Stage`) next to
        this holder."""
        g = self._g
        try:
            if evict is None:
                evict, first = await plan(g, incoming, allow_evictions=True, beside=beside)
                self.switching = (evict[0] if evict else None, incoming)
            else:
                first = False
            result = SwitchResult("ran", await self._run(evict, incoming, restore, first, beside))
        except NoRoom as err:
            result = SwitchResult("no-room", error=str(err))
        except SwitchError as err:
            result = SwitchResult("failed", err.record, err.off_gpu, str(err))
        except Exception as err:  # a Switcher bug: keep the group serving, say so loudly
            log.exception("switch crashed group=%s evict=%s to=%s", g.id, evict, incoming)
            result = SwitchResult("crashed", error=repr(err))
        finally:
            self.switching, self.beside = None, None
            self.task = None
        facts = OutcomeFacts(g.id, g.spec.backend, tuple(evict or ()), incoming, restore, grant, beside,
                             frozenset(w.job_id for w in g.queue), g.idle.is_orphan(incoming),
                             *self._failures_of(incoming), holder_epoch=g.holder.epoch if g.holder else 0,
                             dropped=self._incoming_dropped, restarted=self._restarted(incoming),
                             kept=incoming in g.residency.residents or incoming in g.residency.checkpointed)
        record, effects = outcome(facts, result)
        self._log(facts, result, record)
        for effect in effects:
            self._perform(effect)
        g.preemption.switch_ended()
        g.dispatch()
        g.moves.watch.switch_ended()  # (a job it restored beside the holder may have to leave again)
        if g.idle.now() and (record is None or record.ok):
            g.idle.refresh_memory()

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
        self.evicting = frozenset(evict)
        try:
            if g.state is not None:  # a failed write is logged: the next grant writes again or is refused
                await g.state.written()
            return await g.switcher(g.spec, tuple(evict), incoming, restore,
                                    **({"restore_first": True} if first else {}))
        finally:
            self.evicting = frozenset()

    def _log(self, f: OutcomeFacts, result: SwitchResult, record: SwitchRecord | None) -> None:
        g = self._g
        if result.kind == "no-room":
            if f.beside is not None:
                log.info("not staged group=%s job=%s beside %s: %s", g.id, f.incoming, f.beside, result.error)
            else:
                log.warning("no room group=%s job=%s: %s", g.id, f.incoming, result.error)
        elif result.kind == "failed":
            log.warning("switch failed group=%s evict=%s to=%s: %s", g.id, list(f.evict), f.incoming, result.error)
        elif result.kind == "ran" and record is not None:
            log.info("switch done group=%s evict=%s to=%s seconds=%.3f bytes_out=%d bytes_in=%d", g.id,
                     list(f.evict), f.incoming, record.seconds, record.bytes_checkpointed, record.bytes_restored)

    def _perform(self, e: Effect) -> None:
        """Perform one effect of a switch's outcome (`switch_outcome`)."""
        g = self._g
        if self._placed(e):
            return
        if isinstance(e, Counted):
            if e.ok:
                g.counters.switches += 1
            else:
                g.counters.failed_switches += 1
        elif isinstance(e, Unsure):  # an agent may still finish the rollback (its undo at a restart)
            g.moves.settling.unsure.update(e.jobs)
        elif isinstance(e, Woke):
            g.awake.woke(list(e.jobs))
        elif isinstance(e, Unstaged):
            self.unstaged = (e.epoch, e.job)
        elif isinstance(e, FailWaiters):
            g.fail_job(e.job, SwitchFailed(e.message))
        elif isinstance(e, Recorded):
            e.record.finished_at_unix = time.time()
            g.recent.append(e.record)
            g.notify("switched" if e.record.ok else "switch-failed", e.job, record=e.record)
        elif isinstance(e, Grant):
            g.grant(e.job, restored=e.restored, switch_seconds=e.switch_seconds)
        elif isinstance(e, Dropped):
            g.moves.left(e.job)  # in every later hand-off ("nothing to restore"), for good
            g.drop_job(e.job, "no process of it is left on its nodes", gone=True)
        elif isinstance(e, IdleFailed):
            g.idle.failed(e.job)
        elif isinstance(e, RestoreFailed):
            self._restore_failed(e)

    def _placed(self, e: Effect) -> bool:
        """Perform `e` when it says where a job's state is now (True), else nothing (False)."""
        g, r = self._g, self._g.residency
        if isinstance(e, CheckedOut):
            r.moved_out(e.job)
            if g.moves.left(e.job):  # fenced, and checkpointed: restored when idle, then forgotten
                g.idle.unowned(e.job)
        elif isinstance(e, OffGpu):
            r.moved_out(e.job)
        elif isinstance(e, Held):
            r.held(e.job)
        elif isinstance(e, RestoredForNobody):
            g.idle.restored_for_nobody(e.job)
            r.forget(e.job)
        elif isinstance(e, MovedIn):
            r.moved_in(e.job, next_up=e.next_up)
        else:
            return False
        return True

    def _failures_of(self, job: str) -> tuple[int, float]:
        """(restores of `job` failed in a row, seconds since the first of them; 0.0: none)."""
        n, first = self._restore_failures.get(job, (0, 0.0))
        return n, self._g.clock() - first if n else 0.0

    def _restore_failed(self, e: RestoreFailed) -> None:
        g = self._g
        n, first = self._restore_failures.get(e.job, (0, g.clock()))
        self._restore_failures[e.job] = (n := n + 1, first)
        if not e.fails:
            return
        g.failed_jobs[e.job] = (f"{n} restores in a row failed over {g.clock() - first:.1f} s, the last: "
                                f"{e.record.error}")
        log.error("job failed group=%s job=%s: %s", g.id, e.job, g.failed_jobs[e.job])
        g.fail_job(e.job, JobFailed(f"group {g.id}: job {e.job} failed: {g.failed_jobs[e.job]} (it is not "
                                    "retried: restart the job, which drops it)"))
        g.notify("job-failed", e.job, record=e.record)
