#!/usr/bin/env python3
"""Checkpoint and restore speed of the `cuda` backend on this GPU (needs root, PyTorch).

For each size, starts bench/gpu_holder.py holding an int64 tensor of that many GB,
then checkpoints and restores it through the node agent's `CudaBackend` (the product
code), timing each step and checking the tensor's sum afterwards. Prints one JSON
object (and writes it with --out).

    sudo python bench/checkpoint_speed.py --sizes 1 8 32 --out bench/results/checkpoint-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import emit  # noqa: E402


async def measure(gb: float) -> dict[str, object]:
    from timeslice.kubelet_plugin.agent.backends.cuda import CudaBackend
    from timeslice.kubelet_plugin.agent.gpu_memory import process_gpu_bytes

    child = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_holder.py"), str(gb)],  # noqa: ASYNC220
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        size = int(child.stdout.readline().split()[1])

        def ask(cmd: str) -> str:
            child.stdin.write(cmd + "\n")
            child.stdin.flush()
            return child.stdout.readline().strip()

        before = ask("sum")
        backend = CudaBackend(lock_timeout=10.0)
        gpu_before = process_gpu_bytes().get(child.pid, 0)
        t0 = time.monotonic()
        procs = await backend.checkpoint([child.pid], timeout=600)
        t_ckpt = time.monotonic() - t0
        gpu_after = process_gpu_bytes().get(child.pid, 0)
        state_after_ckpt = (await backend.state([child.pid]))[0].state
        t0 = time.monotonic()
        await backend.restore([child.pid], timeout=600)
        t_restore = time.monotonic() - t0
        after = ask("sum")
        ask("exit")
        return {"gb": gb, "bytes": size, "checkpoint_seconds": round(t_ckpt, 3),
                "restore_seconds": round(t_restore, 3),
                "checkpoint_gb_per_s": round(size / 1e9 / t_ckpt, 2),
                "restore_gb_per_s": round(size / 1e9 / t_restore, 2),
                "gpu_bytes_of_process_before": gpu_before, "gpu_bytes_of_process_after_checkpoint": gpu_after,
                "reported_gpu_bytes": procs[0].gpu_bytes, "state_after_checkpoint": state_after_ckpt,
                "data_ok": before == after}
    finally:
        child.kill()
        child.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 8, 32], help="GB (1e9 bytes) per run")
    p.add_argument("--out")
    a = p.parse_args()
    runs = [asyncio.run(measure(gb)) for gb in a.sizes]
    result = {"benchmark": "checkpoint_speed", "backend": "cuda", "runs": runs}
    emit(result, a.out)
    return 0 if all(r["data_ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
