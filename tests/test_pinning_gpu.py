"""Pinning the node's pool never starves a job (issue 21, item 3; marked `gpu`, skipped
without a GPU, PyTorch and root). On the H200 a job that registered a 60 GB pool in one
`cudaHostRegister` call stopped its other threads for seconds, and a pool pinned whole in
the background slowed the other jobs' phases. Now a checkpoint pins the parts of the pool it
copies through, once per process (`timeslice.torch`, in chunks). `timeslice serve` with a
cooperative group offers a pool of `TIMESLICE_PIN_TEST_POOL_GB` (default 8); the job
registers `TIMESLICE_PIN_TEST_STATE_GB` (default 2, at most half the pool) of state, then
another job takes the GPU twice: the first checkpoint pins, the second reuses what it pinned,
while a thread of the job records how late it woke. Its state comes back bit for bit.
Results: printed as JSON, and written to `$TIMESLICE_PIN_TEST_JSON` when set.

    TIMESLICE_PIN_TEST_POOL_GB=60 TIMESLICE_PIN_TEST_STATE_GB=30 TIMESLICE_PIN_TEST_JSON=/tmp/x.json \
        python -m pytest -q -s tests/test_pinning_gpu.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from timeslice.v1 import orchestrator_pb2 as pb
from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

from tests.test_gpu import _gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU, PyTorch and root")]
LEASE_SECONDS = 10.0  # the default lease, what users run with
KEEPALIVE_SECONDS = LEASE_SECONDS / 3  # the client's keep-alive interval (`timeslice._rpc.keepalive_interval`)

# The job: inside a hold, makes `gb` GB of state and registers it; then a thread of its own
# wakes every 5 ms and keeps the times while the test lets another job take the GPU twice
# (a line on stdin after each); holds again and prints "again <json>": the thread's largest
# gap and whether its state came back bit for bit.
HOLDER = textwrap.dedent("""
    import json, sys, threading, time, torch
    import timeslice.torch
    from timeslice import TimeSliceOrchestratorClient
    gb = float(sys.argv[1])
    client = TimeSliceOrchestratorClient(group_id="gpu0")
    ticks, stop = [], threading.Event()
    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)
    with client.on_accelerators():
        torch.manual_seed(0)
        x = torch.randn(int(gb * 1e9 / 4), device="cuda")
        ref = x.cpu()
        timeslice.torch.register(client, x)
    threading.Thread(target=tick, daemon=True).start()
    print("registered", flush=True)
    sys.stdin.readline()
    sys.stdin.readline()
    stop.set()
    gap = max((b - a for a, b in zip(ticks, ticks[1:])), default=0.0)
    with client.on_accelerators():
        same = torch.equal(x.cpu(), ref)
    client.close()
    print("again " + json.dumps({"thread_max_gap_seconds": gap, "ticks": len(ticks), "bitwise_equal": same}),
          flush=True)
""")


async def _status(sock: Path) -> pb.GroupStatus:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        return await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="gpu0"))


async def _line(stream: asyncio.StreamReader, prefix: str, timeout: float) -> dict:
    line = (await asyncio.wait_for(stream.readline(), timeout)).decode()
    assert line.startswith(prefix + " "), line
    return json.loads(line[len(prefix) + 1:])


@pytest.mark.timeout(1800)
async def test_a_checkpoint_pins_what_it_copies_once_never_starving_the_job_and_its_state_moves_bit_for_bit(
        tmp_path: Path) -> None:
    pool_gb = float(os.environ.get("TIMESLICE_PIN_TEST_POOL_GB", "8"))
    state_gb = min(float(os.environ.get("TIMESLICE_PIN_TEST_STATE_GB", "2")), pool_gb / 2)
    sock = tmp_path / "orchestrator.sock"
    (tmp_path / "groups.yaml").write_text("groups:\n  - {id: gpu0, backend: cooperative, residency: exclusive, "
                                          f"lease_seconds: {LEASE_SECONDS}}}\n")
    log = tmp_path / "serve.log"
    with log.open("ab") as err:
        serve = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "timeslice.cli.main", "serve", "--config", str(tmp_path / "groups.yaml"),
            "--socket", str(sock), "--state-dir", str(tmp_path / "state"), "--pinned-pool-gb", str(pool_gb),
            stdout=asyncio.subprocess.PIPE, stderr=err)
    assert serve.stdout is not None
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")},
           "TIMESLICE_ORCHESTRATOR": f"unix://{sock}"}
    holder = None
    try:
        t_ready = time.monotonic()
        assert (await asyncio.wait_for(serve.stdout.readline(), 900)).startswith(b"ready"), log.read_text()[-4000:]
        populate_seconds = time.monotonic() - t_ready
        holder = await asyncio.create_subprocess_exec(sys.executable, "-c", HOLDER, str(state_gb), env=env,
                                                      start_new_session=True, stdin=asyncio.subprocess.PIPE,
                                                      stdout=asyncio.subprocess.PIPE)
        assert holder.stdin is not None and holder.stdout is not None
        line = (await asyncio.wait_for(holder.stdout.readline(), 900)).decode()
        assert line.startswith("registered"), line
        for _ in range(2):  # another job takes the GPU: the holder's state leaves through the pool, then comes back
            other = await asyncio.create_subprocess_exec(sys.executable, "-m", "timeslice.cli.main", "run", "--group",
                                                         "gpu0", "--timeout", "600", "--", "true", env=env,
                                                         start_new_session=True)
            assert await asyncio.wait_for(other.wait(), 600) == 0, log.read_text()[-4000:]
            holder.stdin.write(b"go\n")
        again = await _line(holder.stdout, "again", 600)
        assert await asyncio.wait_for(holder.wait(), 60) == 0
        status = await _status(sock)
    finally:
        if holder is not None and holder.returncode is None:
            os.killpg(holder.pid, signal.SIGKILL)
        if serve.returncode is None:
            serve.send_signal(signal.SIGTERM)
        await asyncio.wait_for(serve.wait(), 120)
    moved = [r for r in status.recent_switches if r.ok and r.bytes_checkpointed]
    result = {
        "pool_gb": pool_gb, "state_gb": state_gb, "populate_seconds_upper_bound": round(populate_seconds, 2),
        "job_thread_max_gap_seconds": round(again["thread_max_gap_seconds"], 4), "job_thread_ticks": again["ticks"],
        "lease_expiries": status.lease_expiries, "failed_switches": status.failed_switches,
        "bitwise_equal": again["bitwise_equal"],
        "switches": [{"from": r.from_job_id, "to": r.to_job_id, "bytes_checkpointed": r.bytes_checkpointed,
                      "checkpoint_seconds": round(r.checkpoint_seconds, 3), "bytes_restored": r.bytes_restored,
                      "restore_seconds": round(r.restore_seconds, 3)} for r in moved],
    }
    print(json.dumps(result, indent=2))
    if os.environ.get("TIMESLICE_PIN_TEST_JSON"):
        await asyncio.to_thread(Path(os.environ["TIMESLICE_PIN_TEST_JSON"]).write_text,
                                json.dumps(result, indent=2) + "\n")
    assert again["ticks"] > 0 and again["thread_max_gap_seconds"] < KEEPALIVE_SECONDS, result  # it kept running
    assert status.lease_expiries == 0 and status.failed_switches == 0, result
    assert again["bitwise_equal"] and len(moved) == 2, result
    assert all(r.bytes_checkpointed >= 0.99 * state_gb * 1e9 for r in moved), result
