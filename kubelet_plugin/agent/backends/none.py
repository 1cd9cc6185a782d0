"""Backend `none`: lock hand-off only; processes keep their GPU state.

For workloads that manage their own memory (vLLM sleep mode, ...). The orchestrator
does not call agents for `none` groups; this backend exists so that an agent asked
for it answers truthfully.
"""

from __future__ import annotations

from collections.abc import Sequence

from timeslice.kubelet_plugin.agent.backends.base import RUNNING, Backend, ProcState


class NoneBackend(Backend):
    name = "none"

    async def checkpoint(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return [ProcState(pid, RUNNING) for pid in pids]

    async def restore(self, pids: Sequence[int], timeout: float) -> list[ProcState]:
        return [ProcState(pid, RUNNING) for pid in pids]

    async def state(self, pids: Sequence[int]) -> list[ProcState]:
        return [ProcState(pid, RUNNING) for pid in pids]
