"""A node agent on the `freeze` backend (or, with STALL_BACKEND=cuda, the `cuda` one) that
stops at one point of a step, for the fault suites (no hook in the product: the stalls are
subclasses here).

    python stalling_agent.py TARGET RECORDS MARKER GO POINT JOB=PID[,PID...] [JOB=PID[,PID...] ...]

The first time it reaches POINT it writes the point's name to MARKER, then waits until the
file GO exists (a test that kills it there never creates it). Points: in the backend,
`checkpoint:before`, `checkpoint:after`, `restore:before`, `restore:after`; in the records'
synchronous writes, where the whole agent stops, `checkpoint:recorded` (a checkpoint's
record written) and `restore:recorded` (a restore's record dropped). Prints "serving" once
it serves.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from timeslice.kubelet_plugin.agent.backends.base import Backend
from timeslice.kubelet_plugin.agent.backends.freeze import FreezeBackend
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.records import JobRecords
from timeslice.kubelet_plugin.agent.server import create_server

POLL_SECONDS = 0.01


class Stall:
    def __init__(self, point: str, marker: Path, go: Path) -> None:
        self.point, self.marker, self.go = point, marker, go

    def reached(self, here: str) -> bool:
        """True (and the marker written) the first time `here` is the point."""
        if here != self.point or self.marker.exists():  # the first time only
            return False
        self.marker.write_text(here)
        return True

    def blocking_at(self, here: str) -> None:
        """Stop the calling thread here (at the point, the first time) until GO exists."""
        if self.reached(here):
            while not self.go.exists():
                time.sleep(POLL_SECONDS)

    async def at(self, here: str) -> None:
        """Stop this step here (the agent goes on serving others) until GO exists."""
        await asyncio.to_thread(self.blocking_at, here)


def faulty_backend(stall: Stall) -> Backend:
    base: type[Backend] = FreezeBackend
    if os.environ.get("STALL_BACKEND") == "cuda":
        from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend

        base = CudaBackend

    class Faulty(base):  # type: ignore[valid-type,misc]
        async def checkpoint(self, pids, timeout):  # type: ignore[no-untyped-def]
            await stall.at("checkpoint:before")
            states = await super().checkpoint(pids, timeout)
            await stall.at("checkpoint:after")
            return states

        async def restore(self, pids, timeout):  # type: ignore[no-untyped-def]
            await stall.at("restore:before")
            states = await super().restore(pids, timeout)
            await stall.at("restore:after")
            return states

    return Faulty(lock_timeout=10.0) if base is not FreezeBackend else Faulty()


def faulty_records(path: Path, stall: Stall) -> JobRecords:
    class FaultyRecords(JobRecords):
        def put(self, job_id, record):  # type: ignore[no-untyped-def]
            super().put(job_id, record)
            if record.phase == "checkpointed":
                stall.blocking_at("checkpoint:recorded")

        def pop(self, job_id, restored_by=""):  # type: ignore[no-untyped-def]
            record = super().pop(job_id, restored_by)
            stall.blocking_at("restore:recorded")
            return record

    return FaultyRecords(path)


async def main(argv: list[str]) -> None:
    target, records, marker, go, point, *jobs = argv
    stall = Stall(point, Path(marker), Path(go))
    table = {job: [int(p) for p in pids.split(",")] for job, pids in (j.split("=", 1) for j in jobs)}
    agent = NodeAgent(StaticProcessResolver(table), backends=[faulty_backend(stall)], records_path=Path(records))
    agent.records = faulty_records(Path(records), stall)
    server, _ = await create_server(agent, target)  # kept: a collected server stops serving
    print("serving", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
