"""A job process for the timeslice-vmm shim over the fake driver (fake_libcuda.c), on a CPU.

    LD_PRELOAD=<shim> TIMESLICE_VMM_LIBCUDA=<fake> python3 job.py FAKE_LIB SIZE [SIZE ...]

Allocates one buffer of each SIZE bytes through cudaMalloc as a CUDA program does (the call goes
through the process's symbol table, so the shim serves it), fills each with random bytes, and prints
`ready <json: addresses>`. Then answers lines on stdin: `verify` -> `verified ok` or `verified bad
<indices>` (each buffer's bytes at its address against a hash taken at the start); `quit` ends it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys


def main() -> None:
    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # the "runtime" the shim forwards small allocations to
    symbols = ctypes.CDLL(None)
    buffers = []
    for size in map(int, sys.argv[2:]):
        ptr = ctypes.c_void_p()
        if symbols.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) != 0:
            raise SystemExit(f"cudaMalloc({size}) failed")
        ctypes.memmove(ptr, os.urandom(size), size)
        buffers.append((ptr.value, size))
    digests = [hashlib.sha256(ctypes.string_at(p, n)).hexdigest() for p, n in buffers]
    print("ready " + json.dumps([p for p, _ in buffers]), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        bad = [i for i, (p, n) in enumerate(buffers) if hashlib.sha256(ctypes.string_at(p, n)).hexdigest() != digests[i]]
        print("verified " + (f"bad {bad}" if bad else "ok"), flush=True)


if __name__ == "__main__":
    main()
