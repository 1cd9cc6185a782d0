"""HolderWatch: a memory-aware lock group's watch of its holder's growth.

Owned by `MemoryMoves` (one per group), started at every grant. While a job holds, its node
agents report the GPUs' memory (the holder's peak among it); where the holder outgrew its
reservation, idle residents leave through the group's switch runner (`SwitchRunner.make_room`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.memory_plan import pin_if_moves_may_come
from timeslice.controller.orchestrator.memory_snapshot import MemorySnapshot
from timeslice.controller.orchestrator.placement import room_for_holder
from timeslice.driver.headroom import parse_headroom

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

# While a job holds (memory-aware groups), its node agents sample the GPUs every 100 ms
# (`AgentClient.memory(watch=...)`), answering at least this often (seconds) with the
# holder's peak, and at once when a GPU's free memory falls under the headroom.
HOLDER_WATCH_SECONDS = 2.0
# While a switch is in flight when a watch answers low, how often (seconds) its end is looked
# for where there is no task of it to wait on.
SWITCH_POLL_SECONDS = 0.05
_WOKEN = object()  # a watch woken before its agents answered


@dataclass(frozen=True)
class _Poll:
    """A watch in flight: the jobs its reports name, and whether it answers early for low
    memory (`low` > 0) or only at its end (quiet)."""

    jobs: frozenset[str]
    low: int


class HolderWatch:
    """The watch task of `group`'s holder (`task`: while it runs)."""

    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self.task: asyncio.Task[None] | None = None
        self._poll: _Poll | None = None  # the watch in flight (None: between watches)
        self._wake = asyncio.Event()  # a grant, or a switch's end: the watch in flight may no longer do

    def start(self) -> None:
        """At every grant (memory-aware groups): learn the holder's peak as it grows, and when
        a GPU's free memory falls under the headroom (the holder outgrew its reservation),
        checkpoint idle residents there, least recently held first, never the holder, before
        the holder runs out. A watch in flight that would not see that for the new holder (it
        answers only at its end, or its reports do not name the holder) is begun again, and a
        pause between watches is cut short."""
        if not self._g.moves.memory_aware:
            return
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._watch(), name=f"watch-{self._g.id}")
            return
        p, h = self._poll, self._g.holder
        if p is None or (not p.low and self._low_free()) or (h is not None and h.job_id not in p.jobs):
            self._wake.set()

    def switch_ended(self) -> None:
        """A switch ended (a staging or a restore may have put an idle resident beside the
        holder): a watch in flight that answers only at its end is begun again."""
        if self._poll is not None and not self._poll.low and self._low_free():
            self._wake.set()

    async def _watch(self) -> None:
        """Watch the holder without a gap (`Residency.unobserved` where one is left): a report
        is observed also when the hold it began in has ended (it carries the peaks since the
        agent's last report, the next holder's included), and acted on for whoever holds when
        it answers. A watch that answered for low memory, nothing being able to leave, is
        followed by one that does not (quiet), begun again with the threshold at a grant or a
        switch's end; one that answered while a switch was in flight is followed, once it
        ended, by one that answers at once if memory is still low."""
        g = self._g
        quiet = 0  # the hold (epoch) whose last watch answered low with nothing to move: watched on without it
        while g.holder is not None:
            self._wake.clear()
            low = 0 if quiet == g.holder.epoch else self._low_free()
            quiet = 0
            jobs = sorted({*g.residency.residents, *g.residency.checkpointed})
            started = time.monotonic()
            try:
                snap = await self._watch_once(jobs, low)
            except Exception as err:  # an agent that does not answer: the next grant plans afresh
                log.warning("memory watch failed group=%s holder=%s: %s", g.id,
                            g.holder.job_id if g.holder else None, err)
                g.residency.unobserved()
                await self._pause(HOLDER_WATCH_SECONDS)
                continue
            if snap is _WOKEN or (isinstance(snap, MemorySnapshot) and await self._answered(snap)):
                continue
            short = bool(low) and isinstance(snap, MemorySnapshot) and any(m.free < low for m in snap.devices.values())
            if short and g.holder is not None:
                quiet = g.holder.epoch
            else:  # an agent that answers at once (a test double) is asked again later
                await self._pause(HOLDER_WATCH_SECONDS - (time.monotonic() - started))

    def _low_free(self) -> int:
        """The free bytes under which a watch answers at once: the headroom of the smallest GPU
        by the last report (0: no report yet)."""
        g = self._g
        fraction, fixed = parse_headroom(g.spec.memory_headroom)
        snap = g.residency.snapshot
        totals = [d.total for d in snap.devices.values()] if snap else []
        return int(fraction * min(totals)) + fixed if totals else 0

    async def _watch_once(self, jobs: list[str], low: int) -> MemorySnapshot | object | None:
        """One long poll of the agents (`Switcher.memory` with `watch`), or `_WOKEN` when the
        watch was woken first (the poll is cancelled: the agents keep what they sampled for
        their next report)."""
        g = self._g
        poll = asyncio.ensure_future(g.switcher.memory(g.spec, jobs, watch=HOLDER_WATCH_SECONDS,  # type: ignore[attr-defined]
                                                       low_free=low))
        self._poll = _Poll(frozenset(jobs), low)
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({poll, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._poll = None
            woken.cancel()
            if not poll.done():
                poll.cancel()
                await asyncio.wait({poll})
        return poll.result() if not poll.cancelled() else _WOKEN

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or until the watch is woken (`start`)."""
        if seconds <= 0:
            return
        woken = asyncio.ensure_future(self._wake.wait())
        try:  # (not wait_for: on 3.11 it swallows a cancel that comes as the event is set, and close hangs)
            await asyncio.wait({woken}, timeout=seconds)
        finally:
            woken.cancel()

    async def _answered(self, snap: MemorySnapshot) -> bool:
        """Observe a watch's answer and act on it for whoever holds now (the answer may come
        after a later grant): True when the next watch is to begin at once (idle residents
        were checkpointed, or a switch in flight ended meanwhile)."""
        g = self._g
        g.residency.observe(snap)
        pin_if_moves_may_come(g)
        h = g.holder
        if h is None or not snap.devices:
            return False
        if g.moves.runner.switching is None:
            return await self._room_for_holder(snap, h.job_id)
        if room_for_holder(snap, g.residency.lru(excluding=[h.job_id]), parse_headroom(g.spec.memory_headroom)):
            await self._switch_ends()  # (then memory is looked at again: the switch may have changed it)
            return True
        return False

    async def _switch_ends(self) -> None:
        """Wait for the switch in flight to end (or the hold)."""
        g = self._g
        while g.moves.runner.switching is not None and g.holder is not None:
            task = g.moves.runner.task
            if task is not None and not task.done():
                await asyncio.wait({task})
            else:
                await asyncio.sleep(SWITCH_POLL_SECONDS)

    async def _room_for_holder(self, snap: MemorySnapshot, holder: str) -> bool:
        """Checkpoint idle residents on the GPUs where `snap` shows less free than the
        headroom; True when it did."""
        g, r = self._g, self._g.residency
        evict = room_for_holder(snap, r.lru(excluding=[holder]), parse_headroom(g.spec.memory_headroom))
        if not evict:
            return False
        log.warning("holder %s outgrew its reservation group=%s (free %s): checkpointing idle %s", holder,
                    g.id, {d: m.free for d, m in snap.devices.items()}, evict)
        r.unobserved()  # nothing samples the holder while they leave
        await g.moves.runner.make_room(evict, holder)
        return True
