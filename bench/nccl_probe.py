#!/usr/bin/env python3
"""What a 2-rank NCCL job shows from outside, with NCCL's defaults and with its peer-to-peer and
shared-memory transports off (issue 14, item 0: how the node agent can tell, before locking
anything, that a process's GPU memory is mapped by other processes).

    python bench/nccl_probe.py default transparent    # prints one JSON object per setting

Each setting starts `torchrun --standalone --nproc-per-node 2` of this file (`--rank-main`): each
rank all-reduces 256 MiB over NCCL (so the transports are set up), writes its pid and waits. The
driver then reads, per rank: the /dev/shm and NVIDIA device files it maps or holds open
(/proc/PID/maps, /proc/PID/fd), the NCCL variables of its environment, and on which GPUs NVML
lists it; then lets the ranks all-reduce again and exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {"default": {}, "transparent": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}}


def rank_main(work: Path) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    x = torch.full((64 << 20,), float(rank + 1), device=device)
    dist.all_reduce(x)
    ok = x[0].item() == 3.0
    (work / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "ok": ok}))
    while not (work / "go").exists():
        time.sleep(0.1)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def inspect(pid: int) -> dict:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    names = [line.split(maxsplit=5)[5] for line in maps if len(line.split(maxsplit=5)) == 6]
    mapped = sorted({n for n in names if "/dev/shm" in n or "nvidia" in n or "nccl" in n})
    fds = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            fds.append(os.readlink(fd))
        except OSError:
            pass
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
               .split("\0") if "=" in kv)
    return {"mapped": mapped, "open": sorted({f for f in fds if "shm" in f or "nvidia" in f or "socket" in f}),
            "nccl_env": {k: v for k, v in env.items() if k.startswith("NCCL_")}}


def nvml_processes() -> dict[int, list[tuple[int, int]]]:
    import pynvml

    pynvml.nvmlInit()
    out = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out[i] = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
    return out


def probe(setting: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, **SETTINGS[setting]}
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", __file__, "--rank-main", str(work)], env=env)
        deadline = time.monotonic() + 180
        while not all((work / f"rank{r}.json").exists() for r in (0, 1)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{setting}: the ranks did not start (exit {proc.poll()})")
            time.sleep(0.2)
        time.sleep(0.5)  # both files are complete (written whole, small)
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in (0, 1)]
        result = {"setting": setting, "ranks": [{**r, **inspect(r["pid"])} for r in ranks],
                  "nvml": nvml_processes()}
        (work / "go").touch()
        result["exit"] = proc.wait(timeout=120)
        return result


if __name__ == "__main__":
    if sys.argv[1] == "--rank-main":
        rank_main(Path(sys.argv[2]))
    else:
        for s in sys.argv[1:]:
            print(json.dumps(probe(s)), flush=True)
