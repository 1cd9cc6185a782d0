#!/usr/bin/env python3
"""Randomized schedules of the real orchestrator, node agent and job processes on a model GPU,
with kills and pauses of each (issues 21, 22 and 26), for backend `cooperative`, `cuda`, `freeze`,
`none`, `app` or `vmm`.

Each schedule (a pure function of its seed) runs, as real processes through the product's
commands with default settings: `timeslice node-agent` (its GPU a model GPU: the ledger of
`kubelet_plugin/agent/model_gpu.py`, `$TIMESLICE_MODEL_GPU`), `timeslice orchestrator
--config` (one `cooperative` group on that agent, a pinned pool in /dev/shm, a state file),
and 2-4 job processes (`bench/schedule_job.py`: the real client, generate -> reward ->
train, memory growing after the first hold: model, then optimizer state, a KV cache per
generate; random sizes; half declare their memory with `TIMESLICE_MEMORY`). Fault events
at random times: kill -9, SIGTERM, or SIGSTOP then SIGCONT of a job process (a killed job
is restarted and must be granted again), of the node agent or of the orchestrator (each
restarted with the same config and state). Sizes are in model GB of 10**6 bytes: the model
GPU is "100 GB" (100 MB), so that the states the jobs copy stay small; the orchestrator's
headroom is relative (10%), and each job's peak fits the GPU alone with that headroom, so
every OOM is caused by placement.

`--backend cuda` runs the same schedules with the agent's real `cuda` backend over a fake
CUDA driver (bench/fake_cuda: the checkpoint API on the model GPU's ledger; job processes
that register nothing, whose GPU calls wait while the driver has them locked), and adds
0-2 driver faults per schedule (drawn apart from the rest of the schedule): a call of lock,
checkpoint, restore or unlock that hangs for seconds, answers a CUDA error, or ends the agent
after acting and before answering (a driver crash mid-step; the agent is started again).
`--backend freeze` (the agent stops and continues the job processes) and `--backend none` (the
lock alone) move no memory: their jobs, transparent as under `cuda`, are scaled to fit the GPU
together (`fit_together`). `--backend app`: each job is its own inference engine (vLLM's sleep
API on loopback, bench/schedule_job.py), which the agent's `app` backend puts to sleep and wakes.
`--backend vmm`: each job's state is device memory served by the real timeslice-vmm shim
(LD_PRELOAD) over the fake driver of bench/fake_cuda/vmm (built here with the machine's C
compiler), which the agent's `vmm` backend checkpoints into its pinned pool and restores; the
group's residency is `exclusive`, so that every hand-off moves the holder's state (the model GPU
counts the jobs' contexts and KV caches, not the states the shim moves); 0-2 faults of that driver
per schedule (`vmm_faults`: a copy that hangs, fails, or ends the job's process).

Found per schedule: OOMs (an allocation past the model GPU's total), altered states (a
job's state bytes differ from the pure function of its seed and step at a phase's start
or end, or are not on the GPU inside a hold; "(all zero)" marks a rewritten pool), double
computes (two jobs' GPU phases overlapping in time), jobs never granted again (still
waiting at the schedule's deadline), job errors (a job process that raised), and
orchestrator or agent crashes (an exit nobody asked for).

    python bench/schedules.py --count 1000 --seed 1 --workers 3 --out bench/results/schedules-cpu.json
    python bench/schedules.py --count 1 --seed 123 --keep -v     # one schedule again, logs kept
    python bench/schedules.py --count 500 --workers 20 --out OUT/s.json --failing-logs OUT/failing.tar  # elsewhere

Writes counts and, per failing schedule, its seed and a one-line reason per failure.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from timeslice.kubelet_plugin.agent.model_gpu import ENV as MODEL_GPU_ENV
from timeslice.kubelet_plugin.agent.model_gpu import ModelGpu

from bench import machine

GB = 10**6  # one model GB (see the module docstring)
TOTAL = 100 * GB
HEADROOM = 0.10  # the orchestrator's default memory_headroom
POOL_BYTES = 200 * GB
JOB_SCRIPT = Path(__file__).resolve().parent / "schedule_job.py"
FAKE_CUDA = Path(__file__).resolve().parent / "fake_cuda"
OOM_EXIT = 99
SETTLE_SECONDS = 75.0  # after the last fault: a lapsed lease (10 s) and a reconnect grace (10 s), twice, and more
READY_SECONDS = 60.0
BACKENDS = ("cooperative", "cuda", "freeze", "none", "app", "vmm")
# Backends that move no GPU memory (a frozen or waiting job keeps its memory on the GPU): their
# schedules' jobs fit together (`fit_together`); an OOM there is still caused by placement.
STAYING = ("freeze", "none")
CLASSES = ("oom_placement", "altered_states", "double_computes", "jobs_never_granted_again", "job_errors",
           "component_crashes")


@dataclass(frozen=True)
class JobSpec:
    """One job: sizes in bytes, times in seconds; `declare`: bytes it declares (0: none)."""

    name: str
    seed: int
    steps: int
    ctx: int
    model: int
    optim: int
    kv: int
    gen_s: float
    reward_s: float
    train_s: float
    declare: int
    start_s: float
    register_late: bool = False
    backend: str = "cooperative"

    @property
    def peak(self) -> int:
        return self.ctx + self.model + self.optim + self.kv


@dataclass(frozen=True)
class Fault:
    """At `at` seconds: `kind` (kill: SIGKILL, term: SIGTERM, stop: SIGSTOP for `pause_s`,
    then SIGCONT) to `target` ("orchestrator", "agent", or a job's name); a process that
    ended is started again `restart_s` later."""

    at: float
    target: str
    kind: str
    pause_s: float
    restart_s: float


@dataclass(frozen=True)
class Schedule:
    seed: int
    jobs: tuple[JobSpec, ...]
    faults: tuple[Fault, ...]
    backend: str = "cooperative"
    # backend cuda: bench/fake_cuda's $TIMESLICE_FAKE_CUDA_FAULTS; vmm: `vmm_faults`
    driver_faults: tuple[dict[str, Any], ...] = ()
    exit_seconds: float = 0.0  # cuda: an ended process's device bytes stay taken this long (model GPU)


DRIVER_ERRORS = ("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_ILLEGAL_STATE", "CUDA_ERROR_NOT_READY", "CUDA_ERROR_OUT_OF_MEMORY",
                 "CUDA_ERROR_OPERATING_SYSTEM", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_INITIALIZED",
                 "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_NOT_SUPPORTED")


@functools.cache
def fake_driver() -> types.ModuleType:
    """bench/fake_cuda's driver module, loaded apart from `cuda.bindings` (in the agent it
    stands for cuda-bindings; here only its names are read: `FAULTS_ENV`, `DIE_EXIT`, its enums)."""
    spec = importlib.util.spec_from_file_location("fake_cuda_driver", FAKE_CUDA / "cuda" / "bindings" / "driver.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def driver_faults(seed: int) -> tuple[dict[str, Any], ...]:
    """0-2 faults of the fake CUDA driver for the schedule of `seed` (bench/fake_cuda)."""
    rng = random.Random(f"{seed}:cuda")
    out = []
    for _ in range(rng.choice([0, 1, 1, 2])):
        kind = rng.choice(["hang", "error-once", "error-once", "die"])  # (an error that lasts fails the job, by design)
        out.append({"call": rng.choice(["lock", "checkpoint", "checkpoint", "restore", "restore", "unlock"]),
                    "nth": rng.randint(1, 4), "kind": kind, "error": rng.choice(DRIVER_ERRORS),
                    "seconds": round(rng.uniform(0.5, 12.0), 2)})
    return tuple(out)


VMM_DIE_EXIT = 86  # bench/fake_cuda/vmm/fake_libcuda.c: a `die` fault ends the job process with this code


def vmm_faults(seed: int, jobs: int) -> tuple[dict[str, Any], ...]:
    """0-2 faults of the vmm fake driver for the schedule of `seed` (bench/fake_cuda/vmm): at
    `at` seconds, `line` is written to job `job`'s faults file for `window` seconds: a copy out or
    in that hangs, fails once, fails for the whole window (at most 3 s: a fault that passes, which
    must cost no job; the orchestrator fails a job only once its restores have failed for
    `RESTORE_FAILURE_SECONDS`), or ends the job's process mid-copy (it is started again)."""
    rng = random.Random(f"{seed}:vmm")
    out = []
    for _ in range(rng.choice([0, 1, 1, 2])):
        call = rng.choice(["dtoh", "htod"])  # (not `create`: the job's own first allocation would fail, an OOM)
        kind = rng.choice(["hang", "error", "error-once", "die"])
        line = f"{call} {kind}" + (f" {rng.uniform(0.5, 3.0):.2f}" if kind == "hang" else "")
        out.append({"at": round(rng.uniform(0.2, 4.0), 2), "job": rng.randrange(jobs), "line": line,
                    "window": round(rng.uniform(0.3, 3.0), 2)})
    return tuple(out)


