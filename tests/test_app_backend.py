"""Backend `app`: jobs switched by their inference engine's sleep and wake (vLLM, SGLang).

The engines are real processes (`tests/fake_engine.py`, aiohttp on loopback) with the
upstream APIs; the orchestrator and the node agents are real servers. The agents' NVML is
the one stand-in (`memory_probe`): it reads the bytes each fake engine says it holds.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import grpc.aio
import pytest
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.driver import config as ts_config
from timeslice.driver.agentapi.v1 import agent_pb2 as apb
from timeslice.driver.agentapi.v1 import agent_pb2_grpc as apb_grpc
from timeslice.driver.app_engine import AppEngine
from timeslice.driver.errors import BackendError, FailedPrecondition, InvalidArgument
from timeslice.errors import InvalidRequest, SwitchFailed
from timeslice.kubelet_plugin.agent.backends import make_backend
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.processes import StaticProcessResolver
from timeslice.kubelet_plugin.agent.records import JobRecord
from timeslice.kubelet_plugin.agent.server import create_server
from timeslice.kubelet_plugin.agent.steps import JobRef, StepRequest

from tests.conftest import eventually
from tests.fake_engine import ASLEEP_BYTES, AWAKE_BYTES, nvml_stand_in

ROOT = Path(__file__).resolve().parent.parent


async def start_engine(children: list, kind: str, name: str, log: Path, memory_dir: Path, args: tuple[str, ...] = (),
                       **app: object) -> tuple[subprocess.Popen[str], AppEngine]:
    """A fake engine process (more command-line `args`); returns it and its `AppEngine` (more
    fields from `app`)."""
    p = subprocess.Popen([sys.executable, "-m", "tests.fake_engine", "--engine", kind, "--name", name,  # noqa: ASYNC220
                          "--log", str(log), "--memory-dir", str(memory_dir), *args], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    children.append(p)
    line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 30)  # type: ignore[union-attr]
    assert line.startswith("ready "), f"fake engine did not start: {line!r}"
    return p, AppEngine(engine=kind, url=f"http://127.0.0.1:{line.split()[1]}", **app)  # type: ignore[arg-type]


async def two_jobs(make_cluster, children: list, engine_dirs: tuple[Path, Path],  # type: ignore[no-untyped-def]
                   b_kind: str = "sglang", lease_seconds: float = 10.0, group: dict[str, object] | None = None,
                   **a_app: object):
    """Jobs a (a vLLM-like engine, more `AppEngine` fields from `a_app`) and b (`b_kind`), each
    an engine process, in one group on backend app (more `GroupSpec` fields from `group`):
    (cluster, a's engine)."""
    log, memory = engine_dirs
    pa, a_engine = await start_engine(children, "vllm", "a", log, memory, **a_app)
    pb, b_engine = await start_engine(children, b_kind, "b", log, memory)
    c = await make_cluster(backend="app", real_backend=True, jobs={"a": [pa.pid], "b": [pb.pid]},
                           memory_probe=nvml_stand_in(memory), lease_seconds=lease_seconds,
                           spec={"apps": {"a": a_engine, "b": b_engine}, **(group or {})})
    return c, a_engine


async def fault(engine: AppEngine, **faults: str) -> None:
    async with aiohttp.ClientSession() as s, s.post(engine.url + "/fake/fault", json=faults) as r:
        assert r.status == 200


async def is_sleeping(engine: AppEngine) -> bool:
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/is_sleeping") as r:
        return bool((await r.json())["is_sleeping"])


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def engine_dirs(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "memory").mkdir()
    return tmp_path / "calls.log", tmp_path / "memory"


def test_config_refuses_an_engine_url_that_is_not_loopback() -> None:
    base = {"apiVersion": "timeslice.dev/v1alpha1", "kind": "TimeSliceConfig", "backend": "app"}
    for url, why in [("http://10.0.0.7:8000", "not loopback"), ("http://example.com:8000", "not loopback"),
                     ("https://127.0.0.1:8000", "scheme must be http"), ("http://127.0.0.1:8000/v1", "no path")]:
        with pytest.raises(InvalidArgument, match=rf"app\.url: .*{why}"):
            ts_config.parse({**base, "app": {"engine": "vllm", "url": url}}, "claim ns/c")
    with pytest.raises(InvalidArgument, match="backend app needs the job's engine"):
        ts_config.parse(base, "claim ns/c")
    with pytest.raises(InvalidArgument, match="app is set, but backend is cuda"):
        ts_config.parse({**base, "backend": "cuda", "app": {"engine": "vllm", "url": "http://127.0.0.1:1"}}, "x")
    with pytest.raises(InvalidArgument, match=r"app\.level"):
        ts_config.parse({**base, "app": {"engine": "vllm", "url": "http://127.0.0.1:1", "level": 3}}, "x")
    ok = ts_config.parse({**base, "app": {"engine": "sglang", "url": "http://[::1]:30000"}}, "x")
    assert ok.app == AppEngine(engine="sglang", url="http://[::1]:30000")
    with pytest.raises(ValueError, match="not loopback"):  # the orchestrator's static config too
        GroupSpec(id="g", backend="app", agents=("unix:///x",), apps={"a": {"engine": "vllm",  # type: ignore[dict-item]
                                                                            "url": "http://10.1.1.1:80"}})


@pytest.mark.parametrize("b_url", ["http://127.0.0.1:8000/", "http://localhost:8000"])
def test_config_refuses_two_jobs_that_name_one_engine(b_url: str) -> None:
    """A helper's attack: two jobs naming one URL were accepted; a sleep for one job's switch
    would have put to sleep the engine the other generates on. Loopback names of one port are
    one engine too; another port is another."""
    with pytest.raises(ValueError, match=r"apps\.a and apps\.b name the same engine \(http://127\.0\.0\.1:8000, "):
        GroupSpec(id="g", backend="app", agents=("unix:///x",),
                  apps={"a": {"engine": "vllm", "url": "http://127.0.0.1:8000"},  # type: ignore[dict-item]
                        "b": {"engine": "sglang", "url": b_url}})  # type: ignore[dict-item]
    GroupSpec(id="g", backend="app", agents=("unix:///x",),
              apps={"a": {"engine": "vllm", "url": "http://127.0.0.1:8000"},  # type: ignore[dict-item]
                    "b": {"engine": "sglang", "url": "http://localhost:8001"}})  # type: ignore[dict-item]


async def test_agent_refuses_a_step_whose_engine_is_not_on_loopback(children, engine_dirs, short_tmp) -> None:
    """The agent checks the URL itself: an orchestrator's word does not make it call another host."""
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "vllm", "a", log, memory)
    agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=["app"], memory_probe=nvml_stand_in(memory))
    server, _ = await create_server(agent, f"unix://{short_tmp / 'agent.sock'}")
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp / 'agent.sock'}") as ch:
            stub = apb_grpc.NodeAgentStub(ch)
            for app, text in [(apb.AppEngine(engine="vllm", url="http://192.168.1.4:8000"), "not loopback"),
                              (apb.AppEngine(engine="tgi", url=engine.url), "app.engine"),
                              (None, "backend app needs the job's engine")]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="app", app=app))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()
            assert calls(log) == [] and not await is_sleeping(engine)  # nothing was sent
            r = await stub.Checkpoint(apb.SwitchStepRequest(job_id="a", backend="app", app=apb.AppEngine(
                engine="vllm", url=engine.url, level=2)))
            assert r.bytes == AWAKE_BYTES - ASLEEP_BYTES and calls(log) == ["a sleep level=2"]
            assert agent.records.jobs["a"].app == AppEngine(engine="vllm", url=engine.url, level=2)
            # the restore needs no engine: the record names it
            await stub.Restore(apb.SwitchStepRequest(job_id="a", backend="app"))
            assert calls(log) == ["a sleep level=2", "a wake"] and "a" not in agent.records.jobs
    finally:
        await server.stop(0)


