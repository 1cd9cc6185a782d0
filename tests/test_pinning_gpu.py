"""Pinning the node's pool never starves a job (issue 21, item 3; marked `gpu`, skipped
without a GPU, PyTorch and root). On the H200 a job that registered a 60 GB pool in one
`cudaHostRegister` call stopped its other threads for seconds: its 10 s lease lapsed inside
its phase. `timeslice serve` with a cooperative group offers a pool of
`TIMESLICE_PIN_TEST_POOL_GB` (default 8); the holder registers its state while it holds,
which pins the whole pool then (`timeslice.torch`, in chunks), while the test samples the
holder's lease (the keep-alive silence is the lease minus what remains of it) and a thread
of the job records how late it woke. Then the holder's state leaves through the pool for
another job and comes back bit for bit. Results: printed as JSON, and written to
`$TIMESLICE_PIN_TEST_JSON` when set.

    TIMESLICE_PIN_TEST_POOL_GB=60 TIMESLICE_PIN_TEST_JSON=/tmp/x.json python -m pytest -q -s tests/test_pinning_gpu.py
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

# The holder: inside a hold, makes `gb` GB of state and registers it (the pool pins now);
# a thread of its own wakes every 5 ms and keeps the times. Prints "pinned <json>", waits
# for a line on stdin (the test lets another job take the GPU meanwhile), holds again and
# prints "again <json>" saying whether its state came back bit for bit.
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
        threading.Thread(target=tick, daemon=True).start()
        t0 = time.monotonic()
        state = timeslice.torch.register(client, x)
        assert state.loop.pool_attached.wait(1200), "the pool was never registered"
        t1 = time.monotonic()
    stop.set()
    window = [t for t in ticks if t0 <= t <= t1]
    gap = max((b - a for a, b in zip(window, window[1:])), default=0.0)
    print("pinned " + json.dumps({"t0": t0, "t1": t1, "pin_seconds": t1 - t0, "thread_max_gap_seconds": gap,
                                  "ticks": len(window)}), flush=True)
    sys.stdin.readline()
    with client.on_accelerators():
        same = torch.equal(x.cpu(), ref)
    client.close()
    print("again " + json.dumps({"bitwise_equal": same}), flush=True)
""")


async def _status(sock: Path) -> pb.GroupStatus:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        return await pb_grpc.OrchestratorStub(ch).GetGroupStatus(pb.GetGroupStatusRequest(group_id="gpu0"))


async def _line(stream: asyncio.StreamReader, prefix: str, timeout: float) -> dict:
    line = (await asyncio.wait_for(stream.readline(), timeout)).decode()
    assert line.startswith(prefix + " "), line
    return json.loads(line[len(prefix) + 1:])


@pytest.mark.timeout(1800)
async def test_pinning_a_large_pool_never_starves_the_holder_and_its_state_moves_bit_for_bit(tmp_path: Path) -> None:
    pool_gb = float(os.environ.get("TIMESLICE_PIN_TEST_POOL_GB", "8"))
    state_gb = min(2.0, pool_gb / 2)
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
        samples: list[tuple[float, float]] = []  # (monotonic seconds, the holder's lease remaining)

        async def sample() -> None:
            while True:
                s = await _status(sock)
                if s.holder.job_id == f"pgid-{holder.pid}":
                    samples.append((time.monotonic(), s.holder.lease_remaining_seconds))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        try:
            pinned = await _line(holder.stdout, "pinned", 1500)
        finally:
            sampler.cancel()
        # another job takes the GPU: the holder's state leaves through the pool, then comes back
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
    during = [remaining for t, remaining in samples if pinned["t0"] <= t <= pinned["t1"]]
    silence = max((LEASE_SECONDS - remaining for remaining in during), default=0.0)  # since the last keep-alive
    moved = [r for r in status.recent_switches if r.ok and r.bytes_checkpointed]
    result = {
        "pool_gb": pool_gb, "state_gb": state_gb, "populate_seconds_upper_bound": round(populate_seconds, 2),
        "pin_seconds": round(pinned["pin_seconds"], 3), "lease_seconds": LEASE_SECONDS,
        "keepalive_interval_seconds": round(KEEPALIVE_SECONDS, 3), "lease_samples_during_pin": len(during),
        "keepalive_max_silence_seconds": round(silence, 3),
        "job_thread_max_gap_seconds": round(pinned["thread_max_gap_seconds"], 4),
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
    assert pinned["ticks"] > 0 and during, result  # both were measured while the pool pinned
    assert pinned["thread_max_gap_seconds"] < KEEPALIVE_SECONDS, result  # the job's own thread kept running
    # no keep-alive came later than one interval past its time (the lease allows three)
    assert silence - KEEPALIVE_SECONDS < KEEPALIVE_SECONDS, result
    assert status.lease_expiries == 0 and status.failed_switches == 0, result
    assert again["bitwise_equal"] and moved and moved[0].bytes_checkpointed >= 0.99 * state_gb * 1e9, result
