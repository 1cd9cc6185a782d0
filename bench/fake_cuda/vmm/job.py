"""A job process for the timeslice-vmm shim over the fake driver (fake_libcuda.c), on a CPU.

    LD_PRELOAD=<shim> TIMESLICE_VMM_LIBCUDA=<fake> python3 job.py FAKE_LIB [--holds N] SIZE [SIZE ...]

Allocates one buffer of each SIZE bytes through cudaMalloc as a CUDA program does (the call goes
through the process's symbol table, so the shim serves it), fills each with random bytes, and prints
`ready <json: addresses>`. Then answers lines on stdin: `verify` -> `verified ok` or `verified bad
<indices>` (each buffer's bytes at its address against a hash taken at the start); `quit` ends it.

With --holds N it is a job of a group instead (the client library, $TIMESLICE_ORCHESTRATOR and
$TIMESLICE_GROUP): it allocates in its first hold, checks every buffer in each of the next N-1
(reading memory that is not back faults the process), prints `holds ok` and exits 0, or exits 1
when bytes differ. $TIMESLICE_FAKE_VMM_PEERS=DIR:N: the job marks DIR before its first acquire and
keeps its first hold until N jobs have marked it, so the group hands off at least once (else a job
that starts first may take all its holds before the other asks).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time
from pathlib import Path


def allocate(sizes: list[int]) -> tuple[list[tuple[int, int]], list[str]]:
    symbols = ctypes.CDLL(None)
    buffers = []
    for size in sizes:
        ptr = ctypes.c_void_p()
        if symbols.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) != 0:
            raise SystemExit(f"cudaMalloc({size}) failed")
        ctypes.memmove(ptr, os.urandom(size), size)
        buffers.append((ptr.value, size))
    return buffers, [hashlib.sha256(ctypes.string_at(p, n)).hexdigest() for p, n in buffers]


def differing(buffers: list[tuple[int, int]], digests: list[str]) -> list[int]:
    return [i for i, (p, n) in enumerate(buffers) if hashlib.sha256(ctypes.string_at(p, n)).hexdigest() != digests[i]]


def holds(n: int, sizes: list[int]) -> int:
    from timeslice import TimeSliceOrchestratorClient

    client = TimeSliceOrchestratorClient()
    buffers: list[tuple[int, int]] = []
    digests: list[str] = []
    peers, _, count = os.environ.get("TIMESLICE_FAKE_VMM_PEERS", "").rpartition(":")
    if peers:
        Path(peers, str(os.getpid())).touch()
    for i in range(n):
        with client.on_accelerators():
            if i == 0:
                buffers, digests = allocate(sizes)
                deadline = time.monotonic() + 60
                while peers and len(os.listdir(peers)) < int(count) and time.monotonic() < deadline:
                    time.sleep(0.01)  # (another job's process is starting: it marks DIR, then asks)
            elif bad := differing(buffers, digests):
                print(f"hold {i}: buffers {bad} differ", flush=True)
                return 1
    client.close()
    print("holds ok", flush=True)
    return 0


def main() -> int:
    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # the "runtime" the shim forwards small allocations to
    if sys.argv[2] == "--holds":
        return holds(int(sys.argv[3]), [int(x) for x in sys.argv[4:]])
    buffers, digests = allocate([int(x) for x in sys.argv[2:]])
    print("ready " + json.dumps([p for p, _ in buffers]), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        bad = differing(buffers, digests)
        print("verified " + (f"bad {bad}" if bad else "ok"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
