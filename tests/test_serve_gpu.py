"""One-box mode on a real GPU (marked `gpu`; skipped without GPU, PyTorch and root): two
PyTorch scripts that name neither a job nor a PID share GPU 0 through `timeslice serve`,
backend `cuda`, each hand-off checkpointing one script's tensors and restoring the
other's. Results of the GPU runs are committed under bench/results/ (CI has no GPU)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

from tests.test_gpu import _gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU, PyTorch and root")]

# A training-shaped script: start-up under the lock, then `rounds` phases that each change
# `gb` GB of tensors; after every grant the data must be what it was at the last release.
SCRIPT = textwrap.dedent("""
    import json, sys, time, torch
    from timeslice import TimeSliceOrchestratorClient
    name, gb, rounds, out = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    client = TimeSliceOrchestratorClient(group_id="gpu0")
    torch.manual_seed(len(name))
    with client.on_accelerators():
        x = torch.randn(int(gb * 1e9 / 4), device="cuda")
        torch.cuda.synchronize()
    spans, last = [], None
    for _ in range(rounds):
        with client.on_accelerators():
            t0 = time.time()
            now = x.sum(dtype=torch.float64).item()
            assert last is None or now == last, (name, now, last)
            x.mul_(0.999).add_(0.001)
            last = x.sum(dtype=torch.float64).item()
            spans.append([name, t0, time.time()])
        time.sleep(0.2)
    client.close()
    json.dump({"spans": spans, "sum": last}, open(f"{out}/{name}.json", "w"))
""")


@pytest.mark.timeout(600)  # each hand-off moves GBs at a few GB/s (bench/results/serve-h200/)
@pytest.mark.parametrize("groups", ["exclusive", "default"])
async def test_two_pytorch_scripts_share_gpu0_through_serve_with_cuda_checkpoints(groups: str, tmp_path: Path) -> None:
    """`exclusive`: a group file, every hand-off moves a job out and the other in; `default`:
    the README's and docs/one-box.md's `timeslice serve` with no file (one group per GPU, residency auto): two jobs
    that fit share the GPU with nothing moved."""
    gb = float(os.environ.get("TIMESLICE_SERVE_GPU_GB", "8"))
    (tmp_path / "groups.yaml").write_text("groups:\n  - {id: gpu0, backend: cuda, residency: exclusive}\n")
    config = ["--config", str(tmp_path / "groups.yaml")] if groups == "exclusive" else []
    sock = tmp_path / "orchestrator.sock"
    log = (tmp_path / "serve.log").open("wb")
    serve = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "timeslice.cli.main", "serve", *config, "--socket",
        str(sock), "--state-dir", str(tmp_path / "state"), stdout=asyncio.subprocess.PIPE, stderr=log)
    assert serve.stdout is not None
    try:
        assert (await asyncio.wait_for(serve.stdout.readline(), 60)).startswith(b"ready")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")},
               "TIMESLICE_ORCHESTRATOR": f"unix://{sock}"}
        jobs = [await asyncio.create_subprocess_exec(sys.executable, "-c", SCRIPT, name, str(gb), "3", str(tmp_path),
                                                     env=env, start_new_session=True) for name in ("a", "bb")]
        for job in jobs:
            assert await asyncio.wait_for(job.wait(), 400) == 0, (tmp_path / "serve.log").read_text()[-4000:]
        async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
            status = await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="gpu0"))
    finally:
        if serve.returncode is None:
            serve.send_signal(signal.SIGTERM)
        await asyncio.wait_for(serve.wait(), 60)
        log.close()
    spans = sorted((s for n in ("a", "bb") for s in json.loads((tmp_path / f"{n}.json").read_text())["spans"]),
                   key=lambda s: s[1])
    for prev, cur in itertools.pairwise(spans):
        assert cur[1] >= prev[2], spans
    moved = [r for r in status.recent_switches if r.ok and r.bytes_checkpointed > 0.9 * gb * 1e9]
    assert status.failed_switches == 0 and status.grants >= 8, status
    assert moved if groups == "exclusive" else not moved, status
    print(json.dumps({"groups": groups, "gb_per_job": gb, "grants": status.grants, "switches": [
        {"from": r.from_job_id, "to": r.to_job_id, "checkpoint_seconds": round(r.checkpoint_seconds, 3),
         "restore_seconds": round(r.restore_seconds, 3), "bytes_checkpointed": r.bytes_checkpointed,
         "bytes_restored": r.bytes_restored} for r in status.recent_switches]}))
