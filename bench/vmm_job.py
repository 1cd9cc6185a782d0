"""An unmodified CUDA job for bench/vmm_switch.py: plain PyTorch, no timeslice import.

    python3 bench/vmm_job.py GB SEED

Fills GB gigabytes of device memory with random int32 tensors (1 GiB each), captures a CUDA
graph (a bf16 matrix product into a static output), then answers lines on stdin:
`verify` -> `verified <ok|bad> <what differs>` (the tensors' digests and the graph's replayed
output, bitwise, against those taken before any switch); `quit` ends it. Prints `ready <bytes>`
when set up.
"""

from __future__ import annotations

import sys

import torch


def digest(chunks: list[torch.Tensor]) -> list[tuple[int, int]]:
    out = []
    for c in chunks:
        h = c.view(torch.int64)
        out.append((int(h.sum()), int((h >> 13).sum())))
    return out


def main() -> None:
    gb, seed = float(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(seed)
    n = max(1, round(gb * 1e9 / 2**30))
    chunks = [torch.randint(-2**31, 2**31 - 1, (2**28,), dtype=torch.int32, device="cuda") for _ in range(n)]
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out = x @ w + 1
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = x @ w + 1
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_digest = out.cpu().clone(), digest(chunks)
    print(f"ready {n * 2**30}", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        bad = []
        if not torch.equal(out.cpu(), ref_out):
            bad.append("graph output")
        if digest(chunks) != ref_digest:
            bad.append("tensors")
        print(f"verified {'bad ' + ','.join(bad) if bad else 'ok'}", flush=True)


if __name__ == "__main__":
    main()
