"""A holder that grows past its reservation right after its grant, in `timeslice serve` with
backend `cuda` over the fake CUDA driver (bench/fake_cuda) and the model GPU
(`kubelet_plugin/agent/model_gpu.py`): serve, its node agent and the jobs are real processes.

docs/residency.md: while a job holds, its agents watch free memory and when it falls under the
headroom the idle residents there are checkpointed, never the holder. A helper's attack: the
holder's watch (a long poll) in flight at the grant had begun in an earlier hold; its answer
for low memory came after the grant and was dropped (it was not the holder it began under),
and the next watch went without the threshold for 2 s: a holder growing 100 MiB/s right after
its grant ran out of memory (exit 99) while idle residents sat on the GPU.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
from pathlib import Path

import pytest
from timeslice.kubelet_plugin.agent.model_gpu import ENV as MODEL_GPU_ENV
from timeslice.kubelet_plugin.agent.model_gpu import ModelGpu

from bench import schedules
from tests.conftest import eventually
from tests.test_serve import env_for, kill_left, outputs, serve_process, start_jobs

MiB = 1 << 20
OOM_EXIT = 99

# A job on the model GPU: HOLDS (argv[1]) is the MiB it holds by the end of each hold; its
# first hold allocates at once (what it declared), a later one that holds more grows in steps
# of STEP_MIB every PAUSE_S seconds ($GROW_PAUSE_S, default 0.2) from its grant on (the input:
# 100 MiB/s, as the attack's).
# It computes COMPUTE_CALLS GPU calls of 10 ms per hold. An allocation that does not fit: exit 99.
JOB = textwrap.dedent("""
    import os, sys, time
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.kubelet_plugin.agent.model_gpu import ModelGpuOom, from_env
    STEP_MIB, PAUSE_S, COMPUTE_CALLS = 20, float(os.environ.get("GROW_PAUSE_S", "0.2")), 30
    holds = [int(x) << 20 for x in sys.argv[1].split(",")]
    gpu, pid, have = from_env(), os.getpid(), 0
    c = TimeSliceOrchestratorClient(group_id="g")
    for i, want in enumerate(holds):
        c.acquire(timeout=120)
        step = (STEP_MIB << 20) if have else want
        try:
            while have < want:
                with gpu.call(pid):
                    gpu.alloc(pid, min(step, want - have), f"hold {i}")
                have = min(want, have + step)
                if have < want:
                    time.sleep(PAUSE_S)
        except ModelGpuOom as e:
            print("OOM", e, flush=True)
            os._exit(99)
        for _ in range(COMPUTE_CALLS):
            with gpu.call(pid):
                time.sleep(0.01)
        c.release()
    c.close()
    print("done", flush=True)
""")


@pytest.mark.slow  # a dozen holds of real processes
async def test_a_holder_growing_right_after_its_grant_has_idle_residents_checkpointed_not_an_oom(
        short_tmp: Path, monkeypatch) -> None:
    """Three jobs of 300 MiB (declared) fill a 1000 MiB GPU to its 10% headroom; in its fourth
    hold, a grows to 450 MiB at once after its grant (b and c, with more holds to go, are idle
    residents then). An idle resident is checkpointed for it as soon as free memory falls under
    the headroom, a never: no OOM, every job ends."""
    gpu = ModelGpu.create(short_tmp / "gpu.json", 1000 * MiB)
    monkeypatch.setenv(MODEL_GPU_ENV, str(gpu.path))  # for serve's node agent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(schedules.FAKE_CUDA), os.environ.get("PYTHONPATH", "")]))
    async with serve_process(short_tmp, backend="cuda", lease_seconds=30) as (sock, _, _):
        env = env_for(sock, **{MODEL_GPU_ENV: str(gpu.path)}, TIMESLICE_MEMORY="300Mi",
                      TIMESLICE_ACCELERATOR_PROCESS="1")
        jobs = await start_jobs(JOB, {"a": ["300,300,300,450"], "b": ["300," * 5 + "300"], "c": ["300," * 5 + "300"]},
                                env)
        try:
            out = await outputs(jobs)
        finally:
            await kill_left(jobs)
    log = (short_tmp / "serve.log").read_text()
    assert gpu.ooms() == [], (out, log[-3000:])
    assert {name: (p.returncode, out[name].strip()) for name, p in jobs.items()} == \
        {name: (0, "done") for name in jobs}, log[-3000:]
    a = f"pgid-{jobs['a'].pid}"
    assert f"holder {a} outgrew its reservation" in log  # idle residents left for it
    assert f"checkpointed job={a} " not in log  # (the agent's log) never the holder, nor a between its holds


@pytest.mark.slow  # a restart of serve between a dozen holds of real processes
async def test_a_holder_adopted_after_a_restart_is_watched_as_it_grows(short_tmp: Path, monkeypatch) -> None:
    """A helper's attack on `timeslice orchestrator`: restarted (SIGKILL) right at a holder's
    grant, the orchestrator adopted the hold in progress but did not watch its memory, and the
    holder, growing past its reservation, ran out of memory beside an idle resident (5 of 5).
    Here through `timeslice serve`, killed at a's third grant and started again on the same state
    dir: a grows from 300 to 800 MiB (20 MiB every 0.5 s) on a 1000 MiB GPU where b holds 300;
    b is checkpointed for it, a never runs out."""
    gpu = ModelGpu.create(short_tmp / "gpu.json", 1000 * MiB)
    monkeypatch.setenv(MODEL_GPU_ENV, str(gpu.path))  # for serve's node agent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(schedules.FAKE_CUDA), os.environ.get("PYTHONPATH", "")]))
    jobs: dict[str, asyncio.subprocess.Process] = {}
    try:
        async with serve_process(short_tmp, backend="cuda", lease_seconds=30) as (sock, _, serve):
            env = env_for(sock, **{MODEL_GPU_ENV: str(gpu.path)}, TIMESLICE_MEMORY="300Mi",
                          TIMESLICE_ACCELERATOR_PROCESS="1", GROW_PAUSE_S="0.5")
            jobs = await start_jobs(JOB, {"a": ["300,300,800"], "b": ["300," * 5 + "300"]}, env)
            log = short_tmp / "serve.log"
            await eventually(lambda: log.read_text().count(f"granted group=g job=pgid-{jobs['a'].pid} ") >= 3, 60,
                             0.005, what="a's third grant")
            serve.kill()
            await serve.wait()
        async with serve_process(short_tmp, backend="cuda", lease_seconds=30, name="serve2"):
            out = await outputs(jobs)
    finally:
        await kill_left(jobs)
    log2 = (short_tmp / "serve2.log").read_text()
    assert gpu.ooms() == [], (out, log2[-3000:])
    assert {name: (p.returncode, out[name].strip().splitlines()[-1]) for name, p in jobs.items()} == \
        {name: (0, "done") for name in jobs}, (out, log2[-3000:])
    assert f"holder pgid-{jobs['a'].pid} outgrew its reservation" in log2

