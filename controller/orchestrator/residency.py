"""Memory-aware residency: what the orchestrator has learned of each job's memory in one group.

Owned by `LockGroup` (one `Residency` per group): who is resident (least recently held
first) and who is checkpointed, what each job declared, its peak per device, and whether
its memory is *settled*. The placement policy over it is pure and lives in placement.py
(`plan_room`: which idle jobs leave the GPUs before a job is granted). DESIGN.md, "Lock
groups and the orchestrator".

A job that declared nothing is *unsettled* until one of its observed holds, after its first two,
ended without raising its peak by more than `SETTLE_GROWTH` of the device: RL jobs grow after their
first hold (the model is built inside it, optimizer state appears at the first train step, the KV
cache in generate; measured on the H200: a GRPO job held 36 GB at its first hold and 47 GB after
its first train step, bench/results/rl-grpo-*.json), so its peak so far is no bound yet. A hold is
*observed* when memory reports covered it throughout, each from the same run of its node agent.
One that went unwatched for a while (a report failed or an agent was down; an agent answered as
another `incarnation` than before: restarted, its peak samples started over, or stopped for a
while, its samples have a gap; idle residents were checkpointed for the holder; the hold was
adopted at the orchestrator's start) may have peaked where no report saw it: it neither counts
among the first two nor settles its job.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from timeslice.controller.orchestrator.memory_snapshot import MemorySnapshot
from timeslice.controller.orchestrator.placement import as_planned, need_of
from timeslice.driver import names

# A hold ends *settled* (its job's memory is known) when its peak grew by at most this
# fraction of the device's memory (allocator rounding, a longer batch), after at least
# `SETTLE_MIN_HOLDS` observed holds (the first builds the job, the next ones add its phases'
# state); see the module docstring.
SETTLE_GROWTH = 0.01
SETTLE_MIN_HOLDS = 2


@dataclass
class _Hold:
    """A hold in progress, or ended and not yet reported: its job's peak at the grant
    (`before`), and whether memory reports covered it so far (`observed`, module docstring)."""

    before: dict[str, int]
    observed: bool = True


class Residency:
    """Where each job of a group is: resident (least recently held first) or checkpointed,
    the last `MemorySnapshot`, each job's peak bytes per device seen while resident (a
    resident's footprint grows only while it holds), what it declared (bytes per GPU), and
    which jobs are settled (module docstring)."""

    def __init__(self) -> None:
        self.residents: OrderedDict[str, None] = OrderedDict()
        self.checkpointed: set[str] = set()
        self.peaks: dict[str, dict[str, int]] = {}
        self.declared: dict[str, int] = {}
        self.settled: set[str] = set()
        self.holds: dict[str, int] = {}  # job -> observed holds ended
        self._holding: dict[str, _Hold] = {}  # the holder's hold
        self._ended: dict[str, _Hold] = {}  # holds ended since the last snapshot
        self._restored: dict[str, float] = {}  # job -> when (monotonic seconds) it was restored without a grant
        self._started: dict[str, float] = {}  # job -> when (monotonic seconds) its processes last started again
        self._left_at: float | None = None  # when (monotonic seconds) a resident job last left (`forget`)
        self._incarnations: dict[str, str] = {}  # agent target -> the run that answered last
        self._processes: dict[str, set[str]] = {}  # job -> its processes in the last report that named it
        self.snapshot: MemorySnapshot | None = None

    def held(self, job: str, observed: bool = True) -> None:
        """`job` was granted: it is resident and the most recently held. Not `observed`: its
        hold began before this group watched it (adopted at a restart, or carried from
        another group)."""
        self.checkpointed.discard(job)
        self.residents[job] = None
        self.residents.move_to_end(job)
        self._holding[job] = _Hold(dict(self.peaks.get(job, {})), observed)

    def hold_ended(self, job: str, observed: bool = True) -> None:
        """`job`'s hold ended: the next snapshot (which carries the most it held) decides
        whether it settled: this hold, observed, after its first `SETTLE_MIN_HOLDS`, raised
        its peak by at most `SETTLE_GROWTH` of each device. Two holds that end before a
        snapshot count as one, observed only when both were. Not `observed`: it ended
        otherwise than by its job's release (the job may still compute)."""
        h = self._holding.pop(job, None)
        if h is not None:
            h.observed = h.observed and observed
            prev = self._ended.get(job)
            self._ended[job] = h if prev is None else _Hold(prev.before, prev.observed and h.observed)

    def unobserved(self) -> None:
        """A memory report failed, or the holder went unwatched for a while: the hold in
        progress and those ended since the last snapshot may have peaked unseen; they neither
        count toward settling nor settle their jobs (module docstring)."""
        for h in (*self._holding.values(), *self._ended.values()):
            h.observed = False

    def _settle(self, snap: MemorySnapshot) -> None:
        for job, h in self._ended.items():
            if not h.observed:
                continue  # its peak may have been missed: no evidence that the job stopped growing
            n = self.holds[job] = self.holds.get(job, 0) + 1
            peak = self.peaks.get(job, {})
            if n <= SETTLE_MIN_HOLDS or job in self.settled or not peak:
                continue
            if all(b - h.before.get(dev, 0) <= SETTLE_GROWTH * snap.devices[dev].total
                   for dev, b in peak.items() if dev in snap.devices):
                self.settled.add(job)
        self._ended.clear()

    def started(self, job: str) -> None:
        """`job`'s processes started (again): its memory grows from nothing again, so the
        holds of its earlier processes neither count nor settle it (schedules seed 8370: a job
        SIGTERMed and started again was taken as settled on its first process's early phases,
        the new one repeated them, then its first generate beside another job ran out of
        memory). Its peaks stay: a need never shrinks on a guess."""
        self.settled.discard(job)
        self.holds.pop(job, None)
        self._ended.pop(job, None)
        self._started[job] = time.monotonic()

    def started_at(self, job: str) -> float | None:
        """When (monotonic seconds) `job`'s processes last started again (None: not since it joined)."""
        return self._started.get(job)

    def started_since_report(self, job: str) -> bool:
        """Whether `job`'s processes started again after the last snapshot was taken: what
        it shows as `job`'s is its earlier processes' (the GPU may still hold their bytes
        a while after they end), not room for the new ones. False without a snapshot (no
        GPU reports: nothing is placed on them)."""
        at = self._started.get(job)
        return at is not None and self.snapshot is not None and at >= self.snapshot.taken_at

    def unsettled_held_since_report(self, excluding: str = "") -> bool:
        """Whether a job whose need is not known (declared nothing, not settled) held after the
        last snapshot was taken (not `excluding`): what it shows of that job may be far below
        what it holds now (cooperative schedules seed 80422: an undeclared job restored its 35 MB model,
        built 43 MB of optimizer state and released; a resident granted 5 ms later, its room
        reckoned from the report before that growth, ran out of memory)."""
        return any(not self.known(j) for j in {*self._holding, *self._ended} - {excluding})

    def left_since_report(self) -> bool:
        """Whether a resident job left the group after the last snapshot was taken: its processes
        may still be exiting, their memory not yet free, and no report since shows how much
        (cooperative schedules seed 60299: with the node agent down, a newcomer was granted as
        the one job left while a job that had just left still held 52 MB, and grew into them)."""
        return self._left_at is not None and self.snapshot is not None and self._left_at >= self.snapshot.taken_at

    def declare(self, job: str, nbytes: int) -> None:
        """`job` declared it needs `nbytes` per GPU (0: nothing declared; a later
        declaration replaces an earlier one)."""
        if nbytes > 0:
            self.declared[job] = nbytes
        else:
            self.declared.pop(job, None)

    def known(self, job: str) -> bool:
        """Whether `job`'s need is known: declared, or settled."""
        return job in self.declared or job in self.settled

    def moved_out(self, job: str) -> None:
        self.residents.pop(job, None)
        self.checkpointed.add(job)

    def moved_in(self, job: str, next_up: bool = False) -> None:
        """Restored without a grant: resident, least recently held (a background restore),
        or most recently (`next_up`: staged for the next grant, the last to leave)."""
        self.checkpointed.discard(job)
        self._restored[job] = time.monotonic()
        if job not in self.residents:
            self.residents[job] = None
            self.residents.move_to_end(job, last=next_up)

    def forget(self, job: str) -> None:
        """`job` is gone from the group. One that was resident leaves its memory on the GPUs
        until its processes have exited (`left_since_report`)."""
        if job in self.residents:
            self._left_at = time.monotonic()
        self.residents.pop(job, None)
        self.checkpointed.discard(job)
        self.peaks.pop(job, None)
        self.declared.pop(job, None)
        self.settled.discard(job)
        self.holds.pop(job, None)
        self._holding.pop(job, None)
        self._ended.pop(job, None)
        self._restored.pop(job, None)
        self._started.pop(job, None)
        self._processes.pop(job, None)

    def lru(self, excluding: Iterable[str] = ()) -> list[str]:
        skip = set(excluding)
        return [j for j in self.residents if j not in skip]

    @property
    def most_recent(self) -> str | None:
        return next(reversed(self.residents), None)

    def known_jobs(self) -> list[str]:
        """Every job this residency has a record of (resident, checkpointed, seen or declared)."""
        return sorted({*self.residents, *self.checkpointed, *self.peaks, *self.declared})

    def unfenceable(self, job: str, backend: str) -> bool:
        """Whether a checkpoint by `backend` would leave `job`'s processes running: the backend
        stops a process by locking its CUDA context (`names.CONTEXT_LOCKING_BACKENDS`), and the
        last snapshot shows the job holding no GPU memory by NVML's count, so no context (one
        alone takes hundreds of MiB): it has not made its first CUDA call. False when not known
        (no snapshot; bytes the job registered rather than NVML's)."""
        snap = self.snapshot
        return backend in names.CONTEXT_LOCKING_BACKENDS and snap is not None and bool(snap.devices) \
            and job not in snap.unseen and not any(snap.on_device(job).values())

    def need(self, job: str) -> dict[str, int]:
        """`job`'s reservation per device by the last snapshot (empty without one)."""
        return need_of(job, self.snapshot, self.peaks, self.declared) if self.snapshot else {}

    def worst_case(self, excluding: str = "") -> MemorySnapshot | None:
        """The last snapshot (None without one), each device's free bytes lowered by what the
        jobs that held since it was taken (holding now, or whose hold ended since; not
        `excluding`) may have grown past what it shows: up to their need (a resident grows
        only while it holds; past its need, the holder's memory watch acts); so are jobs
        restored since without a grant (cooperative schedules seed 132: a background restore
        finished 14 ms before a resident's grant, which the report from before it let grow
        into the restored job's room: an OOM)."""
        snap = self.snapshot
        if snap is None:
            return None
        restored = {job for job, at in self._restored.items() if at >= snap.taken_at}
        grown = sorted({*self._holding, *self._ended, *restored} - {excluding})
        return as_planned(snap, [], grown, self.peaks, self.declared)

    def observe(self, snap: MemorySnapshot) -> None:
        """Take a new snapshot: residents' peaks grow to the most they held (`peak_bytes`,
        else what they hold now), and the holds ended since the last one settle their jobs or
        not. A snapshot that an agent did not answer, or answered as another incarnation than
        before (restarted), makes the holds it should have covered `unobserved`; one with no
        devices (no agent answered) does only that. A job whose processes include one that
        its last report did not name `started` again (transparent backends learn of a
        restarted job only this way)."""
        restarted = any(self._incarnations.get(agent, run) != run for agent, run in snap.incarnations.items())
        self._incarnations.update(snap.incarnations)
        for job, procs in snap.processes.items():  # (a report names a job's processes only when it has some)
            if procs - self._processes.get(job, procs):
                self.started(job)
            self._processes[job] = procs
        if snap.unanswered or restarted:
            self.unobserved()
        if not snap.devices:
            return
        self.snapshot = snap
        self._restored = {job: at for job, at in self._restored.items() if at >= snap.taken_at}
        for job in self.residents:
            peak = self.peaks.setdefault(job, {})
            seen = dict(snap.on_device(job))
            for dev, b in snap.peak_bytes.get(job, {}).items():
                seen[dev] = max(seen.get(dev, 0), b)
            for dev, b in seen.items():
                if b > peak.get(dev, 0):
                    peak[dev] = b
        self._settle(snap)
