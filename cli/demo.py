"""`timeslice demo`: the product's main job on one machine, no Kubernetes.

Runs the real orchestrator and node agent (same code as in the cluster) in this
process with two static groups, `solo` and `shared`, then starts synthetic RL jobs as
separate processes: each job is a client process (`demo_job`) plus an accelerator
worker process (`demo_worker`) that the agent checkpoints. First one job runs alone
(`duty_cycle_solo`), then `--jobs` jobs share the accelerator (`duty_cycle_shared`).

Backends: `freeze` (CPU: the worker computes on the CPU and is stopped while another
job holds the lock), `cuda` (GPU with PyTorch: the worker's tensors are checkpointed
to host memory), `none` (hand-off only), `auto` (cuda when a GPU, PyTorch and
cuda-bindings are present, else freeze).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from timeslice.cli import timeline
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.group_model import GroupEvent
from timeslice.controller.orchestrator.orchestrator import Orchestrator
from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server
from timeslice.driver import signals
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server


@dataclass(frozen=True)
class DemoConfig:
    """Times in seconds; `state_mb` MiB per CPU worker, `state_gb` GB per GPU worker."""

    jobs: int = 2
    rounds: int = 6
    backend: str = "auto"
    gen_seconds: float = 0.3
    reward_seconds: float = 0.3
    state_mb: int = 16
    state_gb: float = 1.0
    lease_seconds: float = 10.0
    max_hold_seconds: float | None = None  # the shared group's maxHoldSeconds (None: no limit)


def gpu_present() -> bool:
    """True when PyTorch, cuda-bindings and an NVIDIA GPU (NVML) are all present."""
    if not (importlib.util.find_spec("torch") and importlib.util.find_spec("cuda")):
        return False
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount()) > 0
    except Exception:
        return False


def pick_backend(name: str) -> str:
    return ("cuda" if gpu_present() else "freeze") if name == "auto" else name


class DemoRunner:
    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.backend = pick_backend(cfg.backend)
        self.mode = "gpu" if self.backend in ("cuda", "cuda-checkpoint") else "cpu"
        self.resolver = StaticProcessResolver()
        self.orchestrator: Orchestrator | None = None
        self.target = ""
        self.records: list[dict[str, Any]] = []  # the shared group's switches, all of them (status keeps 16)

    def observe(self, group: LockGroup, event: GroupEvent) -> None:
        """An orchestrator observer: keep the shared group's switch records."""
        if event.group_id == "shared" and event.record is not None:
            self.records.append({**vars(event.record), "seconds": event.record.seconds})

    async def run(self) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="timeslice-demo-") as tmp:
            agent_target = f"unix://{Path(tmp) / 'agent.sock'}"
            agent = NodeAgent(self.resolver, backends=[self.backend])
            agent_server, _ = await create_agent_server(agent, agent_target)
            agents = () if self.backend == "none" else (agent_target,)
            specs = [GroupSpec(id=g, backend=self.backend, agents=agents, lease_seconds=self.cfg.lease_seconds,
                               max_hold_seconds=self.cfg.max_hold_seconds)
                     for g in ("solo", "shared")]
            self.orchestrator = Orchestrator(specs, observer=self.observe)
            server, port = await create_orchestrator_server(self.orchestrator, "127.0.0.1:0")
            self.target = f"127.0.0.1:{port}"
            try:
                solo = await self.run_group("solo", 1)
                shared = await self.run_group("shared", self.cfg.jobs)
                return self.summary(solo, shared)
            finally:
                await server.stop(1)
                await agent_server.stop(1)
                await self.orchestrator.close()

    async def run_group(self, group: str, n: int) -> list[dict[str, Any]]:
        jobs = await asyncio.gather(*(self.run_job(group, f"{group}-job-{i}", i) for i in range(n)),
                                    return_exceptions=True)  # let the other jobs finish before failing
        failed = [j for j in jobs if isinstance(j, BaseException)]
        if failed:
            raise failed[0]
        return sorted((ev for evs in jobs for ev in evs), key=lambda e: e["granted"])  # type: ignore[union-attr]

    async def run_job(self, group: str, job: str, seed: int) -> list[dict[str, Any]]:
        """Start a job's worker and client processes; return the client's per-round events."""
        mine, theirs = socket.socketpair()
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "timeslice.cli.demo_worker", "--fd", str(theirs.fileno()),
            "--mode", self.mode, "--state-mb", str(self.cfg.state_mb), "--state-gb", str(self.cfg.state_gb),
            "--seed", str(seed), pass_fds=[theirs.fileno()],
            env={**os.environ, "TIMESLICE_ACCELERATOR_PROCESS": "1"})  # the process the agent moves
        theirs.close()
        self.resolver.set(job, [worker.pid])
        env = {**os.environ, "TIMESLICE_ORCHESTRATOR": self.target, "TIMESLICE_JOB": job,
               "TIMESLICE_GROUP": group}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "timeslice.cli.demo_job", "--worker-fd", str(mine.fileno()),
            "--rounds", str(self.cfg.rounds), "--gen-seconds", str(self.cfg.gen_seconds),
            "--reward-seconds", str(self.cfg.reward_seconds), pass_fds=[mine.fileno()], env=env,
            stdout=asyncio.subprocess.PIPE)
        mine.close()
        try:
            out, _ = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled (interrupted): the job goes first
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                await proc.wait()
            with contextlib.suppress(ProcessLookupError):
                worker.send_signal(signal.SIGCONT)  # a frozen worker cannot act on SIGTERM
                worker.terminate()
            await worker.wait()
            self.resolver.remove(job)
            assert self.orchestrator is not None
            self.orchestrator.drop_job(group, job, "demo job finished")  # its processes are gone first
        if proc.returncode != 0:
            raise RuntimeError(f"demo job {job} exited with {proc.returncode}")
        return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]

    def summary(self, solo: list[dict[str, Any]], shared: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.orchestrator is not None
        view = self.orchestrator.group("shared").view()
        handoffs = handoff_ms(shared)
        return {
            "jobs": self.cfg.jobs, "rounds": self.cfg.rounds, "backend": self.backend, "mode": self.mode,
            "gen_seconds": self.cfg.gen_seconds, "reward_seconds": self.cfg.reward_seconds,
            "switches": view.counters.switches, "failed_switches": view.counters.failed_switches,
            "max_hold_seconds": self.cfg.max_hold_seconds, "preemptions": view.counters.preemptions,
            "duty_cycle_solo": round(duty_cycle(solo), 4), "duty_cycle_shared": round(duty_cycle(shared), 4),
            "handoffs": len(handoffs),
            "handoff_ms_p50": round(percentile(handoffs, 50), 3), "handoff_ms_p99": round(percentile(handoffs, 99), 3),
            "switch_seconds_mean": round(statistics.fmean(r["seconds"] for r in self.records), 4)
            if self.records else 0.0,
            "switch_records": self.records,
            # unix minus monotonic seconds: the switch records' `finished_at_unix` on the timeline's clock
            "clock_offset_unix_seconds": time.time() - time.monotonic(),
            "data_ok": bool(shared) and all(e["check_ok"] for e in solo + shared)
            and len(shared) == self.cfg.jobs * self.cfg.rounds and len(solo) == self.cfg.rounds,
            "timeline": shared,
        }


def duty_cycle(events: list[dict[str, Any]]) -> float:
    """Busy fraction of the accelerator: union of compute intervals over the span."""
    if not events:
        return 0.0
    spans = sorted((e["gen_start"], e["gen_end"]) for e in events)
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e["released"] for e in events) - min(e["acquire"] for e in events)
    return busy / span if span > 0 else 0.0


