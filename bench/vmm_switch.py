"""Switches of unmodified CUDA jobs by backend `vmm`, timed through the node agent's own backend.

    python3 bench/vmm_switch.py --gb 50 --switches 10 --out bench/results/vmm-switch-h200.json

Starts two jobs (bench/vmm_job.py: plain PyTorch, started with the shim in LD_PRELOAD as `timeslice
serve` says), each filling --gb GB of device memory and capturing a CUDA graph; each is handed the
node's pinned pool as it starts, as a node agent does when a memory report first names it
(`VmmBackend.seen`, default size). Then A is checkpointed, and each switch moves the holder out and
the other job in (`VmmBackend.checkpoint` then `.restore`, the node agent's code), after which the
job now on the GPU replays its graph and checks its tensors bitwise against what it had before any
switch. Writes per switch the seconds out and in, the bytes, and what the jobs verified (the
agent's log lines say how long each checkpoint waited for host memory); exits 1 when a
verification failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from timeslice.driver import vmm_shim
from timeslice.kubelet_plugin.agent.backends.vmm import VmmBackend

HERE = Path(__file__).resolve().parent


async def start_job(gb: float, seed: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(sys.executable, str(HERE / "vmm_job.py"), str(gb), str(seed),
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                env=vmm_shim.preload_env())
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode()
    if not line.startswith("ready"):
        raise SystemExit(f"job {seed} did not start: {line!r}")
    return proc


async def verify(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"verify\n")
    await proc.stdin.drain()
    return (await proc.stdout.readline()).decode().strip()


def gpu_used_bytes() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout.split()
    return int(out[0]) * 2**20 if out else -1


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=50.0, help="GB of device memory per job")
    ap.add_argument("--switches", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for one step")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    backend = VmmBackend(lock_timeout=args.timeout)
    jobs = []
    for seed in (1, 2):
        jobs.append(await start_job(args.gb, seed))
        backend.seen([jobs[-1].pid])
    pids = [[j.pid] for j in jobs]
    used_both = gpu_used_bytes()
    t = time.perf_counter()
    first = await backend.checkpoint(pids[0], args.timeout)
    first_out = time.perf_counter() - t
    used_one = gpu_used_bytes()
    switches, failed = [], 0
    holder = 1
    for i in range(args.switches):
        t0 = time.perf_counter()
        out = await backend.checkpoint(pids[holder], args.timeout)
        t1 = time.perf_counter()
        inn = await backend.restore(pids[1 - holder], args.timeout)
        t2 = time.perf_counter()
        holder = 1 - holder
        verified = await verify(jobs[holder])
        failed += verified != "verified ok"
        switches.append({"switch": i + 1, "out_seconds": round(t1 - t0, 3), "in_seconds": round(t2 - t1, 3),
                         "seconds": round(t2 - t0, 3), "out_bytes": out[0].gpu_bytes, "in_bytes": inn[0].gpu_bytes,
                         "verified": verified})
        print(json.dumps(switches[-1]), flush=True)
    await backend.restore(pids[1 - holder], args.timeout)
    final = [await verify(j) for j in jobs]
    failed += sum(v != "verified ok" for v in final)
    for j in jobs:
        assert j.stdin is not None
        j.stdin.write(b"quit\n")
        await j.stdin.drain()
        await j.wait()
    result = {
        "benchmark": "vmm_switch", "gb_per_job": args.gb, "bytes_per_job": first[0].gpu_bytes,
        "first_checkpoint_seconds": round(first_out, 3),
        "gpu_used_bytes": {"both_jobs": used_both, "one_checkpointed": used_one},
        "switches": switches, "final_verified": final, "verification_failures": failed,
        "switch_seconds_max": max(s["seconds"] for s in switches) if switches else None,
        "pinned_pool_bytes": backend.pinned_free_bytes(),  # (all free again: both jobs run)
        "machine": machine_name(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if failed else 0


def machine_name() -> str:
    return os.environ.get("TIMESLICE_MACHINE") or subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
