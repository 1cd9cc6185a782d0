"""Memory-aware residency: which idle jobs must leave the GPUs before a job is granted.

Owned by `LockGroup` (one `Residency` per group); the pure `plan_room` is the policy,
unit-tested over fake memory reports. DESIGN.md, "Lock groups and the orchestrator":
the lock orders compute, memory moves only when the incoming job does not fit.

Terms. A *device* is one GPU of one node, keyed `"<agent target>/<GPU uuid>"`. A
`MemorySnapshot` merges the node agents' reports (`GetMemory`, NVML): per device its
total and free bytes, per job its bytes on each device (and the most it held since the
last report, sampled by the agent every 100 ms) and the size of its checkpoint.

A job's *need* on a device (its reservation) is max(what it declared, the most it held
while holding (its peak), its checkpoint's size). It declares with the claim's
consumable-capacity `memory` request or `TimeSliceConfig.memory` (cluster), or
`TIMESLICE_MEMORY` / `acquire(memory=)` (its client; bytes per GPU). A job that declared
nothing is *unsettled* until one of its observed holds, after its first two, ended without
raising its peak by more than `SETTLE_GROWTH` of the device: RL jobs grow after their first
hold (the model is built inside it, optimizer state appears at the first train step, the KV
cache in generate; measured on the H200: a GRPO job held 36 GB at its first hold and 47 GB
after its first train step, bench/results/rl-grpo-*.json), so its peak so far is no bound
yet. A hold is *observed* when memory reports covered it throughout, each from the same run
of its node agent. One that went unwatched for a while (a report failed or an agent was
down; an agent answered as another `incarnation` than before: restarted, its peak samples
started over, or stopped for a while, its samples have a gap; idle residents were
checkpointed for the holder; the hold was adopted at the orchestrator's start) may have
peaked where no report saw it: it neither counts among the
first two nor settles its job. An unsettled job is never placed beside others on a guess: it
is granted *alone*
(every idle resident on its GPUs is checkpointed first, and while more than the headroom
would stay held by others, residents with nothing to move or processes of no job of the
group such as one that left and is still exiting, it waits),
nothing is staged or restored beside it while it holds, and its grant waits until it is alone. The *room* a job lacks
is need - what it holds now + headroom - free. Residents are checkpointed least recently
held first until no device lacks room; a checkpoint also needs host memory for its bytes
on that node; when the host lacks it, a checkpointed incoming job whose state fits beside
the residents now is restored first, and its host memory holds theirs (`restore_first`).
Without room for what the job must add, the plan raises `NoRoom` naming the device and
the numbers, and nothing is attempted; a resident job that only finds the headroom thin
is granted anyway.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from timeslice.driver.errors import FailedPrecondition
from timeslice.driver.headroom import parse_headroom

__all__ = ["MemorySnapshot", "NoHostRoom", "NoRoom", "Residency", "lacking_room", "moves_may_come", "parse_headroom",
           "plan_room"]

# A hold ends *settled* (its job's memory is known) when its peak grew by at most this
# fraction of the device's memory (allocator rounding, a longer batch), after at least
# `SETTLE_MIN_HOLDS` observed holds (the first builds the job, the next ones add its phases'
# state); see the module docstring.
SETTLE_GROWTH = 0.01
SETTLE_MIN_HOLDS = 2

class NoRoom(FailedPrecondition):
    """No plan makes room: the job stays where it is (checkpointed or not granted)."""


class NoHostRoom(NoRoom):
    """A checkpoint the plan needs has no host memory on its node (`plan_room`)."""


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int


@dataclass
class MemorySnapshot:
    """The group's memory as its node agents reported it; bytes; `taken_at` monotonic seconds.
    `host_available`: per agent target, host bytes a checkpoint may use."""

    devices: dict[str, DeviceMemory] = field(default_factory=dict)
    device_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> device -> bytes
    checkpointed_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    # job -> device -> bytes a checkpoint frees, where less than what it holds (cooperative:
    # only the registered state leaves; the CUDA context and the rest stay)
    movable_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    host_available: dict[str, int] = field(default_factory=dict)
    # job -> device -> the most it held since the agent's previous report (sampled every
    # 100 ms while the orchestrator watches a hold); at least device_bytes
    peak_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    unseen: set[str] = field(default_factory=set)  # jobs whose device bytes are what they registered, not NVML's
    unanswered: set[str] = field(default_factory=set)  # agent targets whose report failed
    incarnations: dict[str, str] = field(default_factory=dict)  # agent target -> the run that answered
    # job -> its processes the bytes were counted from, "<agent target>/<pid>:<start time>"
    processes: dict[str, set[str]] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.monotonic)

    def on_device(self, job: str) -> dict[str, int]:
        return self.device_bytes.get(job, {})


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def agent_of(device: str) -> str:
    """The agent target of a device key `"<target>/<uuid>"` (targets may hold slashes)."""
    return device.rsplit("/", 1)[0]


def devices_of(job: str, snap: MemorySnapshot, peaks: Mapping[str, Mapping[str, int]]) -> set[str]:
    """The devices `job` uses: where it holds, held, or has a checkpoint; a job never seen
    anywhere uses every device of the group's report (static groups have one GPU each)."""
    devs = set(peaks.get(job, {})) | set(snap.checkpointed_bytes.get(job, {})) | set(snap.on_device(job))
    return devs or set(snap.devices)