async def test_two_jobs_alternate_by_sleep_and_wake_in_order(make_cluster, children, engine_dirs) -> None:
    log, _ = engine_dirs
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs)
    a, b = c.client("a"), c.client("b")
    try:
        for holder in (a, b, a, b):
            await holder.acquire(timeout=10)
            await holder.release()
        assert calls(log) == ["a sleep level=1",  # b's first grant: a leaves (b never slept: nothing to wake)
                              "b sleep", "a wake",  # a again
                              "a sleep level=1", "b wake"]  # b again
        status = await c.status()
        assert status.failed_switches == 0 and status.switches == 3
        assert await is_sleeping(a_engine) and "a" in c.agents["node-0"].records.jobs
        assert c.agents["node-0"].records.jobs["a"].bytes == AWAKE_BYTES - ASLEEP_BYTES  # what NVML saw freed
    finally:
        for cl in (a, b):
            await cl.close()


async def test_a_job_with_no_engine_named_is_refused_at_its_acquire(make_cluster, children, engine_dirs) -> None:
    """A helper's attack on `serve` with an `app` group: clients started without TIMESLICE_JOB
    (the README's `setsid`) are jobs `pgid-<N>`, which `apps` cannot name; such a job was
    queued, and every switch away from it failed, the error landing on the other job's
    acquire. Now its own acquire is refused at once, naming the fix, and the others go on."""
    c, _ = await two_jobs(make_cluster, children, engine_dirs)
    stranger, a = c.client("pgid-4242"), c.client("a")
    try:
        with pytest.raises(InvalidRequest, match=r"group g uses backend app and names no inference engine for job "
                                                 r"pgid-4242: the group's `apps` names a, b: run the job's client "
                                                 "and its engine with TIMESLICE_JOB"):
            await stranger.acquire(timeout=10)
        await a.acquire(timeout=10)
        await a.release()
    finally:
        for cl in (stranger, a):
            await cl.close()


