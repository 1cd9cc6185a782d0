"""HolderWatch: a memory-aware lock group's watch of its holder's growth.

Owned by `MemoryMoves` (one per group), started at every grant. While a job holds, its node
agents report the GPUs' memory (the holder's peak among it); where the holder outgrew its
reservation, idle residents leave through the group's switch runner (`SwitchRunner.make_room`).
"""

from __future__ import annotations

import asyncio
import logging
import time
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


class HolderWatch:
    """The watch task of `group`'s holder (`task`: while it runs)."""

    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """While a job holds (memory-aware groups): learn its peak as it grows, and when a
        GPU's free memory falls under the headroom (the holder outgrew its reservation),
        checkpoint idle residents there, least recently held first, never the holder, before
        the holder runs out."""
        if self._g.moves.memory_aware and (self.task is None or self.task.done()):
            self.task = asyncio.get_running_loop().create_task(self._watch(), name=f"watch-{self._g.id}")

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
                pin_if_moves_may_come(g)
                if g.holder is h and snap.devices and await self._room_for_holder(snap, h.job_id):
                    continue
            quiet = bool(low) and snap is not None and any(m.free < low for m in snap.devices.values())
            if not quiet:  # an agent that answers at once (a test double) is asked again later
                await asyncio.sleep(max(0.0, HOLDER_WATCH_SECONDS - (time.monotonic() - started)))

    async def _room_for_holder(self, snap: MemorySnapshot, holder: str) -> bool:
        """Checkpoint idle residents on the GPUs where `snap` shows less free than the
        headroom; True when it did."""
        g, r = self._g, self._g.residency
        if g.moves.runner.switching is not None:
            return False
        evict = room_for_holder(snap, r.lru(excluding=[holder]), parse_headroom(g.spec.memory_headroom))
        if not evict:
            return False
        log.warning("holder %s outgrew its reservation group=%s (free %s): checkpointing idle %s", holder,
                    g.id, {d: m.free for d, m in snap.devices.items()}, evict)
        r.unobserved()  # nothing samples the holder while they leave
        await g.moves.runner.make_room(evict, holder)
        return True
