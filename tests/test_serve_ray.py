"""Ray GPU workers are moved with their job under `timeslice serve` (issue 23, item 5): the
single controller of a veRL- or OpenRLHF-shaped job holds the group, and its GPU work runs
in Ray actors that the raylet starts (each in a process group of its own). Stand-in workers:
a local Ray instance (1 CPU) and an actor marked `TIMESLICE_ACCELERATOR_PROCESS=1` (its
`runtime_env`), as a GPU worker would be found by NVML. When another job holds, the actor is
stopped with its job; when the job holds again, it runs. Real processes throughout; `freeze`
backend. Marked slow: starting Ray takes over 5 s here."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap

import pytest
from timeslice.kubelet_plugin.agent.procfs import proc_state

from tests.integration_deps import need
from tests.test_serve import env_for, serve_process
from tests.test_serve_faults import JOB_A, line

need("ray")
pytestmark = pytest.mark.slow

# The job's controller: starts Ray and one marked actor, holds once to start it (as
# `init_workers`), prints the actor's PID, releases, then holds again when told.
CONTROLLER = textwrap.dedent("""
    import os, sys, ray
    from timeslice import TimeSliceOrchestratorClient
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)

    @ray.remote(runtime_env={"env_vars": {"TIMESLICE_ACCELERATOR_PROCESS": "1"}})
    class Worker:
        def pid(self):
            return os.getpid()

    client = TimeSliceOrchestratorClient(group_id="g")
    with client.on_accelerators(timeout=120):
        worker = Worker.remote()
        print(ray.get(worker.pid.remote()), flush=True)
    sys.stdin.readline()
    with client.on_accelerators(timeout=120):
        print("again", ray.get(worker.pid.remote()), flush=True)
    client.close()
    ray.shutdown()
""")


def stopped(pid: int) -> bool:
    return proc_state(pid) in ("T", "t")


@pytest.mark.timeout(240)
async def test_a_ray_jobs_gpu_workers_are_stopped_while_another_job_holds_and_run_when_it_holds(tmp_path) -> None:
    async with serve_process(tmp_path) as (sock, _, _):
        controller = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CONTROLLER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env_for(sock), start_new_session=True)
        other = None
        try:
            assert controller.stdout is not None and controller.stdin is not None
            worker = int((await asyncio.wait_for(controller.stdout.readline(), 120)).decode())
            assert os.getpgid(worker) != controller.pid  # Ray's worker: a process group of its own
            other = await asyncio.create_subprocess_exec(sys.executable, "-c", JOB_A, stdout=asyncio.subprocess.PIPE,
                                                         env=env_for(sock), start_new_session=True)
            await line(other, "granted")
            assert stopped(worker), "the Ray worker of the job that released runs while another job holds"
            controller.stdin.write(b"go\n")  # it waits for the group; the other job leaves
            os.killpg(other.pid, signal.SIGKILL)
            await other.wait()
            got = (await asyncio.wait_for(controller.stdout.readline(), 120)).decode().split()
            assert got == ["again", str(worker)] and not stopped(worker)
            assert await asyncio.wait_for(controller.wait(), 60) == 0
        finally:
            for p in (controller, other):
                if p is not None and p.returncode is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    await p.wait()
