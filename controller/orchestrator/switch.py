"""SwitchCoordinator: the switch transaction over every node agent of a group.

Owned by the orchestrator; called by `LockGroup` when a waiter that is not resident
is to be granted. Steps (DESIGN.md): checkpoint each job to evict on all its nodes (in
parallel over nodes, one job after the other), then restore the incoming job on all
nodes, then the group grants; or, when the plan says so (`restore_first`: the
checkpoints need the host memory the restore gives back), the restore first. Rollback:
a failed checkpoint restores that job where it was checkpointed and the jobs evicted
before it (then, after a restore first, checkpoints the incoming job again); a failed
restore checkpoints the incoming job where it was restored and restores the evicted jobs. The outcome is raised
as `SwitchError` with the record. Groups on the `cooperative` backend are moved by the
jobs' own processes (`CooperativeJobs`); their agents only report memory (`memory`).

Each step runs on every target of its job through `SwitchSteps` (switch_steps.py: operation
ids, resends of a step whose reply was lost); the memory reports, and the waits for memory
to be freed or to have room, are `MemoryReports` (memory_reports.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from timeslice.controller.orchestrator import memory_reports
from timeslice.controller.orchestrator.agent_pool import AgentPool
from timeslice.controller.orchestrator.agents import AgentClient
from timeslice.controller.orchestrator.config import MEMORY_BACKENDS, GroupSpec
from timeslice.controller.orchestrator.cooperative import CooperativeJobs
from timeslice.controller.orchestrator.group_model import SwitchError, SwitchRecord
from timeslice.controller.orchestrator.memory_reports import MemoryReports
from timeslice.controller.orchestrator.memory_snapshot import MemorySnapshot
from timeslice.controller.orchestrator.switch_steps import SwitchSteps, may_have_run
from timeslice.driver import names
from timeslice.driver.errors import NotFound, OutcomeUnknown, TimeSliceServerError, Unavailable

log = logging.getLogger("timeslice.switch")

# Bytes per second a switch moves (out and in together) before a group has measured its
# own: the driver's checkpoint on the H200 moves 1.5 GB/s out and 4 GB/s in
# (reference/checkpoint-h200.md); `vmm` moved 31 GB out and 31 GB in in 1.55 s on an H100 host
# (bench/results/vmm-switch-30gb-*-h100.json). Other backends: no estimate until measured.
PRIOR_BYTES_PER_SECOND = {names.BACKEND_CUDA: 2.2e9, names.BACKEND_CUDA_CHECKPOINT: 2.2e9, names.BACKEND_VMM: 40e9}


class Rollback(NamedTuple):
    """The evicted jobs a rollback left off the GPUs: `failed`, their restore did not succeed
    (where they are may be unknown); `waiting`, no room for them yet: intact in their
    checkpoints, each restored, planned, when it next asks."""

    failed: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()

    @property
    def off_gpu(self) -> list[str]:
        return [*self.failed, *self.waiting]

    def outcome(self, undone: bool) -> str:
        """How a switch error ends (`undone`: the failed step's own compensation succeeded)."""
        if not undone or self.failed:
            return "ROLLBACK INCOMPLETE"
        if self.waiting:
            return (f"rolled back; {', '.join(self.waiting)} left checkpointed until there is room (restored when "
                    "next asked for)")
        return "rolled back"


class SwitchCoordinator:
    """`pool`: the node-agent clients; `cooperative`: the processes of `cooperative` groups,
    which move their own state (their agents only report memory)."""

    def __init__(self, pool: AgentPool, cooperative: CooperativeJobs | None = None) -> None:
        self._pool = pool
        self.cooperative = cooperative or CooperativeJobs()
        self._steps = SwitchSteps(pool, self.cooperative)
        self._reports = MemoryReports(pool, self.cooperative)

    @staticmethod
    def prior_speed(spec: GroupSpec) -> float | None:
        """Bytes per second `spec`'s switches are expected to move before the group has
        measured one (`PRIOR_BYTES_PER_SECOND`); None: no estimate."""
        return PRIOR_BYTES_PER_SECOND.get(spec.backend)

    async def __call__(self, spec: GroupSpec, evict: Sequence[str], incoming: str,
                       restore: bool, restore_first: bool = False) -> SwitchRecord:
        """`restore_first` (with `restore`): restore `incoming` before the checkpoints, whose
        host memory its restore gives back (the plan checked that it fits beside them; nobody
        computes during a switch). A failed checkpoint then also checkpoints `incoming` again."""
        rec = SwitchRecord(evict[0] if evict else None, incoming, evicted=tuple(evict))
        if restore and spec.backend == names.BACKEND_COOPERATIVE:
            try:  # before anyone is evicted for it
                self.cooperative.check_restore(spec.id, incoming)
            except TimeSliceServerError as err:
                rec.ok, rec.error = False, f"restore of {incoming} cannot start: {err}; nothing moved"
                raise SwitchError(rec.error, rec) from err
        first = restore and restore_first
        if first:
            await self._restore_incoming(spec, rec, incoming, [])
        t0 = time.monotonic()
        before = await self.memory(spec, evict, for_plan=False) \
            if evict and spec.backend == names.BACKEND_COOPERATIVE else None
        out: list[str] = []
        gone: list[str] = []  # no process to command: what they hold leaves when their processes exit
        left: dict[str, int] = {}  # of `out`: a process left with its state (it leaves as it exits) -> bytes moved
        for job in evict:  # one job at a time: each is offered every free range of the pinned pool
            done, failures = await self._steps.on_all(self._steps.targets(spec, job), "checkpoint", spec, job)
            # A node where the job has no live process has nothing to move; with none anywhere it is gone.
            if (not done and failures and all(isinstance(e, NotFound) for e in failures.values())) or \
                    (done and not failures and all(r.processes == 0 for r in done.values())):
                gone.append(job)
            failures = {a: e for a, e in failures.items() if not isinstance(e, NotFound)}
            rec.checkpointed_by_job[job] = sum(r.bytes for r in done.values())
            rec.bytes_checkpointed += rec.checkpointed_by_job[job]
            if failures:
                rec.checkpoint_seconds = time.monotonic() - t0
                back = await self._steps.undo(self._steps.current([*done, *may_have_run(failures)]), "restore",
                                              spec, job)
                rollback = await self._restore_all(spec, out)
                undone = await self._unrestore(spec, incoming, first)
                raise self._failed(rec, "checkpoint", f"checkpoint of {job} failed", failures, back and undone,
                                   rollback, [] if back else [job])
            out.append(job)
            if any(r.departed for r in done.values()):
                left[job] = sum(r.bytes for r in done.values())
        held = sum(sum(before.on_device(j).values()) for j in gone) if before is not None else 0
        # a job gone whose exiting processes NVML did not show as its own (schedules seed 3299): the
        # restore waits until the GPU has room for what the incoming job registered
        room = self.cooperative.registered_bytes(spec.id, incoming) if restore and not first and \
            before is not None and any(not before.on_device(j) for j in gone) else 0
        # a job gone is checked too when the report showed it holding nothing: that report may have failed
        # (schedules seed 6004: the agent down, a resident not yet reconnected after an orchestrator restart
        # counted as gone, and a newcomer granted beside its 46 MB)
        # a process that left with its state on the GPU, before or during its checkpoint (cooperative schedules
        # seeds 30053 and 30078: killed as it was to be checkpointed; the job's next process, with nothing yet,
        # was checkpointed in its place, and the restore beside the ended one's 75 MB ran out of memory): all
        # that the job held must leave first
        held += sum(max(0, sum(before.on_device(j).values()) - moved) for j, moved in left.items()) \
            if before is not None else 0
        unfreed = await self._reports.freed(spec, out, before, rec.bytes_checkpointed + held, room,
                                            by_device=bool(left), exited=bool(gone)) \
            if before is not None and (rec.bytes_checkpointed or held or room or gone) else None
        if gone and not first and before is None and spec.backend in MEMORY_BACKENDS:
            # A transparent checkpoint frees what it moved before it answers; a job gone frees what it held
            # only as its processes end (1.4-9.6 s after their last line on the H200), and its PIDs may
            # leave /proc first: the switch waits until no ended process holds memory on the group's GPUs
            # (schedules seed 8, `cuda`: the incoming job, resident, grew beside a killed one's 63 MB) and a
            # restore until the GPU has room for the incoming job's checkpoint
            now = await self.memory(spec, [incoming], for_plan=False)
            unfreed = await self._reports.freed(spec, [], now, 0, sum(now.checkpointed_bytes.get(incoming, {}).values())
                                                if restore else 0, exited=True)
        if unfreed:
            rec.checkpoint_seconds = time.monotonic() - t0
            rollback = await self._restore_all(spec, out)
            back = await self._unrestore(spec, incoming, first)
            rec.ok, rec.failed_step = False, "checkpoint"
            rec.error = (f"checkpoint of {', '.join(out or gone)} acknowledged ({rec.bytes_checkpointed} bytes"
                         + (f"; {', '.join(gone)} had no process to command, holding {held} bytes" if gone else "")
                         + f") but {unfreed}; " + rollback.outcome(back))
            raise SwitchError(rec.error, rec, rollback.off_gpu)
        rec.checkpoint_seconds = time.monotonic() - t0
        rec.gone = tuple(gone)
        if restore and not first:
            await self._restore_incoming(spec, rec, incoming, out)
        return rec

    async def _restore_incoming(self, spec: GroupSpec, rec: SwitchRecord, incoming: str, out: list[str]) -> None:
        """The restore step of `incoming`; a failure checkpoints it again where it was
        restored, restores the evicted jobs `out`, and raises SwitchError."""
        t0 = time.monotonic()
        done, failures = await self._steps.on_all(self._steps.targets(spec, incoming), "restore", spec, incoming)
        rec.restore_seconds = time.monotonic() - t0
        rec.bytes_restored = sum(r.bytes for r in done.values())
        if failures:
            undone = await self._steps.undo(self._steps.current([*done, *may_have_run(failures)]), "checkpoint",
                                            spec, incoming)
            err = self._failed(rec, "restore", f"restore of {incoming} failed", failures, undone,
                               await self._restore_all(spec, out))
            if rec.unreachable and spec.backend != names.BACKEND_COOPERATIVE and \
                    not (await self.memory(spec, [], for_plan=False)).unanswered:
                rec.unreachable = False  # its agents answer, the step did not: it hangs, and counts (issue 22)
            raise err

    async def _unrestore(self, spec: GroupSpec, incoming: str, restored: bool) -> bool:
        """Roll back a restore-first (`restored`): checkpoint `incoming` again, once the
        evicted jobs are back (their host memory free again). True when nothing is left to
        roll back."""
        return not restored or await self._steps.undo(self._steps.targets(spec, incoming), "checkpoint", spec, incoming)

    async def confirm(self, spec: GroupSpec, job: str) -> bool:
        """Whether `job`'s state is on the GPUs by its node agents' records (written ahead of
        every step: the one source of truth): True when none of its agents holds a checkpoint
        record of it, False when one does. Groups without agents, or on `cooperative` (whose
        checkpoints the orchestrator itself tracks), are confirmed at once. Raises the first
        agent's error (`TimeSliceServerError` subclass) when one does not answer."""
        if spec.backend in (names.BACKEND_NONE, names.BACKEND_COOPERATIVE) or not spec.agents:
            return True
        agents = [a for a in self._steps.targets(spec, job) if isinstance(a, AgentClient)]
        found = await asyncio.gather(*(a.checkpointed_jobs(records_of(spec)) for a in agents))
        return not any(job in jobs for jobs in found)

    async def checkpointed(self, spec: GroupSpec, targets: Iterable[str]) -> set[str]:
        """The group's jobs that the node agents at `targets` hold checkpoint records of. Raises
        the first agent's error (`TimeSliceServerError` subclass) when one does not answer."""
        found = await asyncio.gather(*(self._pool.get(t).checkpointed_jobs(records_of(spec)) for t in targets))
        return own_records(spec, set().union(*found))

    async def memory(self, spec: GroupSpec, jobs: Sequence[str], watch: float = 0.0,
                     low_free: int = 0, *, for_plan: bool = True) -> MemorySnapshot:
        """One snapshot of the group's memory from all its node agents (`MemoryReports.memory`)."""
        return await self._reports.memory(spec, jobs, watch, low_free, for_plan=for_plan)

    def departing(self, spec: GroupSpec, jobs: Iterable[str]) -> list[str]:
        """Those of `jobs` whose processes just closed their cooperative command streams with
        their state on the GPU (exiting or reconnecting: their memory cannot move now, and may
        be freed in a moment), or have not reconnected since a restart (`unconfirmed`)."""
        if spec.backend != names.BACKEND_COOPERATIVE:
            return []
        return [j for j in jobs if self.cooperative.departing(spec.id, j)]

    def unconfirmed(self, spec: GroupSpec, job: str) -> bool:
        """Whether a process of `job` that the state file records checkpointing has not
        reconnected since this orchestrator started (`cooperative` groups; False on the
        others): whether its state is on the GPUs or checkpointed is not known yet
        (`CooperativeJobs.unconfirmed`)."""
        return spec.backend == names.BACKEND_COOPERATIVE and self.cooperative.unconfirmed(spec.id, job)

    def pin_ahead(self, spec: GroupSpec) -> None:
        """A grant in `spec`'s group may move memory (`residency.moves_may_come`): its
        cooperative processes register the pinned pool ahead of need from now on
        (`CooperativeJobs.pin_ahead`); nothing on the other backends."""
        if spec.backend == names.BACKEND_COOPERATIVE:
            self.cooperative.pin_ahead(spec.id)

    def streaming(self, spec: GroupSpec, job: str) -> bool:
        """Whether a process of `job` keeps its cooperative memory command stream open
        (`cooperative` groups; False on the others): it is alive and reachable, so as a
        holder whose keep-alives are late it is still computing (`Leases`)."""
        return spec.backend == names.BACKEND_COOPERATIVE and self.cooperative.connected(spec.id, job)

    async def _restore_all(self, spec: GroupSpec, jobs: Sequence[str]) -> Rollback:
        """Roll back evictions: restore each of `jobs` once each device has room for their
        checkpoints there (`MemoryReports.room_for`); returns those that stay off the GPUs (all of them, waiting,
        when the room does not come: each is restored later, planned, when it asks). What failed may hold
        memory a while: the incoming job's process killed mid-restore keeps what it restored until it
        has exited (schedules seed 30053: the evicted job's rollback restore ran out of memory beside
        its 76 MB); a checkpoint acknowledged whose memory was not seen freed may have moved nothing
        that was on the GPU (cooperative seed 70281: after an orchestrator restart, jobs adopted as
        resident whose states were in the pool; their rollback restored them beside a 68 MB holder)."""
        if not jobs:
            return Rollback()
        if spec.backend in MEMORY_BACKENDS:
            short = await self._reports.room_for(spec, jobs)
            if short:
                log.warning("rollback left group=%s jobs=%s checkpointed: no room to restore them within %.0f s: "
                            "%s", spec.id, list(jobs), memory_reports.FREED_TIMEOUT_SECONDS, short)
                return Rollback(waiting=tuple(jobs))
        return Rollback(failed=tuple([job for job in jobs
                                      if not await self._steps.undo(self._steps.targets(spec, job), "restore",
                                                                    spec, job)]))

    @staticmethod
    def _failed(rec: SwitchRecord, step: str, what: str, failures: dict[Any, BaseException], undone: bool,
                rollback: Rollback, off_gpu: Sequence[str] = ()) -> SwitchError:
        """The SwitchError of a failed `step` (`undone`: its own compensating steps succeeded;
        `rollback`: the evicted jobs' restores; `off_gpu`: other jobs left off the GPUs)."""
        causes = "; ".join(f"{a.target}: {err}" for a, err in failures.items())
        rec.ok, rec.failed_step = False, step
        rec.unreachable = all(isinstance(err, Unavailable) or (isinstance(err, OutcomeUnknown) and err.no_reply)
                              for err in failures.values())
        rec.error = f"{what} ({causes}); " + rollback.outcome(undone)
        return SwitchError(rec.error, rec, [*rollback.off_gpu, *off_gpu])


def records_of(spec: GroupSpec) -> str | None:
    """Whose checkpoint records a node agent lists for `spec`: standalone groups share agents
    by group name; cluster groups re-form under new ids, so there every record (None), which
    `own_records` then filters."""
    return None if spec.members else spec.id


def own_records(spec: GroupSpec, jobs: set[str]) -> set[str]:
    """Of the jobs node agents listed for `spec` (`records_of`), those that are its own."""
    return jobs & {m.claim_set for m in spec.members} if spec.members else jobs
