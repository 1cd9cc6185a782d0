"""Placement: which idle jobs must leave the GPUs before a job is granted (pure functions over memory reports,
unit-tested over fake ones; the learned state they read is residency.py's). DESIGN.md, "Lock groups and the
orchestrator": memory moves only when the incoming job does not fit. The reports are `MemorySnapshot`s
(memory_snapshot.py: the devices, keyed `"<agent target>/<GPU uuid>"`, and per job its bytes on each device, its
peak and its checkpoint's size).

A job's *need* on a device (its reservation) is max(what it declared, the most it held while holding (its
peak), its checkpoint's size). It declares with the claim's consumable-capacity `memory` request or
`TimeSliceConfig.memory` (cluster), or `TIMESLICE_MEMORY` / `acquire(memory=)` (its client; bytes per GPU). An
unsettled job (residency.py) is never placed beside others on a guess: it is granted *alone* (every idle
resident on its GPUs is checkpointed first, and while more than the headroom would stay held by others,
residents with nothing to move or processes of no job of the group such as one that left and is still exiting,
it waits), nothing is staged or restored beside it while it holds. The *room* a job lacks is need - what it
holds now + headroom - free. Residents are checkpointed least recently held first until no device lacks room;
a checkpoint also needs host memory for its bytes on that node; when the host lacks it, a checkpointed
incoming job whose state fits beside the residents now is restored first, and its host memory holds theirs
(`restore_first`). Without room for what the job must add, the plan raises `NoRoom` naming the device and the
numbers, and nothing is attempted; a resident job that only finds the headroom thin is granted anyway.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

from timeslice import host_memory
from timeslice.controller.orchestrator.memory_snapshot import DeviceMemory, MemorySnapshot, agent_of
from timeslice.driver.errors import FailedPrecondition

log = logging.getLogger("timeslice.orchestrator")


class NoRoom(FailedPrecondition):
    """No plan makes room: the job stays where it is (checkpointed or not granted)."""


class NoHostRoom(NoRoom):
    """A checkpoint the plan needs has no host memory on its node (`plan_room`)."""


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def devices_of(job: str, snap: MemorySnapshot, peaks: Mapping[str, Mapping[str, int]]) -> set[str]:
    """The devices `job` uses: where it holds, held, or has a checkpoint; a job never seen anywhere uses every
    device of the group's report (static groups have one GPU each)."""
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

    `residents_lru`: the idle resident jobs, least recently held first (never the incoming job). `headroom`:
    (fraction of device total, bytes), from `parse_headroom`: kept free on each device of `incoming` (a
    resident job's next phase may grow past its peak so far). `host_checked`: each checkpoint must fit in its
    node's available host memory (the backends that copy device memory to host memory). `declared`: job ->
    bytes per GPU it declared. `alone`: `incoming` is unsettled (module docstring): every resident that holds
    memory on its devices is checkpointed, whether or not it seems to fit. `restore_first`: `incoming`'s
    checkpoint is restored before the residents are checkpointed (nobody computes during a switch), so the
    host memory its restore gives back holds theirs; then each device must have room for its checkpoint now,
    beside everybody, plus the headroom. Raises NoHostRoom when a checkpoint it needs has no host memory,
    NoRoom when the job must grow and cannot (or, `restore_first`, its checkpoint does not fit beside the
    residents).
    """
    lacking = lacking_room(incoming, snap, peaks, headroom, declared)
    mine = devices_of(incoming, snap, peaks)
    # what the node agents and the clients keep for the host is not a checkpoint's (`host_memory`)
    host = {agent: n - host_memory.RESERVE_BYTES for agent, n in snap.host_available.items()}
    pool = dict(snap.pool_free)
    if restore_first:
        _lend_host_memory(incoming, snap, headroom, pool if pool else host)
    evict: list[str] = []
    for job in residents_lru:
        if not lacking and not alone:
            break
        held = snap.movable_bytes.get(job, snap.on_device(job))
        if not any(held.get(dev, 0) > 0 for dev in (mine if alone else lacking)):
            continue
        if host_checked:
            _take_host_memory(job, incoming, held, host, pool)
        evict.append(job)
        for dev in list(lacking):
            short, must = lacking[dev]
            short -= held.get(dev, 0)
            if short <= 0:
                del lacking[dev]
            else:
                lacking[dev] = (short, must)
    others = held_by_others(incoming, snap, mine, evict)
    for dev, n in crowded(snap, others, headroom)[:1] if alone else ():
        raise NoRoom(f"{incoming} runs alone (it declared no memory and has not settled) and {_gb(n)} of {dev} would "
                     "stay held by others: residents with nothing to move (registered no state yet) or processes of no "
                     f"job of this group (one that left and is still exiting); {incoming} waits for it to be freed")
    _check_growth_fits(incoming, snap, peaks, headroom, declared, lacking, others)
    return evict


def held_by_others(incoming: str, snap: MemorySnapshot, mine: set[str], evict: Sequence[str] = ()) -> dict[str, int]:
    """Per device of `incoming` (`mine`: `devices_of`): bytes others hold once the jobs of `evict` are checkpointed."""
    freed = {dev: sum(snap.movable_bytes.get(j, snap.on_device(j)).get(dev, 0) for j in evict) for dev in mine}
    return {dev: m.total - m.free - snap.on_device(incoming).get(dev, 0) - freed[dev]
            for dev, m in snap.devices.items() if dev in mine}


def crowded(snap: MemorySnapshot, others: Mapping[str, int], headroom: tuple[float, int]) -> list[tuple[str, int]]:
    """[(device, bytes)] of `others` (`held_by_others`) over the headroom: an unsettled job runs alone, not there."""
    return [(dev, n) for dev, n in sorted(others.items()) if n > _reserve(snap.devices[dev], headroom)]


def _reserve(mem: DeviceMemory, headroom: tuple[float, int]) -> int:
    """The headroom's bytes on a device of `mem.total` bytes."""
    return int(headroom[0] * mem.total) + headroom[1]


def _lend_host_memory(incoming: str, snap: MemorySnapshot, headroom: tuple[float, int],
                      host: dict[str, int]) -> None:
    """`plan_room(restore_first=True)`: `incoming`'s checkpoint must fit beside everybody now; the host
    memory its restore gives back is added to `host` (per agent: the pinned pool's free bytes where the
    node has one, whose ranges the restore gives back). Raises NoRoom."""
    for dev, n in snap.checkpointed_bytes.get(incoming, {}).items():
        mem = snap.devices.get(dev)
        room = mem.free - _reserve(mem, headroom) if mem is not None else 0
        if n > room:
            raise NoRoom(f"no host memory to checkpoint the residents of {dev} for {incoming}, and its "
                         f"{_gb(n)} do not fit beside them to be restored first ({_gb(room)} free above the "
                         f"headroom); {incoming} stays where it is")
        host[agent_of(dev)] = host.get(agent_of(dev), 0) + n


def _take_host_memory(job: str, incoming: str, held: Mapping[str, int], host: dict[str, int],
                      pool: dict[str, int]) -> None:
    """Take the bytes `job`'s checkpoint needs, per agent, from its node's pool (`pool`) when they fit
    there, else from its host memory (`host`): one checkpoint is never split between them (H100 host,
    3 x 57 GB: a 47 GB state was sent out with 38.6 GB of the pool free and ~30 GB of host memory, and
    the kernel killed the job as its own buffer filled). Raises NoHostRoom."""
    for agent, n in _per_agent(held).items():
        if n <= pool.get(agent, 0):
            pool[agent] -= n
            continue
        if n > host.get(agent, 0):
            in_pool = f" and {_gb(pool[agent])} free in its pinned pool" if agent in pool else ""
            raise NoHostRoom(f"no host memory to checkpoint {job} on {agent}: it holds {_gb(n)}, the node has "
                             f"{_gb(host.get(agent, 0) + host_memory.RESERVE_BYTES)} available (less "
                             f"{_gb(host_memory.RESERVE_BYTES)} kept for the host){in_pool} (a checkpoint is not "
                             f"split between them; the group serves the others; {incoming} stays where it is)")
        host[agent] -= n


def _check_growth_fits(incoming: str, snap: MemorySnapshot, peaks: Mapping[str, Mapping[str, int]],
                       headroom: tuple[float, int], declared: Mapping[str, int] | None,
                       lacking: Mapping[str, tuple[int, bool]], others: Mapping[str, int]) -> None:
    """Raise NoRoom where `incoming` must grow and, after the evictions, still lacks bytes (`lacking`); the
    headroom counts only where others than it hold more than the headroom (`others`: `held_by_others`).
    A declared need over the GPU's whole memory ("80Gi" on an H100 of 79.6 GiB) would wait forever:
    where what the job was seen to hold fits, it is granted with everybody else moved out, and a
    warning says so."""
    for dev, (short, must) in lacking.items():
        if not must:
            continue
        reserve = _reserve(snap.devices[dev], headroom)
        if others.get(dev, 0) <= reserve:
            short -= reserve  # nobody's growth to keep room for: what the job must add must fit, no more
        if short > 0:
            mem = snap.devices[dev]
            need = need_of(incoming, snap, peaks, declared)[dev]
            seen = need_of(incoming, snap, peaks, None)[dev]  # its checkpoint and peak: what it really holds
            if need > mem.total and short - (need - seen) <= 0:
                log.warning("%s declared %s on %s, more than its %s: granted with every other job moved out (is "
                            "what it declared too high?)", incoming, _gb(need), dev, _gb(mem.total))
                continue
            raise NoRoom(f"no room for {incoming} on {dev}: it needs {_gb(need)} plus "
                         f"headroom, {_gb(mem.free)} of {_gb(mem.total)} is free and checkpointing every idle "
                         f"resident would leave it {_gb(short)} short; {incoming} stays where it is")


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


def as_planned(snap: MemorySnapshot, forced: Sequence[str], growing: Sequence[str],
               peaks: Mapping[str, Mapping[str, int]], declared: Mapping[str, int]) -> MemorySnapshot:
    """`snap` with each device's free bytes as a plan counts them: what the `forced` jobs hold is free
    once they leave; the `growing` jobs (a holder beside a staging, the idle residents beside a
    background restore) may still grow to their need (peak or declared, `need_of`)."""
    freed: dict[str, int] = {}
    for job in forced:
        for dev, b in snap.on_device(job).items():
            freed[dev] = freed.get(dev, 0) + b
    for job in growing:
        held = snap.on_device(job)
        for dev, b in need_of(job, snap, peaks, declared).items():
            freed[dev] = freed.get(dev, 0) - max(0, b - held.get(dev, 0))
    if not freed:
        return snap
    devices = dict(snap.devices)
    for dev, b in freed.items():
        if dev in devices:
            devices[dev] = DeviceMemory(devices[dev].total, devices[dev].free + b)
    return dataclasses.replace(snap, devices=devices)


def place(incoming: str, residents: Sequence[str], snap: MemorySnapshot, peaks: Mapping[str, Mapping[str, int]],
          declared: Mapping[str, int], headroom: tuple[float, int], *, known: bool, checkpointed: bool,
          first_ok: bool) -> tuple[list[str], bool]:
    """(residents to checkpoint, restore `incoming` first): `plan_room` over `snap` (`known`:
    `incoming`'s memory is settled or declared, else it is placed alone); where the checkpoints
    lack host memory, `first_ok` (nobody stays computing beside the switch) and `incoming` is
    `checkpointed`, the plan with its restore first. Raises NoRoom (the host's lack, when the
    restore first does not fit either)."""
    try:
        return plan_room(incoming, residents, snap, peaks, headroom, declared=declared, alone=not known), False
    except NoHostRoom as err:
        if not checkpointed or not first_ok:
            raise
        try:
            return plan_room(incoming, residents, snap, peaks, headroom, declared=declared, alone=not known,
                             restore_first=True), True
        except NoRoom as first:
            log.info("no restore first job=%s: %s", incoming, first)
            raise err from None


def room_for_holder(snap: MemorySnapshot, idle_lru: Sequence[str], headroom: tuple[float, int]) -> list[str]:
    """The idle residents to checkpoint, least recently held first, so that every GPU where
    `snap` shows less free than the headroom (the holder outgrew its reservation) has it again:
    only jobs with bytes on such a GPU, until each is covered, or all of them (never the holder:
    `idle_lru` excludes it). Empty: no GPU is short, or nobody idle is on the short ones."""
    short = {dev: _reserve(m, headroom) - m.free for dev, m in snap.devices.items() if m.free < _reserve(m, headroom)}
    evict: list[str] = []
    for job in idle_lru if short else ():
        held = snap.movable_bytes.get(job, snap.on_device(job))
        if any(held.get(dev, 0) > 0 for dev in short):
            evict.append(job)
            for dev in short:
                short[dev] -= held.get(dev, 0)
            if all(v <= 0 for v in short.values()):
                break
    return evict