async def test_a_failing_wake_is_reported_and_the_other_job_keeps_working(make_cluster, children,
                                                                          engine_dirs) -> None:
    log, _ = engine_dirs
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs)
    a, b = c.client("a", retry_failed_switches=False), c.client("b")  # a: the failure itself is tested
    try:
        await a.acquire(timeout=10)
        await a.release()
        await b.acquire(timeout=10)  # a sleeps
        await b.release()
        await fault(a_engine, wake="fail")
        with pytest.raises(SwitchFailed, match=r"restore of a failed .*wake_up answered HTTP 500.*rolled back"):
            await a.acquire(timeout=10)
        # rolled back: b was put to sleep for a, and woken again; a stays asleep (nothing sent to it again)
        assert calls(log)[-3:] == ["b sleep", "a wake-failed", "b wake"]
        assert await is_sleeping(a_engine)
        await b.acquire(timeout=10)  # b works on, with no switch
        await b.release()
        status = await c.status()
        assert status.failed_switches == 1
        await fault(a_engine, wake="ok")  # the engine recovers: a's next acquire restores it
        await a.acquire(timeout=10)
        assert calls(log)[-2:] == ["b sleep", "a wake"] and not await is_sleeping(a_engine)
        await a.release()
    finally:
        for cl in (a, b):
            await cl.close()


async def test_a_hung_sleep_times_out_and_the_switch_rolls_back(make_cluster, children, engine_dirs) -> None:
    log, _ = engine_dirs
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs, "vllm", timeoutSeconds=0.5)
    a, b = c.client("a"), c.client("b", retry_failed_switches=False)  # b: the failure itself is tested
    try:
        await a.acquire(timeout=10)
        await fault(a_engine, sleep="hang")
        await a.release()
        with pytest.raises(SwitchFailed, match=r"checkpoint of a failed .*POST /sleep got no answer within 0.5 s"
                                               r".*engine reports it is awake"):
            await b.acquire(timeout=30)
        assert calls(log) == ["a sleep-hung"] and not await is_sleeping(a_engine)
        assert "a" not in c.agents["node-0"].records.jobs  # no record of a checkpoint that did not happen
        await fault(a_engine, sleep="ok")
        await a.acquire(timeout=10)  # a never left: granted with no switch
        await a.release()
        await b.acquire(timeout=10)
        assert calls(log)[-1] == "a sleep level=1"
        await b.release()
    finally:
        for cl in (a, b):
            await cl.close()


async def test_a_sleep_that_frees_no_memory_is_a_failed_checkpoint(children, engine_dirs) -> None:
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "sglang", "a", log, memory)
    backend = make_backend("app", memory_probe=nvml_stand_in(memory)).bind(engine)
    await fault(engine, sleep="keep-memory")
    with pytest.raises(BackendError, match=rf"did not drop: {AWAKE_BYTES} bytes before, {AWAKE_BYTES} after.*"
                                           "woke it again"):
        await backend.checkpoint([proc.pid], timeout=5)
    assert calls(log) == ["a sleep", "a wake"]
    await fault(engine, sleep="ok")
    states = await backend.checkpoint([proc.pid], timeout=5)
    assert [(s.state, s.gpu_bytes) for s in states] == [("checkpointed", AWAKE_BYTES - ASLEEP_BYTES)]
    again = await backend.checkpoint([proc.pid], timeout=5)  # asleep already: nothing sent (SGLang would refuse)
    assert [s.state for s in again] == ["checkpointed"] and calls(log) == ["a sleep", "a wake", "a sleep"]
    await backend.restore([proc.pid], timeout=5)
    assert calls(log)[-1] == "a wake"


