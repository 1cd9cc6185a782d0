#!/usr/bin/env python3
"""RL benchmark: N GRPO-shaped jobs (bench/rl_job.py) one after the other, then sharing one GPU.

Solo: each job runs alone with no client (`--no-orchestrator`), one after the other; the
baseline is the sum of their wall times. Shared: the N jobs start together and every GPU
phase holds the group `gpu` through the product: the same orchestrator, node agent
(NVML memory reports; the `cuda` backend's checkpoints) and client code as `timeslice
demo` and the cluster, wired in this process on loopback and a unix socket. For the
`cooperative` backend each job registers its model, optimizer and extra tensor
(`timeslice.torch.register`) and the orchestrator offers a pinned pool of `--pool-gb`.

Prints (and writes to --out) one JSON object per shared run:
  seconds_solo_sum, seconds_shared, gain (= seconds_solo_sum / seconds_shared), the same
  without process start-up (gain_phases), gpu_busy_fraction (union of GPU phases over the
  shared span), gpu_time_bound (sum of solo seconds / sum of solo GPU-busy seconds: the
  gain of a GPU kept 100% busy) and gain / gpu_time_bound, switches (count, seconds,
  bytes out and in, each record), hand-off milliseconds (a release to the next job's
  grant when it waited; p50, p99; "resident": neither a job's first grant nor one that
  moved memory), failed switches, the parameter hashes solo vs shared per seed
  (bitwise_equal), whether every job's extra tensor came through unchanged (extra_ok), and
  the mean seconds of each phase kind solo vs shared (a GPU phase that runs longer shared
  than alone: contention outside the lock, e.g. for the CPUs that launch its kernels), and
  every shared job's phases (`job_phases`: job -> [{kind, step, acquire, granted, done,
  released}], unix seconds). `--plot PNG` draws each shared run's timeline (one panel per
  backend: waits, GPU phases, checkpoints and restores with their bytes; timeslice.cli.timeline,
  the same as `timeslice demo --plot`; needs matplotlib: the `plot` extra); `timeslice plot
  RESULT.json` draws a saved result.
  Solo runs may come from an earlier run (--solo-json, same model and steps): the extra
  tensor is made once at start and only read at the end, so it changes no solo time that
  matters and no parameter.

With `--nproc R` each job is `torchrun --standalone --nproc-per-node R` (R data-parallel ranks on
GPUs 0..R-1, NCCL all-reduce in every train step, rl_job.py): the node agent finds the ranks as
the launcher's descendants, and the shared runs switch all of a job's ranks together. With
`--nccl-transparent` every job (solo too, so the math is the same) runs with NCCL's peer-to-peer
and shared-memory transports off (NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1): the transparent
backends refuse processes whose GPU memory other processes map (issue 14).

    python bench/rl_grpo.py --jobs 2 --extra-gb 7 --backends cuda cooperative --out bench/results/rl-grpo-a.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timeslice.cli import timeline  # noqa: E402
from timeslice.cli.demo import percentile  # noqa: E402
from timeslice.controller.orchestrator.config import GroupSpec  # noqa: E402
from timeslice.controller.orchestrator.group import LockGroup  # noqa: E402
from timeslice.controller.orchestrator.group_model import GroupEvent  # noqa: E402
from timeslice.controller.orchestrator.orchestrator import Orchestrator  # noqa: E402
from timeslice.controller.orchestrator.pinned_pool import PinnedPool  # noqa: E402
from timeslice.controller.orchestrator.server import create_server as create_orchestrator_server  # noqa: E402
from timeslice.driver import names  # noqa: E402
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent  # noqa: E402
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver  # noqa: E402
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server  # noqa: E402

from bench import machine  # noqa: E402

GROUP = "gpu"


def job_env(a: argparse.Namespace, **extra: str) -> dict[str, str]:
    return {**os.environ, **(names.NCCL_NO_PEER_MEMORY_ENV if a.nccl_transparent else {}), **extra}


def job_args(a: argparse.Namespace, seed: int) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc)] \
        if a.nproc > 1 else [sys.executable]
    return [*launcher, str(ROOT / "bench" / "rl_job.py"), "--seed", str(seed), "--size", a.size,
            "--steps", str(a.steps), "--batch", str(a.batch), "--new-tokens", str(a.new_tokens),
            "--reward-seconds", str(a.reward_seconds), "--extra-gb", str(a.extra_gb), "--device", a.device,
            "--group", GROUP, *(["--init-hold"] if a.init_hold else [])]


async def run_job(argv: list[str], env: dict[str, str], started: asyncio.Queue[int] | None = None) -> dict[str, Any]:
    # a session of its own: a failed run kills the whole job (torchrun and its ranks)
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE, start_new_session=True)
    if started is not None:
        started.put_nowait(proc.pid)
    try:
        out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:  # another job failed: this one goes too (it holds GPU memory)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])[:200]} exited with {proc.returncode}")
    return json.loads(out.decode().strip().splitlines()[-1])


async def solo(a: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for i in range(a.jobs):
        t0 = time.time()
        r = await run_job([*job_args(a, i), "--no-orchestrator"], job_env(a))
        r["wall_seconds"] = time.time() - t0
        results.append(r)
        print(f"solo seed={i} seconds={r['wall_seconds']:.1f} busy={r['gpu_busy_seconds']:.1f}", file=sys.stderr)
    return results


async def shared(a: argparse.Namespace, backend: str, tmp: Path) -> dict[str, Any]:
    resolver = StaticProcessResolver(descendants=True)  # torchrun's ranks
    agent_target = f"unix://{tmp / f'agent-{backend}.sock'}"
    agent = NodeAgent(resolver, backends=[backend] if backend in ("cuda", "cuda-checkpoint") else ["none"])
    agent_server, _ = await create_agent_server(agent, agent_target)
    records: list[dict[str, Any]] = []

    def observe(group: LockGroup, ev: GroupEvent) -> None:
        if ev.record is not None:
            records.append({**vars(ev.record), "seconds": ev.record.seconds})

    t_pool = time.monotonic()
    pool = PinnedPool(Path(a.pool_dir) / f"timeslice-pool-{os.getpid()}", int(a.pool_gb * 1e9), populate=True) \
        if backend == "cooperative" and a.pool_gb > 0 else None
    pool_setup = time.monotonic() - t_pool
    spec = GroupSpec(id=GROUP, backend=backend, agents=(agent_target,), residency=a.residency,
                     memory_headroom=a.headroom, resident_first_seconds=a.resident_first,
                     lease_seconds=60.0, step_timeout_seconds=600.0)
    orch = Orchestrator([spec], observer=observe, pinned_pool=pool)
    server, port = await create_orchestrator_server(orch, "127.0.0.1:0")
    try:
        started: asyncio.Queue[int] = asyncio.Queue()
        tasks = []
        t0 = time.time()
        async with asyncio.TaskGroup() as tg:  # one job failing stops the others
            for i in range(a.jobs):
                env = job_env(a, TIMESLICE_ORCHESTRATOR=f"127.0.0.1:{port}", TIMESLICE_JOB=f"job-{i}")
                argv = [*job_args(a, i), "--register", "all" if backend == "cooperative" else "none"]
                tasks.append(tg.create_task(run_job(argv, env, started)))
                resolver.set(f"job-{i}", [await started.get()])
        jobs = [t.result() for t in tasks]
        seconds = time.time() - t0
        view = orch.group(GROUP).view()
        return {"backend": backend, "seconds": seconds, "jobs": jobs, "switches": records, "pool_setup": pool_setup,
                "failed_switches": view.counters.failed_switches, "peaks": view.peaks,
                "memory": {d: vars(m) for d, m in view.memory.devices.items()} if view.memory else {}}
    finally:
        await server.stop(1)
        await agent_server.stop(1)
        await orch.close()


def busy_union(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def handoffs(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each grant that waited for another job's release: milliseconds from that release (the
    end of its GPU work, so the release RPC counts); `first`: the job's first grant (it was not
    resident yet: the orchestrator asks the node agent for memory before it)."""
    phases = sorted(((p, j["seed"], i == 0) for j in jobs for i, p in enumerate(j["phases"])),
                    key=lambda x: x[0]["granted"])
    out = []
    for (prev, pj, _), (nxt, nj, first) in itertools.pairwise(phases):
        if pj != nj and nxt["acquire"] < prev["done"] <= nxt["granted"]:
            out.append({"ms": (nxt["granted"] - prev["done"]) * 1000.0, "at": nxt["granted"], "first": first})
    return out


