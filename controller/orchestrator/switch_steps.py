"""SwitchSteps: one step of a switch (a checkpoint or a restore of one job) on every target that moves it.

Used by `SwitchCoordinator` (switch.py), whose transaction orders the steps and undoes them. A job's
targets are the node agents of the nodes where it runs (`AgentClient`s of the `AgentPool`), or, on the
`cooperative` backend, its own processes (`CooperativeJobs`, behind the same step calls).

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
from collections.abc import Iterable, Sequence
from typing import Any

from timeslice.controller.orchestrator.agent_pool import AgentPool
from timeslice.controller.orchestrator.agents import AgentClient, StepResult, new_operation_id
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.cooperative import CooperativeJobs
from timeslice.driver import names
from timeslice.driver.errors import OutcomeUnknown, TimeSliceServerError, Unavailable

log = logging.getLogger("timeslice.switch")

# Resends of a step whose reply was lost stop after the step's timeout or this long, which
# comes first (seconds): room for a node agent to restart, without holding a group whose
# node is down for the default 300 s step timeout.
RESEND_WINDOW_SECONDS = 30.0
# Backoff between resends: the first wait, doubled after each resend, and its cap (seconds).
RESEND_BACKOFF_SECONDS = 0.1
RESEND_BACKOFF_MAX_SECONDS = 1.0


class SwitchSteps:
    """`pool`: the node-agent clients; `cooperative`: the processes of `cooperative` groups,
    which move their own state."""

    def __init__(self, pool: AgentPool, cooperative: CooperativeJobs) -> None:
        self._pool = pool
        self.cooperative = cooperative

    def targets(self, spec: GroupSpec, job: str) -> list[AgentClient | _CooperativeStep]:
        """Who moves `job`: its processes (cooperative), else the agents of the nodes where it
        runs (all of the group's, in static mode)."""
        if spec.backend == names.BACKEND_COOPERATIVE:
            return [_CooperativeStep(self.cooperative)]
        member = spec.member(job)
        targets = list(member.claims_by_agent) if member else spec.agents
        return [self._pool.get(t) for t in targets]

    def current(self, agents: Iterable[AgentClient | _CooperativeStep]) -> list[AgentClient | _CooperativeStep]:
        """The pool's clients now for the targets of `agents` (a client is replaced, and its
        channel closed, when its agent's TLS certificate changes mid-switch)."""
        return [a if isinstance(a, _CooperativeStep) else self._pool.get(a.target) for a in agents]

    async def on_all(self, agents: Sequence[AgentClient | _CooperativeStep], step: str, spec: GroupSpec,
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

    async def undo(self, agents: Sequence[AgentClient | _CooperativeStep], step: str, spec: GroupSpec,
                   job: str) -> bool:
        """Run the compensating step; True when it succeeded on every agent."""
        if not agents:
            return True
        _, failures = await self.on_all(agents, step, spec, job)
        if failures:
            log.error("rollback %s incomplete group=%s job=%s agents=%s", step, spec.id, job,
                      ",".join(a.target for a in failures))
        return not failures


def may_have_run(failures: dict[Any, BaseException]) -> list[Any]:
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
