#!/usr/bin/env python3
"""Hand-off latency of the orchestrator with the `none` backend, over loopback.

Starts `timeslice orchestrator` as its own process with G groups, then J jobs per
group as real clients (`AsyncTimeSliceOrchestratorClient`, spread over P load
processes). Every job loops: acquire, hold H seconds, release, acquire again, so each
release hands the lock to a waiter. Hand-off latency is the time from the holder's
`release()` call to the next holder's `acquire()` return (CLOCK_MONOTONIC, shared by
all processes on Linux). `--state-file`: the orchestrator keeps a state file, as a
standalone one does (each grant that changes a holder is delivered once written). Rates:
`handoffs_per_second` over the whole run (the load processes' start-up, 4000 clients
connecting, and the last holds included), `handoffs_per_second_steady` while every job is
in its loop (from the last job's first grant to the first stop). Prints one JSON object
(and writes it with --out).

    python bench/handoff.py --groups 100 --jobs 8 --hold 0.2 --seconds 20 --out bench/results/handoff.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import emit, free_port


async def run_group_jobs(target: str, groups: list[str], jobs: int, hold: float,
                         seconds: float) -> tuple[list[tuple[float, float]], float, float]:
    """Run the jobs of `groups`: ([(grant time, hand-off latency in ms)], when every job had its
    first grant, when the jobs stopped acquiring; CLOCK_MONOTONIC seconds). Hold times are uniform in
    [hold/2, 3*hold/2] and each group starts at a random offset, so groups are
    independent (as RL jobs are) rather than releasing in lock-step bursts."""
    from timeslice import AsyncTimeSliceOrchestratorClient

    rng = random.Random(len(groups))

    events: dict[str, list[tuple[float, float, bool]]] = {g: [] for g in groups}  # (granted, released, waited)
    first_grants: list[float] = []
    offsets = {g: rng.uniform(0, hold) for g in groups}
    stop_at = time.monotonic() + seconds

    async def job(group: str, j: int) -> None:
        client = AsyncTimeSliceOrchestratorClient(target, f"{group}-job-{j}", group)
        await asyncio.sleep(offsets[group])
        gc.freeze()
        t_first = None
        try:
            while time.monotonic() < stop_at:
                t_acq = time.monotonic()
                t_first = t_first or t_acq
                await client.acquire()
                t_granted = time.monotonic()
                if t_acq == t_first:
                    first_grants.append(t_granted)
                await asyncio.sleep(hold * rng.uniform(0.5, 1.5))
                t_release = time.monotonic()
                events[group].append((t_granted, t_release, t_granted - t_acq > hold / 2))
                await client.release()
        finally:
            await client.close()

    await asyncio.gather(*(job(g, j) for g in groups for j in range(jobs)))
    handoffs = []
    for evs in events.values():
        evs.sort()
        for prev, nxt in itertools.pairwise(evs):
            if nxt[2]:  # the next holder had been waiting: a real hand-off
                handoffs.append((nxt[0], (nxt[0] - prev[1]) * 1000.0))
    return handoffs, max(first_grants, default=stop_at), stop_at


def load_process(target: str, groups: list[str], jobs: int, hold: float, seconds: float, q: mp.Queue) -> None:
    q.put(asyncio.run(run_group_jobs(target, groups, jobs, hold, seconds)))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--jobs", type=int, default=8, help="jobs per group")
    p.add_argument("--hold", type=float, default=0.2, help="seconds each grant is held")
    p.add_argument("--seconds", type=float, default=20.0, help="measured duration")
    p.add_argument("--procs", type=int, default=2, help="client load processes")
    p.add_argument("--state-file", action="store_true",
                   help="give the orchestrator a state file (in a temporary directory), as a standalone one keeps")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()

    port = free_port()
    groups = [f"g{i:03d}" for i in range(a.groups)]
    state_dir = tempfile.TemporaryDirectory(prefix="handoff-state-")
    config = {"listen": f"127.0.0.1:{port}", "groups": [{"id": g, "backend": "none"} for g in groups]}
    if a.state_file:
        config["state_file"] = str(Path(state_dir.name) / "state.json")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config, f)
    orch = subprocess.Popen([sys.executable, "-m", "timeslice.cli.main", "orchestrator", "--config", f.name,
                             "--log-level", "WARNING", *([] if a.state_file else ["--no-state-file"])])
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=30)
        # spawned, not forked: this process has a gRPC channel open above, and a child forked from it
        # can hang in its first channel's set-up (a run hung so in grpc.aio.Channel.__init__)
        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        shards = [groups[i::a.procs] for i in range(a.procs)]
        procs = [ctx.Process(target=load_process, args=(f"127.0.0.1:{port}", s, a.jobs, a.hold, a.seconds, q))
                 for s in shards if s]
        t0 = time.monotonic()
        for pr in procs:
            pr.start()
        runs = [q.get() for _ in procs]
        for pr in procs:
            pr.join()
        wall = time.monotonic() - t0
    finally:
        orch.terminate()
        orch.wait()
        os.unlink(f.name)
        state_dir.cleanup()
    latencies = [ms for handoffs, _, _ in runs for _, ms in handoffs]
    # the steady window: every job of every load process in its loop (all first grants in), none stopped yet
    begin, end = max(r[1] for r in runs), min(r[2] for r in runs)
    steady = sum(begin <= t < end for handoffs, _, _ in runs for t, _ in handoffs)
    result = {
        "benchmark": "handoff", "backend": "none", "transport": "tcp 127.0.0.1", "state_file": a.state_file,
        "groups": a.groups, "jobs_per_group": a.jobs, "hold_seconds": a.hold, "seconds": a.seconds,
        "load_processes": a.procs, "handoffs": len(latencies), "handoffs_per_second": round(len(latencies) / wall, 1),
        "steady_seconds": round(end - begin, 2),
        "handoffs_per_second_steady": round(steady / (end - begin), 1) if end > begin else None,
        "handoff_ms_p50": round(pct(latencies, 50), 3), "handoff_ms_p90": round(pct(latencies, 90), 3),
        "handoff_ms_p99": round(pct(latencies, 99), 3), "handoff_ms_max": round(max(latencies), 3),
        "handoff_ms_mean": round(statistics.fmean(latencies), 3),
    }
    emit(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