def handoff_ms(events: list[dict[str, Any]]) -> list[float]:
    """Milliseconds from a holder's release to the next holder's grant, when that one waited
    (a grant before the release is a preemption, not a hand-off: left out)."""
    out = []
    for prev, nxt in itertools.pairwise(events):
        if prev["job"] != nxt["job"] and nxt["acquire"] < prev["release"] <= nxt["granted"]:
            out.append((nxt["granted"] - prev["release"]) * 1000.0)
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


# The fields of the summary line, in order.
SUMMARY_KEYS = ("jobs", "rounds", "backend", "switches", "failed_switches", "preemptions", "duty_cycle_solo",
                "duty_cycle_shared", "handoff_ms_p50", "handoff_ms_p99", "switch_seconds_mean", "data_ok")


def render(result: dict[str, Any], width: int = 72) -> str:
    """A per-job timeline (`#` computing, `.` reward, ` ` waiting) and the summary."""
    events = result["timeline"]
    lines = []
    if events:
        t0 = min(e["acquire"] for e in events)
        t1 = max(e["released"] for e in events)
        scale = width / max(t1 - t0, 1e-9)
        jobs = sorted({e["job"] for e in events})
        lines.append(f"timeline ({t1 - t0:.2f} s, one column = {1000 / scale:.0f} ms; # compute, . reward)")
        for job in jobs:
            row = [" "] * width
            mine = [e for e in events if e["job"] == job]
            for i, e in enumerate(mine):
                reward_end = mine[i + 1]["acquire"] if i + 1 < len(mine) else e["released"] + result["reward_seconds"]
                for a, b, ch in ((e["gen_start"], e["gen_end"], "#"), (e["released"], reward_end, ".")):
                    for c in range(int((a - t0) * scale), min(width, int((b - t0) * scale))):
                        row[c] = ch
            lines.append(f"  {job:>14} |{''.join(row)}|")
    lines.append("summary: " + ", ".join(f"{k}={result[k]}" for k in SUMMARY_KEYS if k in result))
    return "\n".join(lines)


async def _until_stopped(runner: DemoRunner) -> dict[str, Any] | None:
    """The demo's result, or None when SIGINT/SIGTERM/SIGHUP stopped it first (its jobs and
    workers are stopped, frozen ones thawed first, before this returns)."""
    stop = signals.stop_event()
    demo = asyncio.create_task(runner.run())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({demo, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if demo.done():
        return demo.result()
    demo.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await demo
    return None


def run(cfg: DemoConfig, as_json: bool, plot: str | None = None) -> int:
    """Run the demo; print its result (JSON or the text timeline) and, with `plot`, draw
    the timeline into that file (timeline.draw; needs the `plot` extra). Exit status."""
    try:
        result = asyncio.run(_until_stopped(DemoRunner(cfg)))
    except (RuntimeError, OSError) as err:
        print(f"timeslice demo failed: {err}", file=sys.stderr)
        return 1
    if result is None:
        print("timeslice demo: interrupted", file=sys.stderr)
        return 130
    if as_json:
        print(json.dumps(result))
    else:
        print(render(result))
    if plot:
        timeline.draw(timeline.timelines(result), plot)
    return 0 if result["data_ok"] else 1