def phase_seconds(jobs: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds from grant to synchronised end, per phase kind (generate, train, ...)."""
    spans: dict[str, list[float]] = {}
    for j in jobs:
        for p in j["phases"]:
            spans.setdefault(p["kind"], []).append(p["done"] - p["granted"])
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(spans.items())}


def summarize(a: argparse.Namespace, solo_runs: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any]:
    jobs = run["jobs"]
    solo_sum = sum(r["wall_seconds"] for r in solo_runs)
    solo_phases = sum(r["wall_seconds"] - r["startup_seconds"] for r in solo_runs)
    first = min(p["acquire"] for j in jobs for p in j["phases"])
    last = max(p["released"] for j in jobs for p in j["phases"])
    busy = busy_union([(p["granted"], p["done"]) for j in jobs for p in j["phases"]])
    bound = solo_sum / sum(r["gpu_busy_seconds"] for r in solo_runs)
    gain = solo_sum / run["seconds"]
    sw = run["switches"]
    moved_at = [s["finished_at_unix"] for s in sw if s["ok"] and (s["bytes_checkpointed"] or s["bytes_restored"])]
    ho = handoffs(jobs)
    resident_ho = [h["ms"] for h in ho if not h["first"] and not any(abs(h["at"] - t) < 1.0 for t in moved_at)]
    hashes = {j["seed"]: j["param_hash"] for j in jobs}
    solo_hashes = {r["seed"]: r["param_hash"] for r in solo_runs}
    return {
        "benchmark": "rl_grpo", "backend": run["backend"], "residency": a.residency, "memory_headroom": a.headroom,
        "resident_first_seconds": a.resident_first,
        "jobs": a.jobs, "size": a.size, "params": jobs[0]["params"], "steps": a.steps, "batch": a.batch,
        "new_tokens": a.new_tokens, "reward_seconds": a.reward_seconds, "extra_gb": a.extra_gb,
        "pool_gb": a.pool_gb if run["backend"] == "cooperative" else 0,
        "peak_allocated_gb": [round(j["peak_allocated_bytes"] / 1e9, 2) for j in jobs],
        "seconds_solo_sum": round(solo_sum, 2), "seconds_shared": round(run["seconds"], 2),
        "gain": round(gain, 3),
        "gain_phases": round(solo_phases / (last - first), 3),
        "gpu_busy_fraction": round(busy / (last - first), 3),
        "gpu_time_bound": round(bound, 3), "gain_vs_bound": round(gain / bound, 3),
        "switches": len(sw), "failed_switches": run["failed_switches"],
        "switch_seconds": [round(s["seconds"], 3) for s in sw],
        "switch_gb_out": [round(s["bytes_checkpointed"] / 1e9, 2) for s in sw],
        "switch_gb_in": [round(s["bytes_restored"] / 1e9, 2) for s in sw],
        "bytes_moved": sum(s["bytes_checkpointed"] + s["bytes_restored"] for s in sw),
        "switch_errors": [s["error"] for s in sw if not s["ok"]],
        "handoffs": len(ho), "handoff_ms_p50": round(percentile([h["ms"] for h in ho], 50), 3),
        "handoff_ms_p99": round(percentile([h["ms"] for h in ho], 99), 3),
        "handoffs_resident": len(resident_ho),
        "handoff_resident_ms_p50": round(percentile(resident_ho, 50), 3),
        "handoff_resident_ms_p99": round(percentile(resident_ho, 99), 3),
        "param_hash_solo": solo_hashes, "param_hash_shared": hashes,
        "bitwise_equal": all(solo_hashes.get(s) == h for s, h in hashes.items()),
        "extra_ok": all(j["extra_ok"] for j in jobs),
        "ranks": a.nproc, "nccl_transparent": a.nccl_transparent,
        "allreduce_ok": all(all(j.get("allreduce_ok", [])) for j in jobs),
        "allreduce_checks": sum(len(j.get("allreduce_ok", [])) for j in jobs),
        "pool_setup_seconds": round(run["pool_setup"], 2),
        "solo_seconds": [round(r["wall_seconds"], 2) for r in solo_runs],
        "solo_gpu_busy_seconds": [round(r["gpu_busy_seconds"], 2) for r in solo_runs],
        "shared_job_seconds": [round(j["total_seconds"], 2) for j in jobs],
        "startup_seconds": [round(j["startup_seconds"], 2) for j in jobs],
        "phase_seconds_solo": phase_seconds(solo_runs), "phase_seconds_shared": phase_seconds(jobs),
        "memory_after": run["memory"], "switch_records": sw,
        "job_phases": {f"job-{j['seed']}": j["phases"] for j in jobs},
    }


async def main_async(a: argparse.Namespace, solo_runs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    solo_runs = solo_runs or await solo(a)
    if a.save_solo:
        await asyncio.to_thread(Path(a.save_solo).write_text, json.dumps(solo_runs))
    out = []
    with tempfile.TemporaryDirectory(prefix="rl-grpo-") as tmp:
        for backend in a.backends:
            run = await shared(a, backend, Path(tmp))
            result = {**summarize(a, solo_runs, run), "solo_source": a.solo_json or "measured in this run"}
            print(json.dumps({k: v for k, v in result.items()
                              if k not in ("switch_records", "memory_after", "job_phases")}),
                  file=sys.stderr)
            out.append(result)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--backends", nargs="*", default=["cuda", "cooperative"],
                   choices=["cuda", "cuda-checkpoint", "cooperative", "none"])
    p.add_argument("--residency", choices=["auto", "exclusive"], default="auto")
    p.add_argument("--headroom", default="10%", help="memoryHeadroom: percent of GPU memory or a quantity")
    p.add_argument("--resident-first", type=float, default=30.0,
                   help="residentFirstSeconds: how long resident waiters may pass one that needs a switch")
    p.add_argument("--size", default="1b", choices=["tiny", "small", "1b"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reward-seconds", type=float, default=3.0)
    p.add_argument("--extra-gb", type=float, default=0.0, help="extra resident GB per job (sizes its footprint)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--nproc", type=int, default=1, help="ranks per job (torchrun, one GPU each)")
    p.add_argument("--nccl-transparent", action="store_true",
                   help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 for every job (solo too)")
    p.add_argument("--init-hold", action="store_true", help="jobs make their GPU state inside a hold (rl_job.py)")
    p.add_argument("--pool-gb", type=float, default=0.0, help="cooperative: the node's pinned pool, GB (0: none)")
    p.add_argument("--pool-dir", default="/dev/shm", help="where the pinned pool file lives (a memory filesystem)")
    p.add_argument("--solo-json", help="reuse solo runs saved by --save-solo (same steps and model)")
    p.add_argument("--save-solo", help="write the solo runs here")
    p.add_argument("--out", help="write the JSON list of results here")
    p.add_argument("--plot", metavar="PNG", help="draw the shared runs' timelines into this image (needs matplotlib)")
    a = p.parse_args()
    if a.plot:
        try:
            timeline.require_matplotlib()  # before the runs, not after
        except ModuleNotFoundError:
            print(f"rl_grpo.py: error: --plot needs matplotlib, which is not installed: {timeline.INSTALL}",
                  file=sys.stderr)
            sys.exit(2)
    solo_runs = json.loads(Path(a.solo_json).read_text())[: a.jobs] if a.solo_json else None
    if solo_runs is not None and len(solo_runs) < a.jobs:
        p.error(f"--solo-json holds {len(solo_runs)} solo runs, --jobs is {a.jobs}")
    results = asyncio.run(main_async(a, solo_runs))
    with contextlib.suppress(Exception):
        results = [{**r, "machine": machine.describe(),
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())} for r in results]
    text = json.dumps(results, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if a.plot:
        timeline.draw(timeline.timelines(results), a.plot)


if __name__ == "__main__":
    main()