def make_schedule(seed: int, register_late: bool = False, backend: str = "cooperative") -> Schedule:
    """The schedule of `seed`: 2-4 jobs, 0-4 faults (a pure function of the seed).
    `register_late`: about half the jobs open their memory-command stream after their first
    hold (drawn apart, so that the rest of the schedule stays that of the seed). `backend`
    "cuda": the same jobs and faults and faults of the fake driver (`driver_faults`); "cuda" and
    "cooperative": an exit delay (`exit_delay`); `STAYING` backends:
    the same jobs and faults, scaled to fit together (`fit_together`)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(rng.randint(2, 4)):
        ctx = rng.randint(3, 8) * GB // 10
        model = rng.randint(4, 35) * GB
        kv = rng.randint(1, 15) * GB
        room = int(TOTAL * (1 - HEADROOM)) - ctx - model - kv
        optim = min(room, int(model * rng.uniform(0.3, 1.5))) if room > 0 else 0
        if room < 0:
            model += room
        spec = JobSpec(name=f"s{seed:07d}j{i}", seed=rng.randrange(1 << 30), steps=rng.randint(2, 4), ctx=ctx,
                       model=model, optim=max(optim, 0), kv=kv, gen_s=rng.uniform(0.03, 0.3),
                       reward_s=rng.uniform(0.02, 0.3), train_s=rng.uniform(0.03, 0.3), declare=0,
                       start_s=rng.uniform(0, 0.6))
        if rng.random() < 0.5:
            spec = JobSpec(**{**asdict(spec), "declare": spec.peak})
        if register_late and random.Random(f"{seed}:{i}:register").random() < 0.5:
            spec = JobSpec(**{**asdict(spec), "register_late": True})
        jobs.append(spec)
    targets = ["orchestrator", "agent", *(j.name for j in jobs)]
    faults: list[Fault] = []
    busy: dict[str, float] = {}
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4])):
        target = rng.choice(targets)
        kind = rng.choice(["kill", "term", "stop"])
        at = rng.uniform(0.2, 4.0)
        if at < busy.get(target, -1.0):
            continue
        f = Fault(at=at, target=target, kind=kind, pause_s=rng.uniform(0.1, 2.5) if kind == "stop" else 0.0,
                  restart_s=rng.uniform(0.0, 0.5))
        busy[target] = at + f.pause_s + f.restart_s + 1.0
        faults.append(f)
    if backend != "cooperative":
        jobs = [JobSpec(**{**asdict(j), "backend": backend, "register_late": False}) for j in jobs]
    if backend in STAYING:
        jobs = fit_together(jobs)
    return Schedule(seed, tuple(jobs), tuple(sorted(faults, key=lambda f: f.at)), backend,
                    driver_faults(seed) if backend == "cuda" else vmm_faults(seed, len(jobs)) if backend == "vmm"
                    else (),
                    exit_delay(seed) if backend in ("cuda", "cooperative") else 0.0)


def exit_delay(seed: int) -> float:
    """Seconds a killed job process's device bytes stay taken on the model GPU for the schedule of
    `seed` (on the H200 a job's process held its GPU memory 1.4-9.6 s after its last line:
    bench/results/rl-grpo-b-serve-cooperative-declared-66b7230-h200.json): 0-3 s, drawn apart."""
    return round(random.Random(f"{seed}:exit").uniform(0.0, 3.0), 2)


def fit_together(jobs: list[JobSpec]) -> list[JobSpec]:
    """`jobs` scaled down (each size by one factor) so that their peaks fit the GPU together
    with the headroom: backends that move no memory (`STAYING`) keep every job resident."""
    room = int(TOTAL * (1 - HEADROOM))
    total = sum(j.peak for j in jobs)
    if total <= room:
        return jobs
    out = []
    for j in jobs:
        sizes = {k: getattr(j, k) * room // total for k in ("ctx", "model", "optim", "kv")}
        spec = JobSpec(**{**asdict(j), **sizes})
        out.append(JobSpec(**{**asdict(spec), "declare": spec.peak}) if j.declare else spec)
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the harness's worker dies (no orphans)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Proc:
    """One restartable process: its command, and what happened to it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    ready: str | None = None  # a line it prints when it serves
    p: asyncio.subprocess.Process | None = None
    signalled: bool = False  # the last exit was asked for (a fault)
    exits: list[tuple[float, int | None, bool]] = field(default_factory=list)  # (monotonic, code, asked)
    stopped: bool = False

    async def start(self) -> None:
        self.signalled = False
        out = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # handed to the child
        try:
            self.p = await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, stdout=asyncio.subprocess.PIPE if self.ready else out, stderr=out,
                start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            os.close(out)
        if self.ready is None:
            return
        assert self.p.stdout is not None
        try:
            async with asyncio.timeout(READY_SECONDS):
                while True:
                    line = await self.p.stdout.readline()
                    if not line:
                        raise RuntimeError(f"{self.name} exited before it was ready (see {self.log})")
                    if self.ready in line.decode():
                        break
        except TimeoutError:
            raise RuntimeError(f"{self.name} not ready within {READY_SECONDS:g} s (see {self.log})") from None

    def send(self, sig: int) -> None:
        if self.p is not None and self.p.returncode is None:
            try:
                os.kill(self.p.pid, sig)
            except ProcessLookupError:
                pass

    async def wait(self) -> int | None:
        assert self.p is not None
        code = await self.p.wait()
        self.exits.append((time.monotonic(), code, self.signalled))
        return code

    @property
    def alive(self) -> bool:
        return self.p is not None and self.p.returncode is None


