"""A job that closes while checkpointed, in `timeslice serve` with backend `cuda` over the fake
CUDA driver (bench/fake_cuda) and the model GPU: serve, its node agent and the jobs are real
processes.

docs/client.md: a process whose state is checkpointed waits in its CUDA teardown until its
state is back; an idle group restores a checkpointed job that fits. A helper's attack on
`node-agent` + `orchestrator`: x (nothing declared) closed while checkpointed, then b and c, the
jobs that had moved it out, left; the idle group's background restore of x found no room, since
their processes still held their memory while they exited, and nothing asked again: x's
teardown waited for good on an empty GPU (3 of 3). Now an idle group that found no room looks
again (`IdleRestores`, 0.5 s doubling up to 30 s).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from timeslice.kubelet_plugin.agent.model_gpu import ENV as MODEL_GPU_ENV
from timeslice.kubelet_plugin.agent.model_gpu import ModelGpu

from bench import schedules
from tests.test_serve import env_for, kill_left, outputs, serve_process, start_jobs

MiB = 1 << 20

# A job on the model GPU: argv[1] holds of 400 MiB (allocated in its first), 0.5 s of 10 ms GPU
# calls each and 0.3 s between them; then close(), and its exit's CUDA teardown (a GPU call: it waits while the process
# is checkpointed); prints "closed", then "done".
JOB = textwrap.dedent("""
    import os, sys, time
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.kubelet_plugin.agent.model_gpu import from_env
    gpu, pid = from_env(), os.getpid()
    c = TimeSliceOrchestratorClient(group_id="g")
    for i in range(int(sys.argv[1])):
        c.acquire(timeout=120)
        if not gpu.held(pid):
            with gpu.call(pid):
                gpu.alloc(pid, 400 << 20, "state")
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            with gpu.call(pid):
                time.sleep(0.01)
        c.release()
        time.sleep(0.3)
    c.close()
    print("closed", flush=True)
    with gpu.call(pid):
        pass
    print("done", flush=True)
""")


@pytest.mark.slow  # a dozen holds of real processes
async def test_a_job_that_closed_while_checkpointed_is_restored_once_the_others_memory_is_freed(
        short_tmp: Path, monkeypatch) -> None:
    """x holds twice, then closes while b and c (400 MiB each, 4 holds) move it out; they leave,
    their processes holding their memory a moment longer as they exit (failed 2 of 2 before:
    x never ended). x is restored by the idle group and exits."""
    gpu = ModelGpu.create(short_tmp / "gpu.json", 1000 * MiB)
    monkeypatch.setenv(MODEL_GPU_ENV, str(gpu.path))  # for serve's node agent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(schedules.FAKE_CUDA), os.environ.get("PYTHONPATH", "")]))
    async with serve_process(short_tmp, backend="cuda", lease_seconds=30) as (sock, _, _):
        env = env_for(sock, **{MODEL_GPU_ENV: str(gpu.path)}, TIMESLICE_ACCELERATOR_PROCESS="1")
        jobs = await start_jobs(JOB, {"x": ["2"], "b": ["4"], "c": ["4"]}, env)
        try:
            out = await outputs(jobs)
        finally:
            await kill_left(jobs)
    log = (short_tmp / "serve.log").read_text()
    assert {name: (p.returncode, out[name].splitlines()[-2:]) for name, p in jobs.items()} == \
        {name: (0, ["closed", "done"]) for name in jobs}, (out, log[-3000:])  # (a retried acquire logs a line)
    assert gpu.ooms() == []
