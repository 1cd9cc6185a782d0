"""The node agent's memory report (`GetMemory`) and its host-memory check, over real gRPC
with an NVML stand-in (`memory_probe`) and a host stand-in (`host_probe`)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.host_memory import RESERVE_BYTES as HOST_RESERVE_BYTES
from timeslice.kubelet_plugin.agent import node_agent
from timeslice.kubelet_plugin.agent.gpu_memory import GpuInfo
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.server import create_server

from tests.conftest import FakeBackend, eventually

GB = 10**9


@pytest.fixture
def sleeper() -> Iterator[int]:
    """The PID of a real process (job "a")."""
    p = subprocess.Popen(["sleep", "600"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.fixture
async def agent(short_tmp: Path, sleeper: int) -> AsyncIterator[tuple[apb_grpc.NodeAgentStub, dict, list, Path]]:
    """(stub, knobs {"host": bytes}, backend calls, records file) for an agent whose job "a"
    is a real sleeping process holding 5 GB on GPU-0 and 1 GB on GPU-1 (per the probe)."""
    pid = sleeper
    knobs: dict = {"host": 100 * GB, "visible": True, "a0": 5 * GB, "probes": 0}
    calls: list = []

    def nvml() -> list[GpuInfo]:
        knobs["probes"] += 1
        mine = knobs["visible"]  # NVML does not list a checkpointed process
        return [GpuInfo("GPU-0", 0, 80 * GB, 70 * GB, {**({pid: knobs["a0"]} if mine else {}), 4242: 5 * GB}),
                GpuInfo("GPU-1", 1, 80 * GB, 79 * GB, {pid: 1 * GB} if mine else {})]

    knobs["probe"] = nvml  # NVML as the agent sees it (a test may stall it)
    records = short_tmp / "records.json"
    node = NodeAgent(StaticProcessResolver({"a": [pid]}), backends=[FakeBackend("n", calls, name="cuda")],
                     records_path=records, memory_probe=lambda: knobs["probe"](), host_probe=lambda: knobs["host"])
    target = f"unix://{short_tmp / 'agent.sock'}"
    server, _ = await create_server(node, target)
    channel = grpc.aio.insecure_channel(target)
    yield apb_grpc.NodeAgentStub(channel), knobs, calls, records
    await channel.close()
    await server.stop(0)


async def test_memory_report_gives_gpus_jobs_per_gpu_and_host(agent) -> None:
    stub, _, _, _ = agent
    rep = await stub.GetMemory(apb.GetMemoryRequest(jobs=[apb.SwitchStepRequest(job_id="a"),
                                                          apb.SwitchStepRequest(job_id="gone")]))
    assert [(g.uuid, g.total_bytes, g.free_bytes) for g in rep.gpus] == [("GPU-0", 80 * GB, 70 * GB),
                                                                          ("GPU-1", 80 * GB, 79 * GB)]
    jobs = {j.job_id: j for j in rep.jobs}
    assert dict(jobs["a"].device_bytes) == {"GPU-0": 5 * GB, "GPU-1": 1 * GB}  # pid 4242 is another job's
    assert "gone" not in jobs  # no processes: nothing to report, no error
    assert rep.host_available_bytes == 100 * GB


async def test_a_checkpoint_records_its_bytes_per_gpu(agent) -> None:
    stub, _, calls, records = agent
    await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="cuda"))
    rep = await stub.GetMemory(apb.GetMemoryRequest(jobs=[apb.SwitchStepRequest(job_id="a")]))
    assert dict(next(j for j in rep.jobs if j.job_id == "a").checkpointed_bytes) == {"GPU-0": 5 * GB,
                                                                                      "GPU-1": 1 * GB}
    saved = json.loads(records.read_text())["jobs"]["a"]
    assert saved["devices"] == {"GPU-0": 5 * GB, "GPU-1": 1 * GB} and len(calls) == 1


async def test_a_checkpoint_without_host_memory_is_refused_before_anything_is_touched(agent) -> None:
    stub, knobs, calls, records = agent
    knobs["host"] = 6 * GB + HOST_RESERVE_BYTES - 1  # one byte short of the job's 6 GB plus the reserve
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="cuda"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no host memory for the checkpoint of job a: it holds 6.00 GB" in err.value.details()
    assert calls == [] and not records.exists()
    knobs["host"] += 1
    await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="cuda"))
    assert len(calls) == 1


async def test_a_memory_request_without_a_job_id_is_invalid(agent) -> None:
    stub, _, _, _ = agent
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetMemory(apb.GetMemoryRequest(jobs=[apb.SwitchStepRequest(job_id="")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job_id is required" in err.value.details()


async def test_a_repeated_checkpoint_keeps_the_first_ones_record(agent) -> None:
    """A second Checkpoint of a checkpointed job (the undo of a restore whose reply was lost)
    wrote a record without the GPU bytes (NVML no longer lists the process): the room for its
    restore was then planned as 0 bytes."""
    stub, knobs, _, records = agent
    await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="cuda"))
    knobs["visible"] = False
    await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="cuda"))
    saved = json.loads(records.read_text())["jobs"]["a"]
    assert saved["devices"] == {"GPU-0": 5 * GB, "GPU-1": 1 * GB} and saved["phase"] == "checkpointed"


async def test_a_report_carries_the_peak_a_watch_in_flight_sampled_once(agent) -> None:
    """The orchestrator watches a holder with a long poll (2 s) and, when the hold ends
    sooner, plans the next grant from a plain report: that report must carry the most the
    job held in the watch's samples so far (randomized schedules, seed 33: a 14 GB KV cache
    held for 0.27 s was sampled by the watch, whose answer came after the hold and was
    dropped, so the job's need never included it and a later generate hit an OOM). Each
    sample counts once: the next report has only what came since."""
    stub, knobs, _, _ = agent
    request = [apb.SwitchStepRequest(job_id="a")]
    watch = asyncio.ensure_future(stub.GetMemory(apb.GetMemoryRequest(jobs=request, watch_seconds=30)))
    try:
        probes = knobs["probes"]
        await eventually(lambda: knobs["probes"] > probes + 1, what="the watch sampling")
        knobs["a0"] = 19 * GB  # the KV cache of a generate phase, for a few samples
        probes = knobs["probes"]
        await eventually(lambda: knobs["probes"] > probes + 1, what="the watch sampling the cache")
        knobs["a0"] = 5 * GB
        rep = await stub.GetMemory(apb.GetMemoryRequest(jobs=request))
        (a,) = rep.jobs
        assert a.device_bytes["GPU-0"] == 5 * GB and a.peak_device_bytes["GPU-0"] == 19 * GB
        (a,) = (await stub.GetMemory(apb.GetMemoryRequest(jobs=request))).jobs
        assert a.peak_device_bytes["GPU-0"] == 5 * GB
    finally:
        watch.cancel()


async def test_a_phase_between_two_reports_enters_the_next_ones_peak(agent) -> None:
    """No watch in flight (the orchestrator stopped between two: schedules seed 2289 on a
    16-core host, SIGSTOP for 1.8 s): a job named in a report keeps being sampled, so a KV
    cache held only between two reports is in the next one's peak (it was in none: the job
    settled without it, and a later generate ran out of memory beside another job)."""
    stub, knobs, _, _ = agent
    request = [apb.SwitchStepRequest(job_id="a")]
    await stub.GetMemory(apb.GetMemoryRequest(jobs=request))  # a plain report: no watch follows
    knobs["a0"] = 19 * GB
    probes = knobs["probes"]
    await eventually(lambda: knobs["probes"] > probes + 1, what="the agent sampling between reports")
    knobs["a0"] = 5 * GB
    (a,) = (await stub.GetMemory(apb.GetMemoryRequest(jobs=request))).jobs
    assert a.device_bytes["GPU-0"] == 5 * GB and a.peak_device_bytes["GPU-0"] == 19 * GB


async def test_a_gap_in_the_agents_sampling_makes_its_reports_a_new_incarnation(agent) -> None:
    """The agent stopped (SIGSTOP) or stalled between two samples may have missed a phase's
    peak: its reports looked whole, and a hold that peaked in the gap could settle its job
    without that peak. A gap over `SAMPLE_GAP_SECONDS` makes the next reports answer as a new
    incarnation (the orchestrator counts the holds in progress as unobserved); samples at
    their pace keep it."""
    stub, knobs, _, _ = agent
    request = [apb.SwitchStepRequest(job_id="a")]
    first = (await stub.GetMemory(apb.GetMemoryRequest(jobs=request))).incarnation
    probes = knobs["probes"]
    await eventually(lambda: knobs["probes"] > probes + 3, what="the agent sampling between reports")
    assert (await stub.GetMemory(apb.GetMemoryRequest(jobs=request))).incarnation == first
    stalled = threading.Event()

    def stall() -> list[GpuInfo]:  # the agent's sampling stops for longer than the gap allows
        stalled.set()
        time.sleep(node_agent.SAMPLE_GAP_SECONDS * 1.5)
        return probe()

    probe = knobs["probe"]
    knobs["probe"] = stall
    await asyncio.to_thread(stalled.wait, 30)
    knobs["probe"] = probe
    probes = knobs["probes"]
    await eventually(lambda: knobs["probes"] > probes + 1, what="sampling again after the stall")
    assert (await stub.GetMemory(apb.GetMemoryRequest(jobs=request))).incarnation != first