class Run:
    """One schedule, run in `workdir`."""

    def __init__(self, sched: Schedule, workdir: Path) -> None:
        self.s = sched
        self.dir = workdir
        self.ledger = ModelGpu.create(workdir / "gpu.json", TOTAL, exit_seconds=sched.exit_seconds)
        self.pool = Path(f"/dev/shm/timeslice-schedules-{sched.seed}-{os.getpid()}")
        base = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
        self.target = f"unix://{workdir / 'orch.sock'}"
        agent_target = f"unix://{workdir / 'agent.sock'}"
        config: dict[str, Any] = {"listen": self.target, "state_file": str(workdir / "orch-state.json"),
                                  "groups": [{"id": "g", "backend": sched.backend, "agents": [agent_target]}]}
        agent_env = {**base, MODEL_GPU_ENV: str(self.ledger.path)}
        if sched.backend == "cooperative":
            config["pinned_pool"] = {"path": str(self.pool), "bytes": POOL_BYTES}
        elif sched.backend == "cuda":  # the agent's real backend over the fake driver (bench/fake_cuda)
            agent_env["PYTHONPATH"] = os.pathsep.join([str(FAKE_CUDA), *filter(None, [base.get("PYTHONPATH")])])
            agent_env[fake_driver().FAULTS_ENV] = json.dumps(list(sched.driver_faults))
        job_env: dict[str, str] = {}
        if sched.backend == "vmm":  # the real shim in the jobs, over the fake driver
            from timeslice.driver import vmm_shim

            fake = workdir / "libfakecuda.so"
            subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-O1", "-o", str(fake),
                            str(FAKE_CUDA / "vmm" / "fake_libcuda.c")], check=True)
            config["groups"][0]["residency"] = "exclusive"
            job_env = {"LD_PRELOAD": str(vmm_shim.library()), "TIMESLICE_VMM_LIBCUDA": str(fake),
                       vmm_shim.DIR_ENV: str(workdir / "vmm"), "TIMESLICE_VMM_CHUNK_BYTES": str(2 << 20)}
            agent_env["TIMESLICE_VMM_POOL_BYTES"] = str(POOL_BYTES)
        ports = {j.name: machine.free_port() for j in sched.jobs} if sched.backend == "app" else {}
        if ports:  # each job is its own engine (bench/schedule_job.py `Engine`)
            config["groups"][0]["apps"] = {name: {"engine": "vllm", "url": f"http://127.0.0.1:{port}"}
                                           for name, port in ports.items()}
        (workdir / "config.json").write_text(json.dumps(config))  # YAML is a superset of JSON
        cli = [sys.executable, "-m", "timeslice.cli.main"]
        offered = ["--backends", "app"] if ports else []  # app is offered on request (node-agent --help)
        self.agent = Proc("agent", [*cli, "node-agent", "--listen", agent_target, "--state-dir",
                                    str(workdir / "agent"), *offered], agent_env,
                          workdir / "agent.log", ready="ready listen=")
        self.orch = Proc("orchestrator", [*cli, "orchestrator", "--config", str(workdir / "config.json")], base,
                         workdir / "orchestrator.log")
        self.jobs: dict[str, Proc] = {}
        for j in sched.jobs:
            spec = {"job": j.name, "group": "g", "target": self.target, "ledger": str(self.ledger.path),
                    "log": str(workdir / f"{j.name}.events"), "seed": j.seed, "steps": j.steps, "ctx": j.ctx,
                    "model": j.model, "optim": j.optim, "kv": j.kv, "gen_s": j.gen_s, "reward_s": j.reward_s,
                    "train_s": j.train_s, "register_late": j.register_late, "backend": j.backend,
                    "engine_port": ports.get(j.name, 0)}
            if sched.backend == "vmm":  # (empty until a driver fault is due: `_vmm_fault`)
                (workdir / f"{j.name}.faults").write_text("")
                job_env = {**job_env, "TIMESLICE_FAKE_VMM_FAULTS": str(workdir / f"{j.name}.faults")}
            env = {**base, **job_env, "TIMESLICE_JOB": j.name, "TIMESLICE_ACCELERATOR_PROCESS": "1",
                   **({"TIMESLICE_MEMORY": f"{j.declare}B"} if j.declare else {})}
            self.jobs[j.name] = Proc(j.name, [sys.executable, str(JOB_SCRIPT), json.dumps(spec)], env,
                                     workdir / f"{j.name}.log")
        self.outcome: dict[str, str] = {}  # job -> done | oom | error (exit code) | running
        self.crashes: list[str] = []
        self.t0 = 0.0

    async def _orch_ready(self) -> None:
        """The orchestrator serves once its socket accepts a health check (it prints nothing)."""
        import grpc.aio
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + READY_SECONDS
        async with grpc.aio.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if not self.orch.alive:
                    raise RuntimeError(f"orchestrator exited before it was ready (see {self.orch.log})")
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=2, wait_for_ready=True)
                    return
                except grpc.aio.AioRpcError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"orchestrator not ready within {READY_SECONDS:g} s") from None
                    await asyncio.sleep(0.05)

    async def _component(self, proc: Proc, done: asyncio.Event) -> None:
        """Keep a server running: restart it after each exit (a crash is recorded)."""
        while not done.is_set():
            code = await proc.wait()
            if done.is_set():
                return
            if not self._asked(proc, code):
                self.crashes.append(f"{proc.name} exited by itself with code {code} at "
                                    f"{time.monotonic() - self.t0:.2f} s (see its log)")
            await asyncio.sleep(self._restart_delay.get(proc.name, 0.0))
            await self._restart(proc)

    def _asked(self, proc: Proc, code: int | None) -> bool:
        """Whether a fault ended `proc`: a signal, or a planned death of the fake driver in the agent."""
        return proc.signalled or (proc is self.agent and code == fake_driver().DIE_EXIT)

    async def _restart(self, proc: Proc) -> None:
        """Start `proc` again, as a supervisor would, also when a fault ends it before it is
        ready (cuda seed 259: the agent SIGTERMed while it started again stayed down, and
        every job waited for it; cuda seed 990: the fake driver's planned death in the agent's
        undo of an interrupted checkpoint at its start); an exit before ready that no fault
        asked for is a crash, unless the schedule ended meanwhile (cooperative seed 60321: the
        teardown's SIGTERM reached the agent as it started again after a kill, and was counted)."""
        while True:
            try:
                await proc.start()
                return
            except RuntimeError as err:
                if self._done.is_set():  # the schedule ended meanwhile: the teardown's SIGTERM ended it
                    return
                ended = proc.signalled or "exited before it was ready" in str(err)
                if not ended or not self._asked(proc, await proc.wait()):  # (a signal it was sent ends it)
                    self.crashes.append(f"{proc.name} did not start again: {err}")
                    raise

    async def _job(self, spec: JobSpec) -> None:
        proc = self.jobs[spec.name]
        await asyncio.sleep(spec.start_s)
        while True:
            await proc.start()
            code = await proc.wait()
            if proc.signalled or (self.s.backend == "vmm" and code == VMM_DIE_EXIT):
                # killed by a fault (or the vmm fake driver's, mid-copy): started again, it must be granted again
                await asyncio.sleep(self._restart_delay.pop(spec.name, 0.0))
                continue
            self.outcome[spec.name] = "done" if code == 0 else "oom" if code == OOM_EXIT else f"exit {code}"
            return

    async def _fault(self, f: Fault) -> None:
        await asyncio.sleep(max(0.0, self.t0 + f.at - time.monotonic()))
        proc = self.orch if f.target == "orchestrator" else self.agent if f.target == "agent" else self.jobs[f.target]
        if not proc.alive:
            return
        self.applied.append(f)
        if f.kind == "stop":
            proc.send(signal.SIGSTOP)
            proc.stopped = True
            await asyncio.sleep(f.pause_s)
            proc.stopped = False
            proc.send(signal.SIGCONT)
            return
        self._restart_delay[proc.name] = f.restart_s
        proc.signalled = True
        proc.send(signal.SIGKILL if f.kind == "kill" else signal.SIGTERM)

    async def _vmm_fault(self, f: dict[str, Any]) -> None:
        """A fault of the vmm fake driver in one job's processes for its window (`vmm_faults`)."""
        await asyncio.sleep(max(0.0, self.t0 + f["at"] - time.monotonic()))
        faults = self.dir / f"{self.s.jobs[f['job']].name}.faults"
        faults.write_text(f["line"] + "\n")
        await asyncio.sleep(f["window"])
        faults.write_text("")

    async def run(self) -> None:
        self._restart_delay: dict[str, float] = {}
        self.applied: list[Fault] = []
        done = self._done = asyncio.Event()
        await self.agent.start()
        await self.orch.start()
        await self._orch_ready()
        self.orch.ready = None  # a restart is not waited for: clients retry while it starts
        self.t0 = time.monotonic()
        comps = [asyncio.create_task(self._component(p, done)) for p in (self.agent, self.orch)]
        faults = [asyncio.create_task(self._fault(f)) for f in self.s.faults]
        if self.s.backend == "vmm":
            faults += [asyncio.create_task(self._vmm_fault(f)) for f in self.s.driver_faults]
        jobs = [asyncio.create_task(self._job(j)) for j in self.s.jobs]
        last = max([f.at + f.pause_s + f.restart_s for f in self.s.faults] + [j.start_s for j in self.s.jobs])
        try:
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=last + SETTLE_SECONDS)
        except TimeoutError:
            pass
        finally:
            done.set()
            for t in faults:
                t.cancel()
            for p in [*self.jobs.values(), self.agent, self.orch]:
                p.send(signal.SIGCONT)
            for j in self.s.jobs:
                if j.name not in self.outcome:
                    self.outcome[j.name] = "running"
                    self.jobs[j.name].send(signal.SIGKILL)
            for p in (self.orch, self.agent):
                p.send(signal.SIGTERM)
            await asyncio.gather(*comps, return_exceptions=True)
            for p in [*self.jobs.values(), self.agent, self.orch]:
                if p.alive:
                    try:
                        await asyncio.wait_for(p.p.wait(), 10)  # type: ignore[union-attr]
                    except TimeoutError:
                        p.send(signal.SIGKILL)
                        await p.p.wait()  # type: ignore[union-attr]
            self.pool.unlink(missing_ok=True)


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def analyze(run: Run) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """[(class, reason)] of one finished run, and its counters."""
    failures: list[dict[str, str]] = []
    info: Counter[str] = Counter()
    owner: dict[int, str] = {}
    intervals: list[tuple[float, float, str, int, str, int]] = []  # (begin, end, job, pid, kind, step)
    exits = {name: [t for t, _, _ in p.exits] for name, p in run.jobs.items()}
    restarted_orch = any(f.target == "orchestrator" and f.kind != "stop" for f in run.applied)

    def add(cls: str, reason: str) -> None:
        failures.append({"class": cls, "reason": reason})

    for spec in run.s.jobs:
        events = _events(run.dir / f"{spec.name}.events")
        open_: dict[int, dict[str, Any]] = {}
        last: dict[str, Any] | None = None
        for e in events:
            owner[e["pid"]] = spec.name
            last = e
            if e["ev"] == "begin":
                open_[e["pid"]] = e
            elif e["ev"] == "paused" and e["pid"] in open_:  # could not compute meanwhile: two intervals
                b = open_[e["pid"]]
                intervals.append((b["t"], e["start"], spec.name, e["pid"], b["kind"], b["step"]))
                open_[e["pid"]] = {**b, "t": e["until"]}
            elif e["ev"] in ("end", "releasing") and e["pid"] in open_:  # releasing: a phase cut short (SIGTERM)
                b = open_.pop(e["pid"])
                intervals.append((b["t"], e["t"], spec.name, e["pid"], b["kind"], b["step"]))
            elif e["ev"] == "altered":
                why = e["why"] + (" after an orchestrator restart" if restarted_orch and e.get("zero") else "")
                add("altered_states", f"{spec.name} pid {e['pid']}: {why}")
            elif e["ev"] == "switch_failed":
                info["switch_failed_retries"] += 1
            elif e["ev"] == "error":
                add("job_errors", f"{spec.name} pid {e['pid']}: {e['error']}")
        for pid, b in open_.items():  # a phase its process did not end (killed in it): until the process ended
            end = next((t for t in exits[spec.name] if t >= b["t"]), time.monotonic())
            intervals.append((b["t"], end, spec.name, pid, b["kind"], b["step"]))
        outcome = run.outcome.get(spec.name, "running")
        if outcome == "running":
            where = f"last event {last['ev']} {last.get('kind', '')} step {last.get('step', '')}" if last else \
                "no event"
            add("jobs_never_granted_again", f"{spec.name}: not done at the deadline ({where}; "
                                            f"{len(exits[spec.name])} exits before)")
        elif outcome.startswith("exit") and not any(f["reason"].startswith(spec.name) and f["class"] == "job_errors"
                                                     for f in failures):
            add("job_errors", f"{spec.name}: {outcome} (see {spec.name}.log)")
    for o in run.ledger.ooms():
        held = ", ".join(f"{owner.get(int(p), 'pid ' + p)}={b / GB:.1f}" for p, b in o["held"].items())
        add("oom_placement", f"{owner.get(o['pid'], o['pid'])} asked {o['want'] / GB:.1f} GB for {o['what']} with "
                             f"{o['free'] / GB:.1f} GB free (held: {held})")
    intervals.sort()
    for i, a in enumerate(intervals):
        for b in intervals[i + 1:]:
            if b[0] >= a[1]:
                break
            if b[2] != a[2]:
                add("double_computes", f"{a[2]} {a[4]} step {a[5]} [{a[0] - run.t0:.3f}, {a[1] - run.t0:.3f}] "
                                       f"overlaps {b[2]} {b[4]} step {b[5]} [{b[0] - run.t0:.3f}, "
                                       f"{b[1] - run.t0:.3f}] s")
    for c in run.crashes:
        add("component_crashes", c)
    info["phases"] = len(intervals)
    return failures, dict(info)


