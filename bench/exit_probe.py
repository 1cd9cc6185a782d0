"""How long a cooperative job's process takes to end, and what in it (issue 21, shape b).

On the H200, (b) through `timeslice serve` lost ~10 s of its 118 s between the last job's result and
its process's exit (`rl-grpo-b-serve-cooperative-declared-0711831-h200.json`: `seconds_shared` 117.9, the
jobs' own `total_seconds` at most 107.0; solo jobs end 1.7 s after their result). Such a process has
the node's pool (a /dev/shm file) mapped and registered with CUDA in `REGISTER_CHUNK_BYTES` chunks
(`timeslice.torch`) and tens of GB of PyTorch's GPU memory. This probe starts `--procs` such processes
at once (each registers the whole pool of `--pool-gb` and allocates `--gpu-gb`), then ends them the
ways a job may end, and times each: `exit` (the process just exits: CUDA tears down at exit),
`unregister` (the chunks are unregistered first, timed, then exit), `free` (PyTorch's GPU memory
freed and its cache emptied first, then exit).

    python bench/exit_probe.py --pool-gb 96 --gpu-gb 40 --procs 3 --out exit-probe.json

Prints and writes JSON; needs PyTorch with CUDA.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import emit

CHUNK = 256 << 20


def child(path: str, size: int, gpu_bytes: int, how: str) -> None:
    """Map and register `path`, allocate `gpu_bytes`, say `ready`, wait for a line, end `how`."""
    import torch

    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    base = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
    rt = torch.cuda.cudart()
    t0 = time.monotonic()
    for off in range(0, size, CHUNK):
        err = rt.cudaHostRegister(base + off, min(CHUNK, size - off), 0)
        if int(err) != 0:
            raise SystemExit(f"cudaHostRegister at {off}: {int(err)}")
    reg = time.monotonic() - t0
    held = torch.empty(gpu_bytes, dtype=torch.uint8, device="cuda")
    held.fill_(1)
    torch.cuda.synchronize()
    print(json.dumps({"ready": True, "register_seconds": round(reg, 3)}), flush=True)
    sys.stdin.readline()
    t1 = time.monotonic()
    out: dict[str, float] = {}
    if how == "unregister":
        for off in range(0, size, CHUNK):
            rt.cudaHostUnregister(base + off)
        out["unregister_seconds"] = round(time.monotonic() - t1, 3)
    elif how == "free":
        del held
        torch.cuda.empty_cache()
        out["free_seconds"] = round(time.monotonic() - t1, 3)
    print(json.dumps(out), flush=True)  # then the interpreter and CUDA end


def run(path: str, size: int, gpu_bytes: int, procs: int, how: str) -> dict:
    kids = [subprocess.Popen([sys.executable, __file__, "--child", path, str(size), str(gpu_bytes), how],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    ready = [json.loads(k.stdout.readline()) for k in kids]
    t0 = time.monotonic()
    for k in kids:
        k.stdin.write("\n")
        k.stdin.flush()
    said, ended = [], []
    for k in kids:
        said.append(json.loads(k.stdout.readline() or "{}"))
        said[-1]["said_after_seconds"] = round(time.monotonic() - t0, 3)
    for k in kids:
        k.wait()
        ended.append(round(time.monotonic() - t0, 3))
    return {"how": how, "procs": procs, "register_seconds": [r["register_seconds"] for r in ready],
            "before_exit": said, "ended_after_seconds": ended}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-gb", type=float, default=96.0)
    ap.add_argument("--gpu-gb", type=float, default=40.0)
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--ways", nargs="+", default=["exit", "unregister", "free"], choices=["exit", "unregister", "free"])
    ap.add_argument("--out")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), int(a.child[2]), a.child[3])
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (`timeout`: the pool file is still removed)
    size = int(a.pool_gb * 1e9) // CHUNK * CHUNK
    path = f"/dev/shm/exit-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED)
        t0 = time.monotonic()
        for off in range(0, size, CHUNK):  # written once, as the orchestrator's pool
            m[off:off + CHUNK] = bytes(CHUNK)
        res = {"kernel": platform.release(), "nproc": os.cpu_count(), "pool_gb": size / 1e9,
               "populate_seconds": round(time.monotonic() - t0, 2), "gpu_gb": a.gpu_gb, "runs": []}
        for how in a.ways:
            res["runs"].append(run(path, size, int(a.gpu_gb * 1e9), a.procs, how))
            print(json.dumps(res["runs"][-1]), file=sys.stderr, flush=True)
        res["runs"].append(run(path, size, int(a.gpu_gb * 1e9), 1, "exit"))
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)
    emit(res, a.out)


if __name__ == "__main__":
    main()