def need_of(job: str, snap: MemorySnapshot, peaks: Mapping[str, Mapping[str, int]],
            declared: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes `job` will hold on each device while it computes (its reservation): see the
    module docstring. `declared`: job -> bytes per GPU it declared."""
    own = peaks.get(job, {})
    ckpt = snap.checkpointed_bytes.get(job, {})
    d = (declared or {}).get(job, 0)
    return {dev: max(own.get(dev, 0), ckpt.get(dev, 0), d) for dev in devices_of(job, snap, peaks)}


def lacking_room(incoming: str, snap: MemorySnapshot, peaks: Mapping[str, Mapping[str, int]],
                 headroom: tuple[float, int], declared: Mapping[str, int] | None = None) -> dict[str, tuple[int, bool]]:
    """Per device of `incoming` where free memory is short of (growth + headroom): the bytes
    missing, and whether the job must grow there (restore, a newcomer, a peak above what it
    holds: then the bytes must be found) or only the headroom is thin (found if idle residents
    can give it, else the job is granted anyway: what it needs is already on the device)."""
    have = snap.on_device(incoming)
    need = need_of(incoming, snap, peaks, declared)
    out: dict[str, tuple[int, bool]] = {}
    for dev in set(need) | set(have):
        mem = snap.devices.get(dev)
        if mem is None:
            continue  # a device no agent reports (its node is gone): the switch step will say so
        growth = max(0, need.get(dev, 0) - have.get(dev, 0))
        short = growth + _reserve(mem, headroom) - mem.free
        if short > 0:
            out[dev] = (short, growth > 0)
    return out


def plan_room(incoming: str, residents_lru: Sequence[str], snap: MemorySnapshot,
              peaks: Mapping[str, Mapping[str, int]], headroom: tuple[float, int],
              host_checked: bool = True, declared: Mapping[str, int] | None = None,
              alone: bool = False, restore_first: bool = False) -> list[str]:
    """The residents to checkpoint, in order, so that `incoming` fits; [] when it fits now.

    `residents_lru`: the idle resident jobs, least recently held first (never the incoming
    job). `headroom`: (fraction of device total, bytes), from `parse_headroom`: kept free on
    each device of `incoming` (a resident job's next phase may grow past its peak so far).
    `host_checked`: each checkpoint must fit in its node's available host memory (the
    backends that copy device memory to host memory). `declared`: job -> bytes per GPU it
    declared. `alone`: `incoming` is unsettled (module docstring): every resident that
    holds memory on its devices is checkpointed, whether or not it seems to fit.
    `restore_first`: `incoming`'s checkpoint is restored before the residents are
    checkpointed (nobody computes during a switch), so the host memory its restore gives
    back holds theirs; then each device must have room for its checkpoint now, beside
    everybody, plus the headroom. Raises NoHostRoom when a checkpoint it needs has no host
    memory, NoRoom when the job must grow and cannot (or, `restore_first`, its checkpoint
    does not fit beside the residents).
    """
    lacking = lacking_room(incoming, snap, peaks, headroom, declared)
    mine = devices_of(incoming, snap, peaks)
    host = dict(snap.host_available)
    if restore_first:
        _lend_host_memory(incoming, snap, headroom, host)
    evict: list[str] = []
    for job in residents_lru:
        if not lacking and not alone:
            break
        held = snap.movable_bytes.get(job, snap.on_device(job))
        if not any(held.get(dev, 0) > 0 for dev in (mine if alone else lacking)):
            continue
        if host_checked:
            _take_host_memory(job, incoming, held, host)
        evict.append(job)
        for dev in list(lacking):
            short, must = lacking[dev]
            short -= held.get(dev, 0)
            if short <= 0:
                del lacking[dev]
            else:
                lacking[dev] = (short, must)
    others = {dev: _others(incoming, dev, mem, snap, evict) for dev, mem in snap.devices.items() if dev in mine}
    if alone:  # alone means no memory of anybody else: none that a checkpoint here would not free
        for dev in sorted(others):
            if others[dev] > _reserve(snap.devices[dev], headroom):
                raise NoRoom(f"{incoming} runs alone (it declared no memory and has not settled) and "
                             f"{_gb(others[dev])} of {dev} would stay held by others: residents with nothing to move "
                             f"(registered no state yet) or processes of no job of this group (one that left and "
                             f"is still exiting); {incoming} waits for it to be freed")
    _check_growth_fits(incoming, snap, peaks, headroom, declared, lacking, others)
    return evict


def _reserve(mem: DeviceMemory, headroom: tuple[float, int]) -> int:
    """The headroom's bytes on a device of `mem.total` bytes."""
    return int(headroom[0] * mem.total) + headroom[1]


def _lend_host_memory(incoming: str, snap: MemorySnapshot, headroom: tuple[float, int],
                      host: dict[str, int]) -> None:
    """`plan_room(restore_first=True)`: `incoming`'s checkpoint must fit beside everybody now;
    the host memory its restore gives back is added to `host` (per agent). Raises NoRoom."""
    for dev, n in snap.checkpointed_bytes.get(incoming, {}).items():
        mem = snap.devices.get(dev)
        room = mem.free - _reserve(mem, headroom) if mem is not None else 0
        if n > room:
            raise NoRoom(f"no host memory to checkpoint the residents of {dev} for {incoming}, and its "
                         f"{_gb(n)} do not fit beside them to be restored first ({_gb(room)} free above the "
                         f"headroom); {incoming} stays where it is")
        host[agent_of(dev)] = host.get(agent_of(dev), 0) + n


def _take_host_memory(job: str, incoming: str, held: Mapping[str, int], host: dict[str, int]) -> None:
    """Take from `host` (per agent) the bytes `job`'s checkpoint needs. Raises NoHostRoom."""
    for agent, n in _per_agent(held).items():
        if n > host.get(agent, 0):
            raise NoHostRoom(f"no host memory to checkpoint {job} on {agent}: it holds {_gb(n)}, the node has "
                             f"{_gb(host.get(agent, 0))} available (the group serves the others; {incoming} "
                             "stays where it is)")
        host[agent] -= n


def _check_growth_fits(incoming: str, snap: MemorySnapshot, peaks: Mapping[str, Mapping[str, int]],
                       headroom: tuple[float, int], declared: Mapping[str, int] | None,
                       lacking: Mapping[str, tuple[int, bool]], others: Mapping[str, int]) -> None:
    """Raise NoRoom where `incoming` must grow and, after the evictions, still lacks bytes
    (`lacking`); the headroom counts only where others than it hold more than the headroom."""
    for dev, (short, must) in lacking.items():
        if not must:
            continue
        reserve = _reserve(snap.devices[dev], headroom)
        if others.get(dev, 0) <= reserve:
            short -= reserve  # nobody's growth to keep room for: what the job must add must fit, no more
        if short > 0:
            mem = snap.devices[dev]
            need = need_of(incoming, snap, peaks, declared)[dev]
            raise NoRoom(f"no room for {incoming} on {dev}: it needs {_gb(need)} plus "
                         f"headroom, {_gb(mem.free)} of {_gb(mem.total)} is free and checkpointing every idle "
                         f"resident would leave it {_gb(short)} short; {incoming} stays where it is")


def _others(incoming: str, dev: str, mem: DeviceMemory, snap: MemorySnapshot, evict: Sequence[str]) -> int:
    """Bytes of `dev` held by others than `incoming` once the jobs of `evict` are checkpointed."""
    freed = sum(snap.movable_bytes.get(j, snap.on_device(j)).get(dev, 0) for j in evict)
    return mem.total - mem.free - snap.on_device(incoming).get(dev, 0) - freed


def _per_agent(per_device: Mapping[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for dev, n in per_device.items():
        out[agent_of(dev)] = out.get(agent_of(dev), 0) + n
    return out


def moves_may_come(jobs: Sequence[str], snap: MemorySnapshot, peaks: Mapping[str, Mapping[str, int]],
                    headroom: tuple[float, int], known: Callable[[str], bool],
                    declared: Mapping[str, int] | None = None) -> bool:
    """Whether a grant among the group's `jobs` may move memory by `snap`: two or more jobs
    and one of them with no known need (it runs alone: the others leave for it), or, on some
    device, their needs (`need_of`) together exceed its memory less the headroom. False for
    one job. The `cooperative` backend pins its host pool ahead only then (`pin_ahead`): a
    pool no move uses need not be registered by every process."""
    if len(jobs) < 2:
        return False
    if not all(known(j) for j in jobs):
        return True
    total: dict[str, int] = {}
    for job in jobs:
        for dev, n in need_of(job, snap, peaks, declared).items():
            total[dev] = total.get(dev, 0) + n
    return any(n + _reserve(snap.devices[dev], headroom) > snap.devices[dev].total
               for dev, n in total.items() if dev in snap.devices)


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
        if job not in self.residents:
            self.residents[job] = None
            self.residents.move_to_end(job, last=next_up)

    def forget(self, job: str) -> None:
        self.residents.pop(job, None)
        self.checkpointed.discard(job)
        self.peaks.pop(job, None)
        self.declared.pop(job, None)
        self.settled.discard(job)
        self.holds.pop(job, None)
        self._holding.pop(job, None)
        self._ended.pop(job, None)
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

    def need(self, job: str) -> dict[str, int]:
        """`job`'s reservation per device by the last snapshot (empty without one)."""
        return need_of(job, self.snapshot, self.peaks, self.declared) if self.snapshot else {}

    def worst_case(self, excluding: str = "") -> MemorySnapshot | None:
        """The last snapshot (None without one), each device's free bytes lowered by what the
        jobs that held since it was taken (holding now, or whose hold ended since; not
        `excluding`) may have grown past what it shows: up to their need (a resident grows
        only while it holds; past its need, the holder's memory watch acts)."""
        snap = self.snapshot
        if snap is None:
            return None
        grown: dict[str, int] = {}
        for job in {*self._holding, *self._ended} - {excluding}:
            held = snap.on_device(job)
            for dev, b in self.need(job).items():
                grown[dev] = grown.get(dev, 0) + max(0, b - held.get(dev, 0))
        if not any(grown.values()):
            return snap
        devices = {dev: DeviceMemory(m.total, m.free - grown.get(dev, 0)) for dev, m in snap.devices.items()}
        return dataclasses.replace(snap, devices=devices)

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
        for job in self.residents:
            peak = self.peaks.setdefault(job, {})
            seen = dict(snap.on_device(job))
            for dev, b in snap.peak_bytes.get(job, {}).items():
                seen[dev] = max(seen.get(dev, 0), b)
            for dev, b in seen.items():
                if b > peak.get(dev, 0):
                    peak[dev] = b
        self._settle(snap)
