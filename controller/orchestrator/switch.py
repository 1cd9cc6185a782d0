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

Every agent step has an operation id. A step whose reply was lost (deadline, connection
cut, agent restarting) is resent with the same id, so the agent runs it once: a resend
that succeeds completes the step (the switch goes on). Resends go on, with a short
backoff, for the step's timeout after the first lost reply and at most
`RESEND_WINDOW_SECONDS`; a step they do not complete is undone like one that may have
run, never assumed done or not done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from timeslice.controller.orchestrator.agents import AgentClient, AgentPool, StepResult, new_operation_id
from timeslice.controller.orchestrator.config import MEMORY_BACKENDS, GroupSpec
from timeslice.controller.orchestrator.cooperative import CooperativeJobs
from timeslice.controller.orchestrator.group_model import SwitchError, SwitchRecord
from timeslice.controller.orchestrator.placement import DeviceMemory, MemorySnapshot, agent_of
from timeslice.driver import names
from timeslice.driver.errors import NotFound, OutcomeUnknown, TimeSliceServerError, Unavailable

log = logging.getLogger("timeslice.switch")

# Resends of a step whose reply was lost stop after the step's timeout or this long, which
# comes first (seconds): room for a node agent to restart, without holding a group whose
# node is down for the default 300 s step timeout.
RESEND_WINDOW_SECONDS = 30.0
# Backoff between resends: the first wait, doubled after each resend, and its cap (seconds).
RESEND_BACKOFF_SECONDS = 0.1
RESEND_BACKOFF_MAX_SECONDS = 1.0
# A cooperative checkpoint counts once NVML shows this fraction of its acknowledged bytes
# freed (the rest: allocator rounding), and a job evicted with no process to command (it
# ended after the plan) once this fraction of what it held is, checked every
# FREED_POLL_SECONDS for at most FREED_TIMEOUT_SECONDS; otherwise the switch rolls back
# (nothing is placed on memory that is not free).
FREED_FRACTION = 0.9
FREED_POLL_SECONDS = 0.05
FREED_TIMEOUT_SECONDS = 10.0
# Bytes per second a switch moves (out and in together) before a group has measured its
# own: the driver's checkpoint on the H200 moves 1.5 GB/s out and 4 GB/s in
# (reference/checkpoint-h200.md). Other backends: no estimate until measured.
PRIOR_BYTES_PER_SECOND = {names.BACKEND_CUDA: 2.2e9, names.BACKEND_CUDA_CHECKPOINT: 2.2e9}


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
            done, failures = await self._on_all(self._targets(spec, job), "checkpoint", spec, job)
            # A node where the job has no live process has nothing to move; with none anywhere it is gone.
            if (not done and failures and all(isinstance(e, NotFound) for e in failures.values())) or \
                    (done and not failures and all(r.processes == 0 for r in done.values())):
                gone.append(job)
            failures = {a: e for a, e in failures.items() if not isinstance(e, NotFound)}
            rec.checkpointed_by_job[job] = sum(r.bytes for r in done.values())
            rec.bytes_checkpointed += rec.checkpointed_by_job[job]
            if failures:
                rec.checkpoint_seconds = time.monotonic() - t0
                back = await self._undo(self._current([*done, *_unknown(failures)]), "restore", spec, job)
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
        unfreed = await self._freed(spec, out, before, rec.bytes_checkpointed + held, room, by_device=bool(left)) \
            if before is not None and (rec.bytes_checkpointed or held or room or gone) else None
        if gone and restore and not first and before is None and spec.backend in MEMORY_BACKENDS:
            # A transparent checkpoint frees what it moved before it answers; a job gone frees what it held
            # only as its processes end (1.4-9.6 s after their last line on the H200), and its PIDs may
            # leave /proc first: the restore waits until the GPU has room for the incoming job's checkpoint
            now = await self.memory(spec, [incoming], for_plan=False)
            unfreed = await self._freed(spec, [], now, 0, sum(now.checkpointed_bytes.get(incoming, {}).values()))
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
        done, failures = await self._on_all(self._targets(spec, incoming), "restore", spec, incoming)
        rec.restore_seconds = time.monotonic() - t0
        rec.bytes_restored = sum(r.bytes for r in done.values())
        if failures:
            undone = await self._undo(self._current([*done, *_unknown(failures)]), "checkpoint", spec, incoming)
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
        return not restored or await self._undo(self._targets(spec, incoming), "checkpoint", spec, incoming)

    async def confirm(self, spec: GroupSpec, job: str) -> bool:
        """Whether `job`'s state is on the GPUs by its node agents' records (written ahead of
        every step: the one source of truth): True when none of its agents holds a checkpoint
        record of it, False when one does. Groups without agents, or on `cooperative` (whose
        checkpoints the orchestrator itself tracks), are confirmed at once. Raises the first
        agent's error (`TimeSliceServerError` subclass) when one does not answer."""
        if spec.backend in (names.BACKEND_NONE, names.BACKEND_COOPERATIVE) or not spec.agents:
            return True
        agents = [a for a in self._targets(spec, job) if isinstance(a, AgentClient)]
        found = await asyncio.gather(*(a.checkpointed_jobs(records_of(spec)) for a in agents))
        return not any(job in jobs for jobs in found)

    async def checkpointed(self, spec: GroupSpec, targets: Iterable[str]) -> set[str]:
        """The group's jobs that the node agents at `targets` hold checkpoint records of. Raises
        the first agent's error (`TimeSliceServerError` subclass) when one does not answer."""
        found = await asyncio.gather(*(self._pool.get(t).checkpointed_jobs(records_of(spec)) for t in targets))
        return own_records(spec, set().union(*found))

    async def memory(self, spec: GroupSpec, jobs: Sequence[str], watch: float = 0.0,
                     low_free: int = 0, *, for_plan: bool = True) -> MemorySnapshot:
        """One snapshot of the group's memory from all its node agents (in parallel). An
        agent that does not answer is left out (logged, and named in `unanswered`); its
        devices are then unknown.
        `watch` > 0 seconds: each agent samples its GPUs for that long or until one has less
        than `low_free` bytes free (`AgentClient.memory`), and the snapshot carries each
        job's peak over the samples. `for_plan` (and no watch): on `cooperative`, the
        processes are asked for their registered bytes first (`CooperativeJobs.refresh`);
        a switch checking NVML within its own steps passes False."""
        targets = list(spec.agents)
        asked = time.monotonic()  # (what is counted is as of the asking: a process that starts meanwhile is not)
        reports = await asyncio.gather(*(self._pool.get(t).memory([(j, spec.member(j)) for j in jobs], watch, low_free)
                                         for t in targets), return_exceptions=True)
        snap = MemorySnapshot(taken_at=asked)
        for target, rep in zip(targets, reports):
            if isinstance(rep, BaseException):
                log.warning("memory report failed group=%s agent=%s: %s", spec.id, target, rep)
                snap.unanswered.add(target)
                continue
            for uuid, (total, free) in rep.gpus.items():
                snap.devices[f"{target}/{uuid}"] = DeviceMemory(total, free)
            snap.exiting_bytes.update({f"{target}/{u}": n for u, n in rep.exiting.items()})
            snap.busy |= rep.busy
            for job, per in rep.device_bytes.items():
                snap.device_bytes.setdefault(job, {}).update({f"{target}/{u}": b for u, b in per.items()})
            for job, per in rep.checkpointed_bytes.items():
                snap.checkpointed_bytes.setdefault(job, {}).update({f"{target}/{u}": b for u, b in per.items()})
            for job, per in rep.peak_bytes.items():
                snap.peak_bytes.setdefault(job, {}).update({f"{target}/{u}": b for u, b in per.items()})
            for job, procs in rep.processes.items():
                snap.processes.setdefault(job, set()).update(f"{target}/{n}" for n in procs)
            snap.host_available[target] = rep.host_available
            if rep.incarnation:
                snap.incarnations[target] = rep.incarnation
        if spec.backend == names.BACKEND_COOPERATIVE:
            if for_plan and not watch:
                await self.cooperative.refresh(spec.id, jobs)  # sizes as the processes see them now
            self.cooperative.reap()  # what the processes gone for good registered counts for nobody
            if len(snap.devices) == 1:
                self._cooperative_bytes(spec, jobs, snap)
        return snap

    def _cooperative_bytes(self, spec: GroupSpec, jobs: Sequence[str], snap: MemorySnapshot) -> None:
        """Complete `snap` of a one-GPU cooperative group from what the processes registered:
        the pool's free bytes as host memory, checkpoint sizes, what can leave the GPU."""
        (dev,) = snap.devices
        pool = self.cooperative.pool
        if pool is not None:  # a checkpoint lands wholly in the pool's free ranges, else in host memory
            snap.pool_free[agent_of(dev)] = pool.size - pool.used_bytes
        for job in jobs:  # what the job's processes registered is what they hold when restored
            n = self.cooperative.registered_bytes(spec.id, job)
            if self.cooperative.checkpointed(spec.id, job):
                if n:
                    snap.checkpointed_bytes.setdefault(job, {}).setdefault(dev, n)
            elif not self.cooperative.connected(spec.id, job):
                snap.movable_bytes[job] = {dev: 0}  # no stream to command: what it holds cannot leave
            else:
                snap.movable_bytes[job] = {dev: n}  # only what it registered leaves the GPU
                if n and not snap.device_bytes.get(job):  # NVML does not see it (another PID namespace)
                    snap.device_bytes[job] = {dev: n}
                    snap.unseen.add(job)

    async def _freed(self, spec: GroupSpec, jobs: Sequence[str], before: MemorySnapshot, nbytes: int,
                     room: int = 0, by_device: bool = False) -> str | None:
        """None once NVML shows `nbytes` freed by `jobs` since `before`: what their acknowledged
        checkpoints moved (a cooperative process answers once it dropped its tensors; the
        CUDA caching allocator or a late stream may still hold them), plus all that those
        with no process to command held (they are exiting: a job that ended between the
        plan and its checkpoint frees its memory only when its processes are gone). Per job
        by its processes' bytes where NVML sees them, else by the devices' free bytes (also
        once a job's processes are no longer told as its own: their PIDs leave /proc before
        the driver has freed their memory).
        With `room`, also until the GPUs have that many bytes free; `by_device`: by the devices'
        free bytes only (a job's processes changed meanwhile). Polled every
        `FREED_POLL_SECONDS` for at most `FREED_TIMEOUT_SECONDS`; else why not (a node agent
        that does not answer shows nothing freed: schedules seed 5112, the agent killed as a
        job ended, a restore ran beside the ended job's 82 MB and ran out of memory)."""
        if before.unanswered:
            agents = ", ".join(sorted(before.unanswered))
            return f"node agent(s) {agents} did not answer: the GPU memory freed is unknown"
        if not before.devices:
            return None  # no GPU report (no NVML): nothing to check against
        seen = list(jobs) if not by_device and all(sum(before.on_device(j).values()) and j not in before.unseen
                                                   for j in jobs) else []
        want = int(FREED_FRACTION * nbytes)
        free0 = sum(d.free for d in before.devices.values())
        deadline = time.monotonic() + FREED_TIMEOUT_SECONDS
        dropped = 0
        while True:
            now = await self.memory(spec, jobs, for_plan=False)  # NVML only, every FREED_POLL_SECONDS
            if not now.unanswered:
                freed = sum(d.free for d in now.devices.values()) - free0
                if seen:
                    dropped = sum(sum(before.on_device(j).values()) - sum(now.on_device(j).values()) for j in seen)
                    if any(not now.on_device(j) for j in seen):
                        # none of a job's processes is told as its own now: ended, or only its PIDs gone from
                        # /proc while the driver still frees their memory (schedules seed 36: a restored job grew
                        # into the 78 MB of one that had just ended): the devices' free bytes must show it
                        dropped = min(dropped, freed)
                else:
                    dropped = freed
                enough = not nbytes or dropped >= want  # (nothing to see freed: only the room counts)
                if not now.devices or (enough and sum(d.free for d in now.devices.values()) >= room):
                    return None
            if time.monotonic() >= deadline:
                log.error("checkpoint acknowledged but not freed group=%s jobs=%s: %d of %d bytes freed%s", spec.id,
                          list(jobs), dropped, nbytes, " (a node agent did not answer)" if now.unanswered else "")
                return (f"the GPU memory was not freed within {FREED_TIMEOUT_SECONDS:.0f} s (NVML"
                        + ("; a node agent did not answer" if now.unanswered else "") + ")")
            await asyncio.sleep(FREED_POLL_SECONDS)

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
        checkpoints there (`_room_for`); returns those that stay off the GPUs (all of them, waiting,
        when the room does not come: each is restored later, planned, when it asks). What failed may hold
        memory a while: the incoming job's process killed mid-restore keeps what it restored until it
        has exited (schedules seed 30053: the evicted job's rollback restore ran out of memory beside
        its 76 MB); a checkpoint acknowledged whose memory was not seen freed may have moved nothing
        that was on the GPU (cooperative seed 70281: after an orchestrator restart, jobs adopted as
        resident whose states were in the pool; their rollback restored them beside a 68 MB holder)."""
        if not jobs:
            return Rollback()
        if spec.backend in MEMORY_BACKENDS:
            short = await self._room_for(spec, jobs)
            if short:
                log.warning("rollback left group=%s jobs=%s checkpointed: no room to restore them within %.0f s: "
                            "%s", spec.id, list(jobs), FREED_TIMEOUT_SECONDS, short)
                return Rollback(waiting=tuple(jobs))
        return Rollback(failed=tuple([job for job in jobs
                                      if not await self._undo(self._targets(spec, job), "restore", spec, job)]))

    async def _room_for(self, spec: GroupSpec, jobs: Sequence[str]) -> dict[str, int]:
        """{} once every device where `jobs` have checkpoints has that many bytes free (polled every
        `FREED_POLL_SECONDS` for at most `FREED_TIMEOUT_SECONDS`), else the bytes each device lacks.
        A report that a node agent did not answer cannot tell: {} (the restore itself then says)."""
        deadline = time.monotonic() + FREED_TIMEOUT_SECONDS
        while True:
            now = await self.memory(spec, jobs, for_plan=False)
            if now.unanswered:
                return {}
            need: dict[str, int] = {}
            for job in jobs:
                for dev, n in now.checkpointed_bytes.get(job, {}).items():
                    need[dev] = need.get(dev, 0) + n
            short = {dev: n - now.devices[dev].free for dev, n in need.items()
                     if dev in now.devices and n > now.devices[dev].free}
            if not short or time.monotonic() >= deadline:
                return short
            await asyncio.sleep(FREED_POLL_SECONDS)

    def _targets(self, spec: GroupSpec, job: str) -> list[AgentClient | _CooperativeStep]:
        """Who moves `job`: its processes (cooperative), else the agents of the nodes where it
        runs (all of the group's, in static mode)."""
        if spec.backend == names.BACKEND_COOPERATIVE:
            return [_CooperativeStep(self.cooperative)]
        member = spec.member(job)
        targets = list(member.claims_by_agent) if member else spec.agents
        return [self._pool.get(t) for t in targets]

    def _current(self, agents: Iterable[AgentClient | _CooperativeStep]) -> list[AgentClient | _CooperativeStep]:
        """The pool's clients now for the targets of `agents` (a client is replaced, and its
        channel closed, when its agent's TLS certificate changes mid-switch)."""
        return [a if isinstance(a, _CooperativeStep) else self._pool.get(a.target) for a in agents]

    async def _on_all(self, agents: Sequence[AgentClient | _CooperativeStep], step: str, spec: GroupSpec,
                      job: str) -> tuple[dict[Any, StepResult], dict[Any, BaseException]]:
        results = await asyncio.gather(*(self._step(a, step, spec, job) for a in agents), return_exceptions=True)
        done = {a: r for a, r in zip(agents, results) if isinstance(r, StepResult)}
        failures = {a: r for a, r in zip(agents, results) if not isinstance(r, StepResult)}
        for a, err in failures.items():
            log.warning("%s failed group=%s job=%s agent=%s: %s", step, spec.id, job, a.target, err)
        return done, failures

    async def _step(self, agent: AgentClient | _CooperativeStep, step: str, spec: GroupSpec, job: str) -> StepResult:
        """One step on one agent, resent with its operation id while its reply is lost (see
        the module docstring). Raises the step's error; `OutcomeUnknown` when the step may
        have run: no reply to any resend (`no_reply`), or a resend answered with an error
        (the agent may not know operation ids: the caller undoes it all the same)."""
        member = spec.member(job)
        if isinstance(agent, _CooperativeStep):
            return await getattr(agent, step)(job, spec.backend, spec.id, spec.step_timeout_seconds, member)
        op = new_operation_id()
        try:
            return await getattr(agent, step)(job, spec.backend, spec.id, spec.step_timeout_seconds, member,
                                              operation_id=op, app=spec.app(job))
        except OutcomeUnknown as err:
            if not err.no_reply:
                raise
            lost = err
        loop = asyncio.get_running_loop()
        until = loop.time() + min(spec.step_timeout_seconds, RESEND_WINDOW_SECONDS)
        backoff, tries = RESEND_BACKOFF_SECONDS, 0
        while True:
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, RESEND_BACKOFF_MAX_SECONDS)
            tries += 1
            log.warning("%s resent group=%s job=%s agent=%s operation=%s try=%d: no reply (%s)", step, spec.id,
                        job, agent.target, op, tries, lost)
            try:  # the pool's client now (replaced when the agent's certificate changed)
                result: StepResult = await getattr(self._pool.get(agent.target), step)(
                    job, spec.backend, spec.id, spec.step_timeout_seconds, member, operation_id=op, app=spec.app(job))
            except OutcomeUnknown as err:
                if not err.no_reply:
                    raise
                lost = err
            except Unavailable as err:  # the pool will not call it now (e.g. TLS required, no certificate)
                raise OutcomeUnknown(f"{lost}; resend of operation {op}: {err}", no_reply=True) from err
            except TimeSliceServerError as err:
                raise OutcomeUnknown(f"{err} (a resend of operation {op}, whose first reply was lost)",
                                     no_reply=False) from err
            else:
                log.info("%s completed by resend group=%s job=%s agent=%s operation=%s try=%d", step, spec.id, job,
                         agent.target, op, tries)
                return result
            if loop.time() >= until:
                raise OutcomeUnknown(f"{lost}; no reply to {tries} resend(s) of operation {op}", no_reply=True)

    async def _undo(self, agents: Sequence[AgentClient | _CooperativeStep], step: str, spec: GroupSpec,
                    job: str) -> bool:
        """Run the compensating step; True when it succeeded on every agent."""
        if not agents:
            return True
        _, failures = await self._on_all(agents, step, spec, job)
        if failures:
            log.error("rollback %s incomplete group=%s job=%s agents=%s", step, spec.id, job,
                      ",".join(a.target for a in failures))
        return not failures

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


def _unknown(failures: dict[Any, BaseException]) -> list[Any]:
    """The agents whose step may have run although it failed (no reply): undone like the done ones."""
    return [a for a, err in failures.items() if isinstance(err, OutcomeUnknown)]


class _CooperativeStep:
    """The cooperative backend behind the same step calls as an `AgentClient`."""

    target = "cooperative"

    def __init__(self, jobs: CooperativeJobs) -> None:
        self._jobs = jobs

    async def checkpoint(self, job: str, backend: str, group: str, timeout: float, member: object) -> StepResult:
        return await self._jobs.checkpoint(group, job, timeout)

    async def restore(self, job: str, backend: str, group: str, timeout: float, member: object) -> StepResult:
        return await self._jobs.restore(group, job, timeout)