@pytest.mark.parametrize("awake", [ASLEEP_BYTES + (64 << 20), ASLEEP_BYTES // 2])
async def test_an_engine_holding_little_beyond_its_context_sleeps(children, engine_dirs, awake: int) -> None:
    """A helper's attack: an engine holding little more than its CUDA context (a small model, or
    none loaded yet) could never free half of what it held, so every sleep failed and the group
    tried it again for good (12 failed switches in 40 s; the waiter timed out with the GPU 98%
    free). What a sleep must free is measured beyond what it keeps (`KEPT_BYTES` a process);
    a sleep that frees nothing of what it could still fails."""
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "sglang", "a", log, memory, ("--awake-bytes", str(awake)))
    backend = make_backend("app", memory_probe=nvml_stand_in(memory)).bind(engine)
    states = await backend.checkpoint([proc.pid], timeout=5)
    assert [(s.state, s.gpu_bytes) for s in states] == [("checkpointed", max(0, awake - ASLEEP_BYTES))]
    await backend.restore([proc.pid], timeout=5)
    if awake > ASLEEP_BYTES:
        await fault(engine, sleep="keep-memory")
        with pytest.raises(BackendError, match="did not drop"):
            await backend.checkpoint([proc.pid], timeout=5)


async def test_a_sleep_answered_404_fails_with_nothing_to_undo(children, engine_dirs) -> None:
    """A job whose engine is named with the wrong API (an SGLang claim on a vLLM server): its sleep
    is answered 404, so it never slept. The undo's wake, also 404, said "UNDO FAILED, the engine
    may stay asleep" (a helper's attack); now the error says there was nothing to undo."""
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "vllm", "a", log, memory)
    wrong = engine.model_copy(update={"engine": "sglang"})
    backend = make_backend("app", memory_probe=nvml_stand_in(memory)).bind(wrong)
    with pytest.raises(BackendError, match=r"POST /release_memory_occupation answered HTTP 404.*--enable-memory-saver"
                                           r"\); nothing to undo \(no such endpoint: the engine did not sleep\)$"):
        await backend.checkpoint([proc.pid], timeout=5)
    assert calls(log) == [] and not await is_sleeping(engine)


async def test_without_nvml_the_memory_check_is_skipped_and_said(children, engine_dirs, caplog) -> None:
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "vllm", "a", log, memory)
    backend = make_backend("app", memory_probe=list).bind(engine)
    with caplog.at_level(logging.INFO, logger="timeslice.agent"):
        states = await backend.checkpoint([proc.pid], timeout=5)
    assert [(s.state, s.gpu_bytes) for s in states] == [("checkpointed", 0)]  # 0: unknown
    assert "GPU memory not verified (NVML unavailable)" in caplog.text
    assert [s.state for s in await backend.state([proc.pid])] == ["checkpointed"]  # /is_sleeping
    await backend.restore([proc.pid], timeout=5)
    assert [s.state for s in await backend.state([proc.pid])] == ["running"]


async def test_an_engine_that_is_not_listening_fails_the_step_after_bounded_retries(children, engine_dirs) -> None:
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "vllm", "a", log, memory)
    proc.kill()
    proc.wait()
    await eventually(lambda: proc.poll() is not None)
    backend = make_backend("app", memory_probe=list).bind(engine)
    with pytest.raises(BackendError, match="cannot connect after 3 attempt"):
        await backend.restore([proc.pid], timeout=5)
    short = backend.bind(engine.model_copy(update={"timeoutSeconds": 0.01}))
    with pytest.raises(BackendError, match=r"after 1 attempt\(s\)"):  # no time left for a retry
        await short.restore([proc.pid], timeout=5)


