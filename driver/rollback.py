"""All or nothing over the parts of one step (a job's processes): undo the parts whose step
ran when another part's failed, and say what could not be undone.

Used by the node agent's backends (`backends.base.run_step`: a checkpoint or restore over a
job's processes) and the orchestrator's cooperative backend (a checkpoint over a job's
processes, `cooperative_steps.CooperativeSteps`). The switch over a group's node agents undoes per
agent (`switch.SwitchCoordinator`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

log = logging.getLogger("timeslice.rollback")
T = TypeVar("T")


async def undo(done: Sequence[T], inverse: Callable[[T], Awaitable[object]], name: Callable[[T], str],
               failure: str) -> str:
    """Run `inverse` on every part of `done` at once. Returns the note for the step's error:
    "rolled back N process(es)", or "ROLLBACK FAILED (<name>: <error>; ...)", then also logged
    as an error after `failure` (what failed, and why): those parts are left as the failed
    step left them."""
    results = await asyncio.gather(*(inverse(part) for part in done), return_exceptions=True)
    stuck = [f"{name(part)}: {err}" for part, err in zip(done, results) if isinstance(err, BaseException)]
    if not stuck:
        return f"rolled back {len(done)} process(es)"
    note = f"ROLLBACK FAILED ({'; '.join(stuck)})"
    log.error("%s; %s", failure, note)
    return note
