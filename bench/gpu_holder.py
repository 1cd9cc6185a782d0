"""A child process that holds an int64 tensor on the GPU and answers checksum requests.

Used by bench/checkpoint_speed.py and tests/test_gpu.py as the process the `cuda`
backend checkpoints. Protocol on stdin/stdout, one line each:
`sum` -> the tensor's sum; `busy <seconds>` -> queue that much GPU work and answer at
once; `exit`. Prints `ready <bytes>` once the tensor is filled.
"""

import sys
import time

import torch


def main() -> None:
    gb = float(sys.argv[1])
    data = torch.arange(int(gb * 1e9) // 8, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    print(f"ready {data.numel() * 8}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "sum":
            print(int(data.sum().item()), flush=True)
        elif cmd[0] == "busy":
            a = torch.randn(8192, 8192, device="cuda")
            t0 = time.monotonic()
            while time.monotonic() - t0 < float(cmd[1]) / 4:  # enqueue; the GPU runs far behind
                a = a @ a
            print("queued", flush=True)
        elif cmd[0] == "exit":
            return


if __name__ == "__main__":
    main()