async def test_serve_stop_leaves_an_asleep_engine_asleep(children, engine_dirs, tmp_path) -> None:
    """`timeslice serve`'s stop gives back every job its agent stopped (`restore_all`), but an
    asleep engine is no stopped process: its wake beside the awake one could run the GPU out of
    memory (a helper's attack: each stop woke it while the other job held, 6 of 6). It stays
    asleep, its record kept for the next `serve` to wake it at its job's next grant."""
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "vllm", "a", log, memory)
    agent = NodeAgent(StaticProcessResolver({"a": [proc.pid]}), backends=["app", "freeze"],
                      records_path=tmp_path / "agent.json", memory_probe=nvml_stand_in(memory))
    await agent.backend("app").bind(engine).checkpoint([proc.pid], timeout=5)
    agent.records.put("a", JobRecord("app", "g", {proc.pid: AWAKE_BYTES - ASLEEP_BYTES}, app=engine))
    await agent.restore_all("timeslice serve stopped")
    assert calls(log) == ["a sleep level=1"] and await is_sleeping(engine)
    assert "a" in agent.records.jobs


async def test_a_one_box_step_whose_engine_is_not_the_jobs_says_so(children, engine_dirs) -> None:
    """A helper's attack on `serve`: an engine started without its job's name (no TIMESLICE_JOB,
    or another job's) is no process of the job, so its checkpoint found "nothing to checkpoint":
    the engine was never put to sleep and the other engines woke beside it, with an INFO line
    only. On one box (this agent the only one) a step whose engine listens while no process of
    its job runs now fails, naming the fix; with no engine listening there is still nothing to do."""
    log, memory = engine_dirs
    proc, engine = await start_engine(children, "vllm", "a", log, memory)
    agent = NodeAgent(StaticProcessResolver({}), backends=["app"], groups={"g": "app"},
                      memory_probe=nvml_stand_in(memory))
    req = StepRequest(JobRef("a"), "app", "g", app=engine)
    with pytest.raises(FailedPrecondition, match=r"vllm at http://127\.0\.0\.1:\d+ level 1 listens, but no process of "
                                                 r"job a runs on this node.*TIMESLICE_JOB=a"):
        await agent.checkpoint(req)
    assert calls(log) == [] and not await is_sleeping(engine)
    proc.kill()
    proc.wait()
    assert (await agent.checkpoint(req)).processes == []


def test_kubelet_plugin_offers_backend_app(monkeypatch, capsys) -> None:
    from timeslice.cli.main import main
    from timeslice.driver import logs
    from timeslice.kubelet_plugin import app

    seen: list[app.KubeletPluginConfig] = []

    async def run(cfg: app.KubeletPluginConfig) -> None:
        seen.append(cfg)

    monkeypatch.setattr(app, "run", run)
    monkeypatch.setattr(logs, "setup", lambda level: None)  # keep pytest's log handlers
    main(["kubelet-plugin", "--node-name", "n", "--backends", "app,freeze,none"])
    assert seen[-1].backends == ("app", "freeze", "none")
    assert NodeAgent(StaticProcessResolver(), backends=seen[-1].backends).backend("app").name == "app"
    assert main(["kubelet-plugin", "--node-name", "n", "--backends", "app,tgi"]) == 2  # one line, no traceback
    assert "unknown ['tgi']; known: cuda, cuda-checkpoint, vmm, freeze, app, none" in capsys.readouterr().err
    assert "app (the job's inference engine" in " ".join(
        subprocess.run([sys.executable, "-m", "timeslice.cli.main", "kubelet-plugin", "--help"], capture_output=True,
                       text=True, check=True).stdout.split())


async def test_each_claim_set_brings_its_own_engine_to_the_switch_steps() -> None:
    """In a cluster the engine comes from each claim set's TimeSliceConfig, through the
    group spec, to the step the agent gets."""
    from timeslice.controller.grouping import ClaimSet, Group, JobConfig
    from timeslice.controller.orchestrator.agents import AgentClient
    from timeslice.controller.reconciler import group_spec

    engines = {j: ts_config.parse({"apiVersion": "timeslice.dev/v1alpha1", "kind": "TimeSliceConfig",
                                   "backend": "app", "app": {"engine": "vllm", "url": f"http://127.0.0.1:{port}",
                                                             "level": 2}}, j) for j, port in (("a", 8000), ("b", 8001))}
    sets = tuple(ClaimSet(job=f"ns/{j}", name="gpu", claims=(), devices=(), gpus=("GPU-0",), nodes=("n1",),
                          pods=(f"uid-{j}",), config=JobConfig.of(cfg)) for j, cfg in engines.items())
    spec = group_spec(Group(id="g0", claim_sets=sets, nodes=("n1",), gpus=("GPU-0",), backend="app",
                            lease_seconds=10), "cuda", lambda node: f"unix:///{node}.sock")
    assert spec.backend == "app"
    assert [spec.app(cs.id) for cs in sets] == [engines["a"].app, engines["b"].app]
    client = AgentClient("unix:///n1.sock")
    step = client._step_request(sets[1].id, "app", "g0", 5.0, spec.member(sets[1].id), "op", spec.app(sets[1].id))
    await client.close()
    assert (step.app.engine, step.app.url, step.app.level, step.app.timeout_seconds) == (
        "vllm", "http://127.0.0.1:8001", 2, 120.0)


