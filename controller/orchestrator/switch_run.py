"""SwitchRunner: a lock group's switch in flight, and what its outcome changes.

Owned by `MemoryMoves` (one per group), which decides what moves (`decisions.decide`); this
runs it through the group's `Switcher`: a switch (planned here when the decision leaves what
leaves to a plan, `memory_plan.plan`), a staging beside the holder, the confirmation that a
resident is on the GPUs before its grant, or room made for a holder that outgrew its
reservation (holder_watch.py). Then it records what moved, grants, counts a failed restore
(a job whose restores keep failing fails: `MAX_RESTORE_FAILURES`) and dispatches again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.group_model import SwitchError, SwitchRecord
from timeslice.controller.orchestrator.memory_plan import plan
from timeslice.controller.orchestrator.placement import NoRoom
from timeslice.driver import names
from timeslice.driver.errors import JobFailed, SwitchFailed

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

# A job whose restore fails this many times in a row fails (`JobFailed`): its acquires are
# refused with the last cause until it is dropped (its pods restarted), and the group serves
# the others instead of repeating checkpoint(other) -> restore -> rollback at every acquire.
# Only a restore step that ran and failed counts: not a plan without room, nor a checkpoint
# of another job, nor agents that did not answer (none of them is the job's own fault).
MAX_RESTORE_FAILURES = 3


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
        self.unstaged: tuple[int, str] | None = None  # (holder's epoch, job) a staging found no room for
        self._restore_failures: dict[str, int] = {}  # job -> restores failed in a row

    def forget(self, job: str) -> None:
        """`job` was granted or dropped: its failed restores no longer count."""
        self._restore_failures.pop(job, None)

    def start(self, evict: list[str] | None, incoming: str, restore: bool, grant: bool) -> None:
        self.switching = (evict[0] if evict else None, incoming)
        self.task = asyncio.get_running_loop().create_task(
            self._switch(evict, incoming, restore, grant), name=f"switch-{self._g.id}")

    def stage(self, job: str, beside: str) -> None:
        """Restore `job` without a grant, with room beside the holder `beside` (`decisions.Stage`)."""
        self.switching, self.beside = (None, job), beside
        self.task = asyncio.get_running_loop().create_task(
            self._switch(None, job, restore=True, grant=False, beside=beside), name=f"stage-{self._g.id}")

    def confirm(self, incoming: str) -> None:
        """Grant `incoming` once its node agents confirm it is on the GPUs (`MemoryMoves._grant_on_gpu`)."""
        self.switching = (None, incoming)
        self.task = asyncio.get_running_loop().create_task(self._confirm_then_grant(incoming),
                                                           name=f"confirm-{self._g.id}")

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
            self.task = None
        if on_gpu is False:
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
        """Plan (when `evict` is None), run the switch, record what moved, then grant, count a
        failure or dispatch (`_ended`). `beside`: a staging (`decisions.Stage`) next to this holder."""
        g = self._g
        record: SwitchRecord | None = None
        first = False
        vanished: list[str] = []  # evicted jobs with no process left anywhere: dropped once it ends
        try:
            if evict is None:
                evict, first = await plan(g, incoming, allow_evictions=True, beside=beside)
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
            self.switching, self.beside = None, None
            self.task = None
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
        self.evicting = frozenset(evict)
        try:
            if g.state is not None:  # a failed write is logged: the next grant writes again or is refused
                await g.state.written()
            return await g.switcher(g.spec, tuple(evict), incoming, restore,
                                    **({"restore_first": True} if first else {}))
        finally:
            self.evicting = frozenset()

    def _no_room(self, incoming: str, beside: str | None, err: NoRoom) -> SwitchRecord | None:
        g = self._g
        if beside is not None:  # not now: the hand-off plans again, without the holder
            log.info("not staged group=%s job=%s beside %s: %s", g.id, incoming, beside, err)
            self.unstaged = (g.holder.epoch if g.holder else 0, incoming)
            return None
        log.warning("no room group=%s job=%s: %s", g.id, incoming, err)
        g.fail_job(incoming, SwitchFailed(f"group {g.id}: {err}"))
        return SwitchRecord(None, incoming, ok=False, error=str(err))

    def _failed(self, evict: list[str], incoming: str, err: SwitchError) -> SwitchRecord:
        g = self._g
        g.counters.failed_switches += 1
        for job in err.off_gpu:
            g.residency.moved_out(job)
        g.moves.settling.unsure.update(err.off_gpu)  # an agent may still finish the rollback (its undo at a restart)
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
            if g.moves.left(job):  # fenced, and checkpointed: restored when idle, then forgotten
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
            g.moves.left(job)  # in every later hand-off ("nothing to restore"), for good
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
