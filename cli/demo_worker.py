"""Demo accelerator worker: holds a job's device state and computes on command.

Started by the demo runner, one per demo job, connected to its job process by a
socket (JSON lines). This is the process the node agent checkpoints: the `cuda`
backend moves its GPU memory, the `freeze` backend stops it. Modes:

- cpu: state is a bytearray of `--state-mb` MiB; a phase hashes it (real CPU work)
- gpu: state is an int64 tensor of `--state-gb` GB on the GPU (needs PyTorch);
  a phase runs bf16 matrix products

Every phase starts by checking the state against the checksum taken at the end of
the previous phase (so a corrupted checkpoint/restore shows as `check_ok: false`),
and ends by changing the state deterministically and taking a new checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import socket
import time
from typing import Any


class CpuState:
    def __init__(self, mib: int, seed: int) -> None:
        self.data = bytearray(hashlib.sha256(f"seed-{seed}".encode()).digest() * (mib * 1024 * 1024 // 32))
        self.step = 0
        self.digest = self.checksum()

    def checksum(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def free_bytes(self) -> None:
        return None

    def compute(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        view = memoryview(self.data)
        chunk = 1 << 20
        i = 0
        while time.monotonic() < end:
            hashlib.sha256(view[(i * chunk) % len(self.data):][:chunk]).digest()
            i += 1

    def advance(self) -> None:
        self.step += 1
        self.data[self.step % len(self.data)] ^= 0xFF
        self.digest = self.checksum()


class GpuState:
    def __init__(self, gb: float, seed: int) -> None:
        import torch

        self.torch = torch
        n = int(gb * 1e9) // 8
        self.data = torch.arange(n, dtype=torch.int64, device="cuda").add_(seed)  # in place: one copy only
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        torch.cuda.empty_cache()  # hand back allocator slack: it would be checkpointed too
        self.step = 0
        self.digest = self.checksum()

    def free_bytes(self) -> int:
        """Free GPU memory at phase start, bytes: shows the other job's state has left."""
        return int(self.torch.cuda.mem_get_info()[0])

    def checksum(self) -> str:
        t = self.torch
        t.cuda.synchronize()
        n = self.data.numel()
        probe = self.data[t.tensor([0, n // 3, n // 2, n - 1], device="cuda")].tolist()
        return f"{int(self.data.sum().item())}:{probe}"

    def compute(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(8):
                self.a = (self.a @ self.a).clamp_(-1, 1)
            self.torch.cuda.synchronize()

    def advance(self) -> None:
        self.step += 1
        self.data.add_(1)
        self.digest = self.checksum()


def serve(sock: socket.socket, make_state: Any) -> None:
    f = sock.makefile("rw", buffering=1)
    state = None
    for line in f:
        msg = json.loads(line)
        if msg["op"] == "exit":
            return
        t0 = time.monotonic()
        free = state.free_bytes() if state is not None else None
        if state is None:
            state = make_state()
            ok = True
        else:
            ok = state.checksum() == state.digest
        state.compute(msg["seconds"])
        state.advance()
        f.write(json.dumps({"check_ok": ok, "start": t0, "end": time.monotonic(), "device_free_bytes": free}) + "\n")
        f.flush()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to `timeslice demo`, which stops us
    p = argparse.ArgumentParser(description="timeslice demo accelerator worker (started by `timeslice demo`)")
    p.add_argument("--fd", type=int, required=True, help="inherited socket to the job process")
    p.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--state-mb", type=int, default=16, help="cpu mode: state size, MiB")
    p.add_argument("--state-gb", type=float, default=1.0, help="gpu mode: state size, GB (1e9 bytes)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    sock = socket.socket(fileno=a.fd)
    if a.mode == "gpu":
        import torch  # noqa: F401  (import before the first phase; no CUDA context yet)

        serve(sock, lambda: GpuState(a.state_gb, a.seed))
    else:
        serve(sock, lambda: CpuState(a.state_mb, a.seed))


if __name__ == "__main__":
    main()
