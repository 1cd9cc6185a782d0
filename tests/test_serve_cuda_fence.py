"""A `cuda` holder that has not made its first CUDA call yet, in `timeslice serve` with backend
`cuda` over the fake CUDA driver (bench/fake_cuda) and the model GPU: serve, its node agent and
the jobs are real processes.

The `cuda` backend stops a process by locking its CUDA context (cuCheckpointProcessLock); a
process with no context has nothing to lock, and its checkpoint leaves it running. A helper's
attack: a holder stopped (Ctrl-Z, SIGSTOP) right after its grant, before its first CUDA call,
past its lease: the lapse "checkpointed" it (0 bytes, nothing locked), the next job was granted,
and once continued the first made its first CUDA call and computed beside the next holder. The
same kind without any stop: a holder reading its data for longer than `maxHoldSeconds` before
its first CUDA call was preempted the same way. Now such a holder keeps the lock past its lease
while its agent reports it live, and is not preempted until it has a context
(`Residency.unfenceable`).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from timeslice.kubelet_plugin.agent.model_gpu import ENV as MODEL_GPU_ENV
from timeslice.kubelet_plugin.agent.model_gpu import ModelGpu

from bench import schedules
from tests.conftest import eventually
from tests.test_serve import env_for, kill_left, serve_process

MiB = 1 << 20

# A job on the model GPU: acquires, prints "granted", works argv[1] seconds on the CPU (no CUDA
# context yet), then allocates 100 MiB (its first GPU call) and computes argv[2] GPU calls of
# 10 ms, printing each one's monotonic (start, end); releases, prints "done".
JOB = textwrap.dedent("""
    import os, sys, time
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.kubelet_plugin.agent.model_gpu import from_env
    gpu, pid = from_env(), os.getpid()
    c = TimeSliceOrchestratorClient(group_id="g")
    c.acquire(timeout=120)
    print("granted", flush=True)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        pass
    with gpu.call(pid):
        gpu.alloc(pid, 100 << 20, "first")
    for _ in range(int(sys.argv[2])):
        with gpu.call(pid):
            t0 = time.monotonic()
            time.sleep(0.01)
            print("busy", t0, time.monotonic(), flush=True)
    c.release()
    c.close()
    print("done", flush=True)
""")


async def _line(proc: asyncio.subprocess.Process, want: str, out: list[str]) -> None:
    assert proc.stdout is not None
    while not (line := (await proc.stdout.readline()).decode()).startswith(want):
        assert line, f"job ended before {want!r}: {''.join(out)}"
        out.append(line)
    out.append(line)


def _overlaps(busy: dict[str, list[tuple[float, float]]]) -> list[str]:
    (a, spans_a), (b, spans_b) = busy.items()
    return [f"{a} {s} and {b} {t}" for s in spans_a for t in spans_b if s[0] < t[1] and t[0] < s[1]]


@pytest.mark.slow  # two jobs of real processes, a lease lapse or a hold limit
@pytest.mark.parametrize("case", ["stopped-past-its-lease", "past-max-hold"])
async def test_a_holder_without_a_cuda_context_yet_never_computes_beside_the_next_holder(
        short_tmp: Path, monkeypatch, case: str) -> None:
    """stopped-past-its-lease: a is SIGSTOPped right after its grant, b waits, a's lease (2 s)
    runs out, and a is continued once b computes (before the fix) or a is kept past its lease;
    past-max-hold: a works 3 s on the CPU before its first CUDA call under maxHoldSeconds 1.5,
    b waits. Both end, and no GPU call of one overlaps one of the other's; `timeslice status`
    says why a kept holder keeps the lock."""
    gpu = ModelGpu.create(short_tmp / "gpu.json", 1000 * MiB)
    monkeypatch.setenv(MODEL_GPU_ENV, str(gpu.path))  # for serve's node agent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(schedules.FAKE_CUDA), os.environ.get("PYTHONPATH", "")]))
    stopped = case == "stopped-past-its-lease"
    async with serve_process(short_tmp, backend="cuda", lease_seconds=2 if stopped else 30,
                             more="" if stopped else "max_hold_seconds: 1.5") as (sock, _, _):
        env = env_for(sock, **{MODEL_GPU_ENV: str(gpu.path)}, TIMESLICE_ACCELERATOR_PROCESS="1")
        jobs: dict[str, asyncio.subprocess.Process] = {}
        said = ""
        out: dict[str, list[str]] = {"a": [], "b": []}
        try:
            for name, cpu_s, calls in (("a", 0.5 if stopped else 3.0, 40), ("b", 0.0, 200)):
                jobs[name] = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", JOB, str(cpu_s), str(calls), env=env, start_new_session=True,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                if name == "a":
                    await asyncio.wait_for(_line(jobs["a"], "granted", out["a"]), 60)
                    if stopped:
                        jobs["a"].send_signal(signal.SIGSTOP)
            if stopped:  # b computes (before the fix: a's lease lapsed), or a is kept past its lease: a continues
                b_busy = asyncio.ensure_future(_line(jobs["b"], "busy", out["b"]))
                serve_log = short_tmp / "serve.log"
                kept = asyncio.ensure_future(eventually(lambda: "past its deadline group=g" in serve_log.read_text(),
                                                        60, 0.05, what="a kept past its lease"))
                done, _ = await asyncio.wait({b_busy, kept}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                assert done, (out, serve_log.read_text()[-3000:])
                await asyncio.gather(*done)
                if kept in done:  # what a user sees of the group that waits
                    status = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "timeslice.cli.main", "status", "--target", f"unix://{sock}",
                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                    said = (await asyncio.wait_for(status.communicate(), 30))[0].decode()
                jobs["a"].send_signal(signal.SIGCONT)
                if b_busy in done:
                    kept.cancel()
                    await asyncio.wait({kept})
                else:
                    await b_busy
            for name, p in jobs.items():
                await asyncio.wait_for(_line(p, "done", out[name]), 90)
        finally:
            await kill_left(jobs)
    log = (short_tmp / "serve.log").read_text()
    busy = {name: [(float(t0), float(t1)) for t0, t1 in re.findall(r"^busy (\S+) (\S+)$", "".join(lines), re.M)]
            for name, lines in out.items()}
    assert [len(spans) for spans in busy.values()] == [40, 200], (out, log[-3000:])
    assert _overlaps(busy) == [], log[-3000:]
    assert gpu.ooms() == []
    assert not stopped or "past its lease, kept: its processes live with no CUDA context to lock" in said, said
