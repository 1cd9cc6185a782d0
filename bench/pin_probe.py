"""What pinning shared host memory costs on this machine, and whom it slows (issue 21, shape b).

Cooperative jobs checkpoint into the node's pool, a file on a memory filesystem that every job
process maps and registers with CUDA (`cudaHostRegister`, CUDA Runtime API) in chunks of
`timeslice.torch.REGISTER_CHUNK_BYTES`. On the H200 each process's first checkpoints into a
part of the pool took 8-10 s for 50 GB instead of ~1 s: the registration. This probe measures,
for one file of `--gb` GB backed three ways (a /dev/shm file in 4 KiB pages; a memfd asked for
transparent huge pages with `madvise(MADV_HUGEPAGE)`; a hugetlbfs memfd when the host has huge
pages reserved), the seconds a fresh process takes to register it, and how much a GPU-busy process
(a loop of bf16 matmuls, as a generate phase) slows while another process registers it.

    python bench/pin_probe.py --gb 16 --out pin-probe.json

Prints and writes JSON; needs PyTorch with CUDA. Linux memfd flags: memfd_create(2).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import emit

CHUNK = 256 << 20


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as err:
        return f"unreadable: {err}"


def register(fd_path: str, size: int) -> dict:
    """In this (fresh) process: map `fd_path`, register it chunk by chunk, unregister. Seconds."""
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    fd = os.open(fd_path, os.O_RDWR)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    t = torch.frombuffer(m, dtype=torch.uint8)
    rt = torch.cuda.cudart()
    base = t.data_ptr()
    t0 = time.monotonic()
    for off in range(0, size, CHUNK):
        err = rt.cudaHostRegister(base + off, min(CHUNK, size - off), 0)
        if int(err) != 0:
            return {"error": f"cudaHostRegister at {off}: {int(err)}"}
    reg = time.monotonic() - t0
    # copy speed through the registration (device -> host, 4 GB)
    n = min(size, 4 << 30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t1 = time.monotonic()
    for off in range(0, n, CHUNK):  # one copy per registration: CUDA refuses a copy across two
        t[off:off + CHUNK].copy_(dev[off:off + CHUNK], non_blocking=True)
    torch.cuda.synchronize()
    d2h = n / (time.monotonic() - t1) / 1e9
    t2 = time.monotonic()
    for off in range(0, size, CHUNK):
        rt.cudaHostUnregister(base + off)
    unreg = time.monotonic() - t2
    return {"register_seconds": round(reg, 3), "register_gb_per_s": round(size / reg / 1e9, 2),
            "d2h_gb_per_s": round(d2h, 1), "unregister_seconds": round(unreg, 3)}


def busy(seconds: float) -> None:
    """A GPU-busy loop: prints one line per iteration (its seconds) for `seconds`."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        for _ in range(50):
            a = torch.tanh(a @ a * 1e-3)
        torch.cuda.synchronize()
        print(time.monotonic() - t0, flush=True)


def _child(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, **kw)


def measure(fd_path: str, size: int) -> dict:
    first = json.loads(_child("--register", fd_path, str(size)).communicate()[0])
    second = json.loads(_child("--register", fd_path, str(size)).communicate()[0])
    # slowdown: a busy process alone, then beside a registering process
    b = _child("--busy", "30")
    times = []
    line = b.stdout.readline()  # warm-up done
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4:
        times.append(float(b.stdout.readline()))
    reg = _child("--register", fd_path, str(size))
    during = []
    while reg.poll() is None:
        line = b.stdout.readline()
        if not line:
            break
        during.append(float(line))
    reg_out = reg.communicate()[0]
    b.kill()
    b.communicate()
    return {"first_process": first, "second_process": second, "beside_busy": json.loads(reg_out) if reg_out else {},
            "busy_iteration_seconds_alone_median": round(statistics.median(times), 4) if times else None,
            "busy_iteration_seconds_during_register_median": round(statistics.median(during), 4) if during else None,
            "busy_iteration_seconds_during_register_max": round(max(during), 4) if during else None,
            "busy_iterations_during_register": len(during)}


def meminfo(keys: tuple[str, ...]) -> dict:
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = v.strip()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--out")
    ap.add_argument("--register", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--busy", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.register:
        print(json.dumps(register(a.register[0], int(a.register[1]))))
        return
    if a.busy:
        busy(a.busy)
        return
    size = int(a.gb * 1e9) // CHUNK * CHUNK
    res = {"kernel": platform.release(), "nproc": os.cpu_count(), "gb": size / 1e9,
           "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
           "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
           "hugepages": meminfo(("HugePages_Total", "HugePages_Free", "Hugepagesize")), "variants": {}}
    # 1. /dev/shm file, 4 KiB pages, written once (as the pool's populate)
    path = f"/dev/shm/pin-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    for off in range(0, size, CHUNK):
        m[off:off + CHUNK] = bytes(CHUNK)
    res["variants"]["shm_4k"] = measure(path, size)
    m.close()
    os.close(fd)
    os.unlink(path)
    # 2. memfd with MADV_HUGEPAGE (shmem THP), written once
    fd = os.memfd_create("pin-probe-thp", 0)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError) as err:
        res["thp_madvise_error"] = str(err)
    for off in range(0, size, CHUNK):
        m[off:off + CHUNK] = bytes(CHUNK)
    res["variants"]["memfd_thp"] = {"meminfo_after_populate": meminfo(("ShmemHugePages", "ShmemPmdMapped")),
                                    **measure(f"/proc/{os.getpid()}/fd/{fd}", size)}
    m.close()
    os.close(fd)
    # 3. hugetlbfs memfd (needs reserved huge pages)
    try:
        if not int(meminfo(("HugePages_Free",)).get("HugePages_Free", "0")) * (2 << 20) >= size:
            raise OSError("no huge pages reserved for it")
        fd = os.memfd_create("pin-probe-hugetlb", os.MFD_HUGETLB)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED)
        for off in range(0, size, CHUNK):
            m[off:off + CHUNK] = bytes(CHUNK)
        res["variants"]["memfd_hugetlb"] = measure(f"/proc/{os.getpid()}/fd/{fd}", size)
        m.close()
        os.close(fd)
    except (OSError, BufferError) as err:
        res["variants"]["memfd_hugetlb"] = {"error": str(err)}
    emit(res, a.out)


if __name__ == "__main__":
    main()