def _fault_text(f: Fault) -> str:
    """"kill job1 at 1.23", "stop orchestrator at 0.50 for 1.20" (seconds)."""
    who = f"job{f.target.rpartition('j')[2]}" if f.target.startswith("s") else f.target
    return f"{f.kind} {who} at {f.at:.2f}" + (f" for {f.pause_s:.2f}" if f.kind == "stop" else "")


def run_one(seed: int, keep: bool = False, register_late: bool = False,
            backend: str = "cooperative") -> dict[str, Any]:
    """Run the schedule of `seed`; its result (the work directory is removed unless it
    failed or `keep`)."""
    sched = make_schedule(seed, register_late, backend)
    workdir = Path(tempfile.mkdtemp(prefix=f"tss{seed}-", dir="/tmp"))
    t0 = time.monotonic()
    run = Run(sched, workdir)
    try:
        asyncio.run(run.run())
        failures, info = analyze(run)
    except Exception as err:  # the harness itself failed: that schedule counts as failed
        failures, info = [{"class": "harness", "reason": f"{type(err).__name__}: {err}"}], {}
    applied = [_fault_text(f) for f in getattr(run, "applied", [])]
    applied += [f"driver {f['call']} #{f['nth']} {f['kind']} (planned)"
                + (f" {f['error']}" if f["kind"] == "error" else "")
                if backend == "cuda" else f"driver '{f['line']}' in job {f['job']} at {f['at']} for {f['window']} s"
                for f in sched.driver_faults]
    applied += [f"exits free device memory after {sched.exit_seconds} s"] if sched.exit_seconds else []
    result = {"seed": seed, "jobs": len(sched.jobs), "faults": applied,
              "seconds": round(time.monotonic() - t0, 2), "failures": failures, **info}
    if failures or keep:
        result["workdir"] = str(workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def summarize(results: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    counts = Counter(f["class"] for r in results for f in r["failures"])
    with_class = Counter(c for r in results for c in {f["class"] for f in r["failures"]})
    faults = Counter(" ".join(f.split()[:2]).rstrip("0123456789") for r in results for f in r["faults"])
    return {
        "what": f"randomized schedules: timeslice orchestrator + node-agent + job processes of backend {args.backend} "
                "on a model GPU of 100 model GB (10**6 bytes each), default settings, with kills and pauses of each"
                + (" and faults of the fake CUDA driver (bench/fake_cuda)" if args.backend == "cuda" else ""),
        "backend": args.backend,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "schedules": len(results),
        "schedules_failed": sum(1 for r in results if r["failures"]),
        "counts": {c: counts.get(c, 0) for c in (*CLASSES, *(k for k in counts if k not in CLASSES))},
        "schedules_with": {c: with_class.get(c, 0) for c in (*CLASSES, *(k for k in with_class if k not in CLASSES))},
        "faults_applied": dict(sorted(faults.items())),
        "switch_failed_retries": sum(r.get("switch_failed_retries", 0) for r in results),
        "phases": sum(r.get("phases", 0) for r in results),
        "seconds": round(seconds, 1),
        "schedule_seconds_p50": sorted(r["seconds"] for r in results)[len(results) // 2] if results else 0,
        "failing": [{"seed": r["seed"], "faults": r["faults"], "reasons": [f"{f['class']}: {f['reason']}"
                                                                          for f in r["failures"]]}
                    for r in results if r["failures"]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=20, help="schedules to run (default 20)")
    ap.add_argument("--seed", type=int, default=1, help="first seed; schedule i has seed SEED+i (default 1)")
    ap.add_argument("--workers", type=int, default=4, help="schedules run at once (default 4: a schedule mostly waits)")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--keep", action="store_true", help="keep every work directory (logs), not only failing ones")
    ap.add_argument("--register-late", action="store_true",
                    help="about half the jobs register their state after their first hold (model on the GPU), not "
                         "before it (default: all before, when it is 0 bytes)")
    ap.add_argument("--backend", choices=BACKENDS, default="cooperative",
                    help="the group's backend: cooperative job processes, or transparent ones moved by the agent's "
                         "cuda backend over a fake driver with faults, stopped by its freeze backend, only "
                         "ordered by the lock (none), slept and woken as inference engines (app), or moved by the "
                         "agent's vmm backend through the real shim over a fake driver with faults (vmm); freeze "
                         "and none jobs fit together (default cooperative)")
    ap.add_argument("--failing-logs", metavar="FILE.tar",
                    help="add each failing schedule's work directory to this tar as it fails (a run on another "
                         "machine, e.g. the lent GPU host, brings its logs back)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each schedule's result as it ends")
    args = ap.parse_args(argv)
    seeds = list(range(args.seed, args.seed + args.count))
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as ex:
        futures = [ex.submit(run_one, seed, args.keep, args.register_late, args.backend) for seed in seeds]
        for future in as_completed(futures):
            r = future.result()
            results.append(r)
            if args.verbose or r["failures"]:
                print(json.dumps(r), file=sys.stderr, flush=True)
            if args.failing_logs and r["failures"] and "workdir" in r:
                with tarfile.open(args.failing_logs, "a") as tar:
                    tar.add(r["workdir"], arcname=Path(r["workdir"]).name)
            if len(results) % 25 == 0:
                print(f"# {len(results)}/{len(seeds)} schedules, {sum(1 for x in results if x['failures'])} failed, "
                      f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
                if args.out:  # so far: a run stopped early still leaves its counts and its machine
                    so_far = summarize(sorted(results, key=lambda r: r["seed"]), args, time.monotonic() - t0)
                    Path(args.out).write_text(json.dumps({**so_far, "machine": machine.describe()}, indent=2) + "\n")
    results.sort(key=lambda r: r["seed"])
    summary = summarize(results, args, time.monotonic() - t0)
    machine.emit(summary, args.out)
    return 1 if summary["schedules_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