def test_a_static_group_names_engines_with_backend_app_only() -> None:
    """Found by a new-user try: `backend: app` without `apps` failed only at the first switch
    (naming the claim config), and `apps` with another backend was silently ignored."""
    with pytest.raises(ValueError, match="backend app needs each job's engine: apps"):
        GroupSpec(id="g", backend="app", agents=("unix:///a.sock",))
    with pytest.raises(ValueError, match="apply to backend app only"):
        GroupSpec(id="g", backend="freeze", agents=("unix:///a.sock",),
                  apps={"a": AppEngine(engine="vllm", url="http://127.0.0.1:8000")})


@pytest.mark.parametrize("where", ["awake", "asleep"])
async def test_an_engine_whose_client_left_stays_where_it_is_and_sleeps_for_the_next_wake(
        make_cluster, children, engine_dirs, where: str) -> None:
    """a's client released and left (`Leave`: its process is done), its engine still up (a
    vLLM server outlives its client). Awake, it stays a resident: b's wake puts it to sleep
    first; it was forgotten, and b's engine woke beside it (app schedules seed 3: the next
    wake ran out of memory). Asleep, it stays asleep until a's job asks again: it was woken
    for nobody beside b's awake engine (a helper's attack: a wake that ran out of memory each
    time a client ended while its engine slept)."""
    log = engine_dirs[0]
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs)
    a, b = c.client("a"), c.client("b")
    try:
        await a.acquire(timeout=10)
        await a.release()
        if where == "asleep":
            await b.acquire(timeout=10)  # a sleeps
            await b.release()
        await a.close()  # Leave
        await b.acquire(timeout=10)
        await b.release()
        assert calls(log) == ["a sleep level=1"]  # (b never slept: nothing to wake)
        assert await is_sleeping(a_engine)
        a = c.client("a")  # a's job asks again: its engine is woken for it, and the grant says so
        assert (await a.acquire(timeout=10)).restored
        assert calls(log) == ["a sleep level=1", "b sleep", "a wake"] and not await is_sleeping(a_engine)
        await a.release()
    finally:
        for cl in (a, b):
            await cl.close()


async def test_an_engine_woken_for_a_client_that_left_meanwhile_stays_a_resident(
        make_cluster, children, engine_dirs) -> None:
    """a's client gave up and left (`Leave`) while its engine's wake for it ran: the engine is
    awake when the switch ends, so it is a resident that b's wake puts to sleep first. It was
    taken to be asleep still, and b's engine woke beside it (app schedules seed 3 in CI: a
    SIGTERMed job left during its switch, and the next wake ran out of memory)."""
    log = engine_dirs[0]
    c, a_engine = await two_jobs(make_cluster, children, engine_dirs)
    a, b = c.client("a"), c.client("b")
    try:
        await a.acquire(timeout=10)
        await a.release()
        await b.acquire(timeout=10)  # a sleeps
        await fault(a_engine, wake="hold")
        asking = asyncio.create_task(a.acquire(timeout=30))
        await b.release()  # b sleeps, a's wake begins
        await eventually(lambda: "a wake-held" in calls(log), timeout=10, what="a's wake")
        asking.cancel()
        await a.close()  # Leave, while its wake runs
        await fault(a_engine, wake="ok")
        await eventually(lambda: "a wake" in calls(log), timeout=10, what="a's wake to end")
        await b.acquire(timeout=10)
        assert calls(log) == ["a sleep level=1", "b sleep", "a wake-held", "a wake", "a sleep level=1", "b wake"]
        assert await is_sleeping(a_engine)
        await b.release()
    finally:
        for cl in (a, b):
            await cl.close()
