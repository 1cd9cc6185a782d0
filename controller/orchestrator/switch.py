"""SwitchCoordinator: the switch transaction over every node agent of a group.

Owned by the orchestrator; called by `LockGroup` when a waiter that is not resident
is to be granted. Steps (DESIGN.md): checkpoint the outgoing job on all nodes (in
parallel), then restore the incoming job on all nodes, then the group grants.
Rollback: a failed checkpoint restores the outgoing job where it was checkpointed;
a failed restore checkpoints the incoming job where it was restored and restores the
outgoing job everywhere. The outcome is raised as `SwitchError` with the record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence

from timeslice.controller.orchestrator.agents import AgentClient, AgentPool, StepResult
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group import SwitchError, SwitchRecord
from timeslice.driver.errors import NotFound

log = logging.getLogger("timeslice.switch")


class SwitchCoordinator:
    def __init__(self, pool: AgentPool) -> None:
        self._pool = pool

    async def __call__(self, spec: GroupSpec, outgoing: str | None, incoming: str,
                       restore: bool) -> SwitchRecord:
        rec = SwitchRecord(outgoing, incoming)
        if outgoing is not None:
            t0 = time.monotonic()
            done, failures = await self._on_all(self._agents(spec, outgoing), "checkpoint", spec, outgoing)
            # A node where the outgoing job has no live process has nothing to move.
            failures = {a: e for a, e in failures.items() if not isinstance(e, NotFound)}
            rec.checkpoint_seconds = time.monotonic() - t0
            rec.bytes_checkpointed = sum(r.bytes for r in done.values())
            if failures:
                back = await self._undo(self._current(done), "restore", spec, outgoing)
                raise self._failed(rec, f"checkpoint of {outgoing} failed", failures, back)
        if restore:
            t0 = time.monotonic()
            done, failures = await self._on_all(self._agents(spec, incoming), "restore", spec, incoming)
            rec.restore_seconds = time.monotonic() - t0
            rec.bytes_restored = sum(r.bytes for r in done.values())
            if failures:
                await self._undo(self._current(done), "checkpoint", spec, incoming)
                back = outgoing is None or await self._undo(self._agents(spec, outgoing), "restore", spec, outgoing)
                raise self._failed(rec, f"restore of {incoming} failed", failures, back)
        return rec

    def _agents(self, spec: GroupSpec, job: str) -> list[AgentClient]:
        """The agents of the nodes where `job` runs (all of the group's, in static mode)."""
        member = spec.member(job)
        targets = list(member.claims_by_agent) if member else spec.agents
        return [self._pool.get(t) for t in targets]

    def _current(self, agents: Iterable[AgentClient]) -> list[AgentClient]:
        """The pool's clients now for the targets of `agents` (a client is replaced, and its
        channel closed, when its agent's TLS certificate changes mid-switch)."""
        return [self._pool.get(a.target) for a in agents]

    async def _on_all(self, agents: Sequence[AgentClient], step: str, spec: GroupSpec,
                      job: str) -> tuple[dict[AgentClient, StepResult], dict[AgentClient, BaseException]]:
        member = spec.member(job)
        results = await asyncio.gather(
            *(getattr(a, step)(job, spec.backend, spec.id, spec.step_timeout_seconds, member) for a in agents),
            return_exceptions=True)
        done = {a: r for a, r in zip(agents, results) if isinstance(r, StepResult)}
        failures = {a: r for a, r in zip(agents, results) if not isinstance(r, StepResult)}
        for a, err in failures.items():
            log.warning("%s failed group=%s job=%s agent=%s: %s", step, spec.id, job, a.target, err)
        return done, failures

    async def _undo(self, agents: Sequence[AgentClient], step: str, spec: GroupSpec, job: str) -> bool:
        """Run the compensating step; True when it succeeded on every agent."""
        if not agents:
            return True
        _, failures = await self._on_all(agents, step, spec, job)
        if failures:
            log.error("rollback %s incomplete group=%s job=%s agents=%s", step, spec.id, job,
                      ",".join(a.target for a in failures))
        return not failures

    @staticmethod
    def _failed(rec: SwitchRecord, what: str, failures: dict[AgentClient, BaseException],
                rolled_back: bool) -> SwitchError:
        causes = "; ".join(f"{a.target}: {err}" for a, err in failures.items())
        rec.ok = False
        rec.error = f"{what} ({causes}); " + ("rolled back" if rolled_back else "ROLLBACK INCOMPLETE")
        return SwitchError(rec.error, rec, outgoing_resident=rolled_back and rec.from_job is not None)
