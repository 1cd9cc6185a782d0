#!/usr/bin/env python3
r"""RL benchmark: N GRPO-shaped jobs (bench/rl_job.py) alone, then sharing one GPU through the product's commands.

Solo: each job runs alone with no client (`--no-orchestrator`), one after the other; the baseline
is the sum of their wall times. Shared: the product's commands run as subprocesses, with their
default settings, as a user runs them (docs/one-box.md):

  --modes serve   `timeslice serve --config GROUPS.yaml` (one box). The jobs find it as the README
                  says a user's job does: `TIMESLICE_ORCHESTRATOR=unix://...` from serve's ready line,
                  and `TIMESLICE_GROUP=gpu`; each job is its own process group (a new session, like
                  `setsid`), so it needs no job id.
  --modes agent   `timeslice node-agent` + `timeslice orchestrator --config GROUPS.yaml` on this
                  machine (loopback: the agent on a unix socket, the orchestrator on 127.0.0.1 with a
                  port it picks; docs/one-box.md, "Several machines"), each job started with `TIMESLICE_JOB=job-<i>`
                  and `TIMESLICE_ORCHESTRATOR=127.0.0.1:<port>`.

GROUPS.yaml holds one group, `gpu`, with the backend (`--backends`: cuda, cooperative; freeze or none
for CPU jobs) and nothing else, unless a flag of this bench asks (`--lease-seconds`, `--headroom`,
`--residency`, `--resident-first`, `--step-timeout`, `--pool-gb`: each left out of the file, hence the
product's default, unless given). Paths only are chosen here: each run's sockets in a fresh temporary
folder and its state (`--state-dir`) under its log folder, so no run inherits another's records. The
bench waits for each server's ready line (never a fixed sleep), stops the servers at the end (SIGTERM,
then SIGKILL after --stop-timeout seconds), and keeps every log (`--logs DIR`, default a new folder
under /tmp). A job's memory grows after its first hold as a real job's does (rl_job.py: the model and
the extra tensor built on the GPU in the first hold, AdamW's state at the first train step).
`--declare-memory` sets `TIMESLICE_MEMORY` (bytes per GPU) in each job's environment, as a user
declares a job's peak: `--declare-memory-gb`, else the job's solo peak (NVML's count for the solo
process at its end; without it, PyTorch's peak reserved bytes + 1 GiB for the CUDA context).

A job that exits non-zero (or prints no result, or outlives --job-timeout seconds) is lost; the others
go on, as users' jobs would. Prints (and writes to --out) a JSON list, one object per shared run (mode,
backend): `jobs_lost` (job, exit code, the last lines of its stderr: OOM, LeaseLost, SwitchFailed...),
seconds_solo_sum, seconds_shared (the jobs' start to the last one's end; the servers' start-up is
`servers_ready_seconds`), gain (= seconds_solo_sum / seconds_shared), gain_phases (the same without the
jobs' start-up), gpu_busy_fraction (union of GPU phases over the shared span), gpu_time_bound (sum of solo
seconds / sum of solo GPU-busy seconds: the gain of a GPU kept 100% busy) and gain / gpu_time_bound,
switches (count, seconds, bytes out and in; every record, read from the orchestrator's status every
--status-interval seconds), hand-off milliseconds (a release to the next job's grant when it waited; p50,
p99; "resident": neither a job's first grant nor one that moved memory), failed switches, the parameter
hashes solo vs shared per seed (bitwise_equal: every job finished and equals its solo run), whether every
job's extra tensor came through unchanged (extra_ok), the mean seconds of each phase kind solo vs shared
and the mean of its process counters (`phase_usage_*`: CPU seconds, faults, CUDA allocator calls),
the host's memory over the shared run (`host_memory`: MemAvailable when the jobs started and the least
seen, /proc/vmstat reclaim and fault counts), each job process's end after its result (`exit_seconds`: its
wall time less its own total_seconds; `exit_samples`, `solo_exit_samples`: what its threads were doing
meanwhile, counted over samples every 0.1 s: thread, state, wchan and, as root, innermost kernel frames),
every shared job's phases (`job_phases`: job -> [{kind, step, acquire, granted, done, released}], unix
seconds), `status` (the output of `timeslice status --json` at the end), `commands` (every command run,
with the environment variables the bench set), `logs` (each server's and job's log file), `machine`
(bench/machine.py). A run whose servers did not start has `error` instead of the measurements. Exit
status: 0, or 1 when a run failed, lost a job, or a job's parameters or extra tensor differ from solo.

`--plot PNG` draws each shared run's timeline (one panel per run: waits, GPU phases, checkpoints and
restores with their bytes; timeslice.cli.timeline, needs matplotlib: the `plot` extra); `timeslice plot
RESULT.json` draws a saved result. Solo runs may come from an earlier run (--solo-json, same model,
steps and --extra-gb).

With `--nproc R` each job is `torchrun --standalone --nproc-per-node R` (R data-parallel ranks on GPUs
0..R-1, NCCL all-reduce in every train step, rl_job.py): the node agent finds the ranks as the job's
processes, and the shared runs switch all of a job's ranks together. With `--nccl-transparent` every job
(solo too, so the math is the same) runs with NCCL's peer-to-peer and shared-memory transports off
(NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1): the transparent backends refuse processes whose GPU memory
other processes map (issue 14).

    python bench/rl_grpo.py --jobs 2 --extra-gb 7 --modes serve agent --backends cuda cooperative \
        --out bench/results/rl-grpo-a.json
    python bench/rl_grpo.py --size tiny --device cpu --jobs 2 --steps 2 --reward-seconds 0.2 --backends freeze
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from timeslice.cli import timeline
from timeslice.cli.demo import percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import machine  # noqa: E402

GROUP = "gpu"
CONTEXT_BYTES = 1 << 30  # a CUDA context and what PyTorch keeps beside its cache, when NVML cannot say
STDERR_TAIL_LINES = 15
READY_SERVE = re.compile(r"^ready TIMESLICE_ORCHESTRATOR=(\S+)(?: LD_PRELOAD=(\S+))?")
READY_AGENT = re.compile(r"^ready listen=(\S+)")
READY_ORCHESTRATOR = re.compile(r"orchestrator serving listen=\S+ port=(\d+)")


class BenchError(Exception):
    """A shared run that could not start (a server that exited or never got ready)."""


# ---- the product's commands --------------------------------------------------------------------------------------

def timeslice_command(flag: str | None) -> list[str]:
    """The `timeslice` command: --timeslice (split like a shell), else the one beside this Python, else on PATH,
    else `python -m timeslice.cli.main` (the same entry point: a `pip install --target` puts no script on PATH)."""
    if flag:
        return shlex.split(flag)
    beside = Path(sys.executable).parent / "timeslice"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("timeslice")
    return [found] if found else [sys.executable, "-m", "timeslice.cli.main"]


@dataclass
class Server:
    """One of the product's servers, started by `start_server`: its output goes line by line to `log`."""

    name: str
    argv: list[str]
    log: Path
    proc: asyncio.subprocess.Process
    pump: asyncio.Task[None]
    exit_code: int | None = None
    killed: bool = False


async def start_server(name: str, argv: list[str], log: Path, ready: re.Pattern[str], timeout: float,
                       env: dict[str, str]) -> tuple[Server, re.Match[str]]:
    """Start `argv` (stdout and stderr into `log`) and wait until a line of its output matches `ready`; returns
    the server and that match. Raises BenchError (it exited first, or `timeout` seconds passed: it is stopped)."""
    out = log.open("wb")
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                env=env, start_new_session=True, limit=1 << 20)
    matched: asyncio.Future[re.Match[str]] = asyncio.get_running_loop().create_future()

    async def pump() -> None:
        assert proc.stdout is not None
        try:
            async for line in proc.stdout:
                out.write(line)
                out.flush()
                if not matched.done() and (m := ready.search(line.decode(errors="replace"))):
                    matched.set_result(m)
        finally:
            out.close()
            if not matched.done():
                matched.set_exception(BenchError(f"{name} exited before it was ready (exit code "
                                                 f"{await proc.wait()}): {tail(log)}"))

    server = Server(name, argv, log, proc, asyncio.create_task(pump()))
    try:
        return server, await asyncio.wait_for(asyncio.shield(matched), timeout)
    except TimeoutError:
        await stop_server(server, 5.0)
        raise BenchError(f"{name} printed no ready line within {timeout:g} s: {tail(log)}") from None
    except BenchError:
        await stop_server(server, 5.0)
        raise


async def stop_server(server: Server, timeout: float) -> None:
    """SIGTERM, then SIGKILL (its whole session) after `timeout` seconds; records its exit code."""
    if server.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            server.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(server.proc.wait(), timeout)
        except TimeoutError:
            server.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGKILL)
    server.exit_code = await server.proc.wait()
    await server.pump


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last `lines` lines of a text file ('' when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---- the jobs ----------------------------------------------------------------------------------------------------

def clean_env(a: argparse.Namespace) -> dict[str, str]:
    """This process's environment without TIMESLICE_* (a job must see only what the bench sets), with NCCL's
    peer transports off under --nccl-transparent."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_") or k == "TIMESLICE_MACHINE"}
    if a.nccl_transparent:
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    return env


def job_args(a: argparse.Namespace, seed: int) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc)] \
        if a.nproc > 1 else [sys.executable]
    return [*launcher, str(ROOT / "bench" / "rl_job.py"), "--seed", str(seed), "--size", a.size,
            "--steps", str(a.steps), "--batch", str(a.batch), "--new-tokens", str(a.new_tokens),
            "--reward-seconds", str(a.reward_seconds), "--extra-gb", str(a.extra_gb), "--device", a.device]


@dataclass
class JobRun:
    """A finished (or lost) job: its exit code, its result (rl_job.py's last stdout line) or None, its logs."""

    name: str
    seed: int
    pid: int
    exit_code: int
    result: dict[str, Any] | None
    stderr: Path
    timed_out: bool = False
    seconds: float = 0.0
    exit_samples: dict[str, int] = field(default_factory=dict)

    def lost(self) -> dict[str, Any] | None:
        if self.exit_code == 0 and self.result is not None:
            return None
        why = (f"killed after {self.seconds:.0f} s (--job-timeout)" if self.timed_out
               else "no result line" if self.exit_code == 0 else f"exit code {self.exit_code}")
        return {"job": self.name, "seed": self.seed, "exit_code": self.exit_code, "why": why,
                "stderr_tail": tail(self.stderr), "log": str(self.stderr)}


async def run_job(name: str, seed: int, argv: list[str], env: dict[str, str], logs: Path, deadline: float,
                  started: asyncio.Queue[int] | None = None) -> JobRun:
    """Run one job in a session of its own (its process group is the job in `serve` mode; a lost job's ranks go
    with it): stdout to `logs/<name>.out`, stderr to `logs/<name>.log`. At `deadline` (monotonic seconds) it is
    killed. Never raises for the job's own failure: the JobRun says."""
    out, err = logs / f"{name}.out", logs / f"{name}.log"
    t0 = time.monotonic()
    with out.open("wb") as fo, err.open("wb") as fe:
        proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=fo, stderr=fe, start_new_session=True)
    if started is not None:
        started.put_nowait(proc.pid)
    timed_out = False
    samples: dict[str, int] = {}
    stop_sampler = threading.Event()
    sampler = asyncio.create_task(asyncio.to_thread(sample_exit, proc.pid, out, samples, stop_sampler))
    try:
        await asyncio.wait_for(proc.wait(), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        timed_out = True
    finally:
        stop_sampler.set()
        if proc.returncode is None:  # timed out, or the bench itself was stopped: the job goes (it holds memory)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    with contextlib.suppress(ProcessLookupError):  # ranks or children left behind by the job's launcher
        os.killpg(proc.pid, signal.SIGKILL)
    await sampler
    result = None
    lines = out.read_text(errors="replace").strip().splitlines()
    if proc.returncode == 0 and lines:
        with contextlib.suppress(json.JSONDecodeError):
            result = json.loads(lines[-1])
    return JobRun(name, seed, proc.pid, proc.returncode, result, err, timed_out, time.monotonic() - t0, samples)


EXIT_SAMPLE_SECONDS = 0.1


def top_samples(samples: dict[str, int], n: int = 12) -> dict[str, int]:
    return dict(sorted(samples.items(), key=lambda kv: -kv[1])[:n])


def sample_exit(pid: int, out: Path, samples: dict[str, int], stop: threading.Event) -> None:
    """From the job's result line (its stdout gets only that line) until the process ends or `stop` is set, every
    `EXIT_SAMPLE_SECONDS`: what each of its threads is doing, counted by "thread state wchan | innermost kernel
    frames" (thread: "main", or the thread's name; /proc/<pid>/task/<tid>/{comm,stat,wchan,stack}; the stack is
    readable by root only, the rest by the job's user): where a process spends the time between its result and
    its end. Runs in a thread of its own."""
    while not stop.wait(EXIT_SAMPLE_SECONDS):
        if not out.exists() or out.stat().st_size == 0:
            continue
        try:
            tids = [t.name for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            return
        for tid in tids:
            d = Path(f"/proc/{pid}/task/{tid}")
            with contextlib.suppress(OSError, IndexError):
                state = d.joinpath("stat").read_text().rpartition(")")[2].split()[0]
                wchan = d.joinpath("wchan").read_text().strip() or "-"
                try:
                    frames = [ln.split()[1].split("+")[0] for ln in d.joinpath("stack").read_text().splitlines()[:6]]
                except OSError:
                    frames = []
                thread = "main" if tid == str(pid) else d.joinpath("comm").read_text().strip()
                key = f"{thread} {state} {wchan} | {' < '.join(frames)}"
                samples[key] = samples.get(key, 0) + 1


async def solo(a: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    """Each job alone, one after the other, with no client. Raises BenchError when one fails (no baseline)."""
    results = []
    for i in range(a.jobs):
        t0 = time.time()
        run = await run_job(f"solo-{i}", i, [*job_args(a, i), "--no-orchestrator"], clean_env(a), logs,
                            time.monotonic() + a.job_timeout)
        if run.lost() is not None or run.result is None:
            raise BenchError(f"solo run of seed {i} failed: {run.lost()}")
        r = {**run.result, "wall_seconds": time.time() - t0, "exit_samples": run.exit_samples}
        results.append(r)
        print(f"solo seed={i} seconds={r['wall_seconds']:.1f} busy={r['gpu_busy_seconds']:.1f}", file=sys.stderr)
    return results


def declared_memory(a: argparse.Namespace, solo_runs: list[dict[str, Any]], seed: int) -> tuple[int, str] | None:
    """(bytes per GPU, where from) for TIMESLICE_MEMORY, or None without --declare-memory."""
    if a.declare_memory_gb is not None:
        return int(a.declare_memory_gb * 1e9), "--declare-memory-gb"
    if not a.declare_memory:
        return None
    r = solo_runs[seed]
    if r.get("process_gpu_bytes"):
        return int(r["process_gpu_bytes"]), "solo run: NVML bytes of the process at its end"
    if r.get("peak_reserved_bytes"):
        return int(r["peak_reserved_bytes"]) + CONTEXT_BYTES, "solo run: PyTorch peak reserved + 1 GiB"
    return int(r["peak_allocated_bytes"]) + CONTEXT_BYTES, "solo run: PyTorch peak allocated + 1 GiB"


# ---- the orchestrator's status -------------------------------------------------------------------------------------

@dataclass
class StatusWatch:
    """Reads the orchestrator's status (ListGroups, what `timeslice status` calls) every `interval` seconds and
    keeps every switch record it saw (the orchestrator keeps the last 16 only)."""

    target: str
    interval: float
    records: dict[tuple[float, str, str], dict[str, Any]] = field(default_factory=dict)
    errors: int = 0
    host_available_min: int | None = None  # bytes: the least MemAvailable seen at a read (/proc/meminfo)

    async def run(self, stop: asyncio.Event) -> None:
        import grpc
        from timeslice import _rpc
        from timeslice.v1 import orchestrator_pb2 as pb
        from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = pb_grpc.OrchestratorStub(channel)
            while True:
                try:
                    reply = await stub.ListGroups(pb.ListGroupsRequest(), timeout=10, metadata=_rpc.call_metadata())
                    for g in reply.groups:
                        for r in g.recent_switches:
                            self.records[(r.finished_at_unix, r.from_job_id, r.to_job_id)] = {
                                "from_job": r.from_job_id, "to_job": r.to_job_id, "ok": r.ok, "error": r.error,
                                "checkpoint_seconds": r.checkpoint_seconds, "restore_seconds": r.restore_seconds,
                                "seconds": r.checkpoint_seconds + r.restore_seconds,
                                "bytes_checkpointed": r.bytes_checkpointed, "bytes_restored": r.bytes_restored,
                                "finished_at_unix": r.finished_at_unix}
                except grpc.aio.AioRpcError:
                    self.errors += 1
                available = machine.host_memory().get("MemAvailable")
                if available is not None:
                    self.host_available_min = min(available, self.host_available_min or available)
                if stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)


VMSTAT_KEYS = ("pgmajfault", "pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "allocstall_normal",
               "allocstall_movable", "workingset_refault_file", "pswpin", "pswpout")


def vmstat() -> dict[str, int]:
    """The host's reclaim and fault counters (/proc/vmstat, `VMSTAT_KEYS`; {} elsewhere): how hard the
    kernel had to find memory (pages scanned and stolen, allocation stalls, major faults, file pages
    read back after being dropped)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k in VMSTAT_KEYS:
                out[k] = int(v)
    return out


async def status_json(cmd: list[str], target: str, env: dict[str, str]) -> tuple[list[str], Any]:
    """`timeslice status --target T --json`: (its argv, its parsed output, or {"error": ...})."""
    argv = [*cmd, "status", "--target", target, "--json"]
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        return argv, {"error": f"exit code {proc.returncode}: {err.decode(errors='replace').strip()}"}
    return argv, json.loads(out)


async def vmm_shim_path(cmd: list[str], env: dict[str, str]) -> str:
    """`timeslice vmm-shim`: the shim a job on backend vmm loads. Raises BenchError when it has none."""
    proc = await asyncio.create_subprocess_exec(*cmd, "vmm-shim", env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise BenchError(f"timeslice vmm-shim: {err.decode(errors='replace').strip()}")
    return out.decode().strip()


# ---- one shared run ------------------------------------------------------------------------------------------------

def group_config(a: argparse.Namespace, backend: str) -> dict[str, Any]:
    """The group as written to GROUPS.yaml: id and backend, and only the settings a flag of this bench set."""
    given = {"lease_seconds": a.lease_seconds, "step_timeout_seconds": a.step_timeout, "residency": a.residency,
             "memory_headroom": a.headroom, "resident_first_seconds": a.resident_first}
    return {"id": GROUP, "backend": backend, **{k: v for k, v in given.items() if v is not None}}


async def shared(a: argparse.Namespace, mode: str, backend: str, logs: Path,
                 solo_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One shared run: the product's servers for `mode`, the N jobs together, the servers stopped. Returns the raw
    run (`summarize` turns it into the result). Raises BenchError when a server does not start."""
    cmd = timeslice_command(a.timeslice)
    env = clean_env(a)
    commands: list[dict[str, Any]] = []
    servers: list[Server] = []
    config: dict[str, Any] = {"groups": [group_config(a, backend)]}
    pool_path = None
    if backend == "cooperative" and a.pool_gb > 0:
        pool_path = Path(a.pool_dir) / f"timeslice-pool-{os.getpid()}-{mode}"
        config["pinned_pool"] = {"path": str(pool_path), "bytes": int(a.pool_gb * 1e9)}
    sockets = Path(tempfile.mkdtemp(prefix="rlg-"))  # short: a unix socket's path has at most 107 bytes
    t_servers = time.monotonic()
    try:
        groups_file = logs / "groups.yaml"
        if mode == "serve":
            groups_file.write_text(yaml.safe_dump(config, sort_keys=False))
            argv = [*cmd, "serve", "--config", str(groups_file), "--socket", str(sockets / "orchestrator.sock"),
                    "--state-dir", str(logs / "state")]
            commands.append({"name": "serve", "argv": shlex.join(argv)})
            server, m = await start_server("timeslice serve", argv, logs / "serve.log", READY_SERVE, a.ready_timeout,
                                           env)
            servers.append(server)
            target, preload = m.group(1), m.group(2)
        else:
            agent_target = f"unix://{sockets / 'agent.sock'}"
            argv = [*cmd, "node-agent", "--listen", agent_target, "--state-dir", str(logs / "agent-state")]
            commands.append({"name": "node-agent", "argv": shlex.join(argv)})
            server, _ = await start_server("timeslice node-agent", argv, logs / "node-agent.log", READY_AGENT,
                                           a.ready_timeout, env)
            servers.append(server)
            # (a state file of this run's: the default one would carry the last run's holder into this one)
            config = {"listen": "127.0.0.1:0", "state_file": str(logs / "orchestrator-state.json"), **config,
                      "groups": [{**g, "agents": [agent_target]} for g in config["groups"]]}
            groups_file.write_text(yaml.safe_dump(config, sort_keys=False))
            argv = [*cmd, "orchestrator", "--config", str(groups_file)]
            commands.append({"name": "orchestrator", "argv": shlex.join(argv)})
            server, m = await start_server("timeslice orchestrator", argv, logs / "orchestrator.log",
                                           READY_ORCHESTRATOR, a.ready_timeout, env)
            servers.append(server)
            target = f"127.0.0.1:{m.group(1)}"
            preload = await vmm_shim_path(cmd, env) if backend == "vmm" else None  # as a user: `timeslice vmm-shim`
        ready_seconds = time.monotonic() - t_servers
        print(f"{mode}/{backend}: servers ready in {ready_seconds:.1f} s, TIMESLICE_ORCHESTRATOR={target}",
              file=sys.stderr)

        watch = StatusWatch(target, a.status_interval)
        stop_watch = asyncio.Event()
        watcher = asyncio.create_task(watch.run(stop_watch))
        declared: dict[str, Any] = {}
        names: dict[str, str] = {}  # the product's job id -> this bench's job name
        t0 = time.time()
        vm0, available0 = vmstat(), machine.host_memory().get("MemAvailable")
        deadline = time.monotonic() + a.job_timeout
        tasks = []
        started: asyncio.Queue[int] = asyncio.Queue()
        for i in range(a.jobs):
            name = f"job-{i}"
            set_env = {"TIMESLICE_ORCHESTRATOR": target, "TIMESLICE_GROUP": GROUP}
            if mode == "agent":
                set_env["TIMESLICE_JOB"] = name
            if preload:  # backend vmm: the job's processes load the shim (what serve's ready line says)
                set_env["LD_PRELOAD"] = preload
            if a.device == "cpu":  # no NVML: the agent moves only processes marked so (docs/one-box.md)
                set_env["TIMESLICE_ACCELERATOR_PROCESS"] = "1"
            if (d := declared_memory(a, solo_runs, i)) is not None:
                set_env["TIMESLICE_MEMORY"] = f"{d[0]}B"  # bytes, with their unit
                declared[name] = {"bytes": d[0], "from": d[1]}
            argv = [*job_args(a, i), "--register", "all" if backend == "cooperative" else "none"]
            tasks.append(asyncio.create_task(run_job(name, i, argv, {**env, **set_env}, logs, deadline, started)))
            pid = await started.get()
            names[name if mode == "agent" else f"pgid-{pid}"] = name
            commands.append({"name": name, "env": set_env, "argv": shlex.join(argv), "pid": pid})
        jobs: list[JobRun] = list(await asyncio.gather(*tasks))
        seconds = time.time() - t0
        host = {"vmstat_delta": {k: v - vm0.get(k, 0) for k, v in vmstat().items()},
                "available_at_start_bytes": available0}
        stop_watch.set()
        await watcher
        argv, status = await status_json(cmd, target, env)
        commands.append({"name": "status", "argv": shlex.join(argv)})
    finally:
        for server in reversed(servers):
            await stop_server(server, a.stop_timeout)
        shutil.rmtree(sockets, ignore_errors=True)
        if pool_path is not None:
            with contextlib.suppress(FileNotFoundError):
                pool_path.unlink()
    records = [{**r, "from_job": names.get(r["from_job"], r["from_job"]), "to_job": names.get(r["to_job"], r["to_job"])}
               for r in sorted(watch.records.values(), key=lambda r: r["finished_at_unix"])]
    host["available_min_bytes"] = watch.host_available_min
    return {"mode": mode, "backend": backend, "seconds": seconds, "servers_ready_seconds": ready_seconds,
            "host_memory": host, "jobs": jobs, "switches": records, "status": status,
            "status_read_errors": watch.errors,
            "group_config": config, "declared_memory": declared, "commands": commands, "job_ids": names,
            "servers": [{"name": s.name, "log": str(s.log), "exit_code": s.exit_code, "killed": s.killed}
                        for s in servers],
            "logs": {**{s.name: str(s.log) for s in servers}, **{j.name: str(j.stderr) for j in jobs}}}


# ---- the result ----------------------------------------------------------------------------------------------------

def busy_union(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def handoffs(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each grant that waited for another job's release: milliseconds from that release (the
    end of its GPU work, so the release RPC counts); `first`: the job's first grant (it was not
    resident yet: the orchestrator asks the node agent for memory before it)."""
    phases = sorted(((p, j["seed"], i == 0) for j in jobs for i, p in enumerate(j["phases"])),
                    key=lambda x: x[0]["granted"])
    out = []
    for (prev, pj, _), (nxt, nj, first) in itertools.pairwise(phases):
        if pj != nj and nxt["acquire"] < prev["done"] <= nxt["granted"]:
            out.append({"ms": (nxt["granted"] - prev["done"]) * 1000.0, "at": nxt["granted"], "first": first})
    return out


def phase_seconds(jobs: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds from grant to synchronised end, per phase kind (init, generate, train, ...)."""
    spans: dict[str, list[float]] = {}
    for j in jobs:
        for p in j["phases"]:
            spans.setdefault(p["kind"], []).append(p["done"] - p["granted"])
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(spans.items())}


def phase_usage(jobs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The mean of each `usage` counter of each phase kind (rl_job.py `usage`: CPU seconds, major faults,
    involuntary switches, CUDA allocator calls and retries)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for j in jobs:
        for p in j["phases"]:
            for k, v in p.get("usage", {}).items():
                sums.setdefault(p["kind"], {}).setdefault(k, []).append(v)
    return {kind: {k: round(sum(v) / len(v), 3) for k, v in sorted(c.items())} for kind, c in sorted(sums.items())}


def summarize(a: argparse.Namespace, solo_runs: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any]:
    runs: list[JobRun] = run["jobs"]
    lost = [x for x in (r.lost() for r in runs) if x is not None]
    jobs = [r.result for r in runs if r.result is not None and r.lost() is None]
    solo_sum = sum(r["wall_seconds"] for r in solo_runs)
    solo_phases = sum(r["wall_seconds"] - r["startup_seconds"] for r in solo_runs)
    bound = solo_sum / sum(r["gpu_busy_seconds"] for r in solo_runs)
    gain = solo_sum / run["seconds"]
    phases = [p for j in jobs for p in j["phases"]]
    span = (max(p["released"] for p in phases) - min(p["acquire"] for p in phases)) if phases else 0.0
    busy = busy_union([(p["granted"], p["done"]) for p in phases])
    sw = run["switches"]
    moved_at = [s["finished_at_unix"] for s in sw if s["ok"] and (s["bytes_checkpointed"] or s["bytes_restored"])]
    ho = handoffs(jobs)
    resident_ho = [h["ms"] for h in ho if not h["first"] and not any(abs(h["at"] - t) < 1.0 for t in moved_at)]
    hashes = {j["seed"]: j["param_hash"] for j in jobs}
    solo_hashes = {r["seed"]: r["param_hash"] for r in solo_runs}
    groups = run["status"] if isinstance(run["status"], list) else []
    group = next((g for g in groups if g.get("group_id") == GROUP), {})
    return {
        "benchmark": "rl_grpo", "mode": run["mode"], "backend": run["backend"],
        "residency": group.get("residency", a.residency), "group_config": run["group_config"],
        "jobs": a.jobs, "size": a.size, "params": jobs[0]["params"] if jobs else None, "steps": a.steps,
        "batch": a.batch, "new_tokens": a.new_tokens, "reward_seconds": a.reward_seconds, "extra_gb": a.extra_gb,
        "device": a.device, "declared_memory": run["declared_memory"],
        "jobs_lost": lost, "jobs_finished": len(jobs),
        "bitwise_equal": not lost and all(solo_hashes.get(s) == h for s, h in hashes.items()),
        "extra_ok": not lost and all(j["extra_ok"] for j in jobs),
        "peak_allocated_gb": [round(j["peak_allocated_bytes"] / 1e9, 2) for j in jobs],
        "peak_reserved_gb": [round(j.get("peak_reserved_bytes", 0) / 1e9, 2) for j in jobs],
        "seconds_solo_sum": round(solo_sum, 2), "seconds_shared": round(run["seconds"], 2),
        "servers_ready_seconds": round(run["servers_ready_seconds"], 2), "host_memory": run["host_memory"],
        "gain": round(gain, 3),
        "gain_phases": round(solo_phases / span, 3) if span else None,
        "gpu_busy_fraction": round(busy / span, 3) if span else None,
        "gpu_time_bound": round(bound, 3), "gain_vs_bound": round(gain / bound, 3),
        # the orchestrator's counters (status JSON writes 64-bit counts as strings); the records, read every
        # --status-interval from the last 16 it keeps, are complete when as many as its count
        "switches": int(group.get("switches", len(sw))), "switch_records_complete": len(sw) == int(
            group.get("switches", len(sw))), "grants": int(group.get("grants", 0)),
        "failed_switches": int(group.get("failed_switches", 0)),
        "lease_expiries": int(group.get("lease_expiries", 0)),
        "switch_seconds": [round(s["seconds"], 3) for s in sw],
        "switch_seconds_sum": round(sum(s["seconds"] for s in sw), 3),
        "switch_gb_out": [round(s["bytes_checkpointed"] / 1e9, 2) for s in sw],
        "switch_gb_in": [round(s["bytes_restored"] / 1e9, 2) for s in sw],
        "bytes_moved": sum(s["bytes_checkpointed"] + s["bytes_restored"] for s in sw),
        "switch_errors": [s["error"] for s in sw if not s["ok"]],
        "handoffs": len(ho), "handoff_ms_p50": round(percentile([h["ms"] for h in ho], 50), 3),
        "handoff_ms_p99": round(percentile([h["ms"] for h in ho], 99), 3),
        "handoffs_resident": len(resident_ho),
        "handoff_resident_ms_p50": round(percentile(resident_ho, 50), 3),
        "handoff_resident_ms_p99": round(percentile(resident_ho, 99), 3),
        "param_hash_solo": solo_hashes, "param_hash_shared": hashes,
        "ranks": a.nproc, "nccl_transparent": a.nccl_transparent,
        "allreduce_ok": all(all(j.get("allreduce_ok", [])) for j in jobs),
        "allreduce_checks": sum(len(j.get("allreduce_ok", [])) for j in jobs),
        "solo_seconds": [round(r["wall_seconds"], 2) for r in solo_runs],
        "solo_gpu_busy_seconds": [round(r["gpu_busy_seconds"], 2) for r in solo_runs],
        "solo_peak_gb": [round((r.get("process_gpu_bytes") or r["peak_allocated_bytes"]) / 1e9, 2) for r in solo_runs],
        "shared_job_seconds": [round(j["total_seconds"], 2) for j in jobs],
        "exit_seconds": [round(r.seconds - r.result["total_seconds"], 2) for r in runs if r.lost() is None],
        "exit_samples": {r.name: top_samples(r.exit_samples) for r in runs},
        "solo_exit_samples": [top_samples(r.get("exit_samples", {})) for r in solo_runs],
        "solo_exit_seconds": [round(r["wall_seconds"] - r["total_seconds"], 2) for r in solo_runs],
        "startup_seconds": [round(j["startup_seconds"], 2) for j in jobs],
        "phase_seconds_solo": phase_seconds(solo_runs), "phase_seconds_shared": phase_seconds(jobs),
        "phase_usage_solo": phase_usage(solo_runs), "phase_usage_shared": phase_usage(jobs),
        "switch_records": sw, "status_read_errors": run["status_read_errors"], "status": run["status"],
        "job_ids": run["job_ids"], "commands": run["commands"], "servers": run["servers"], "logs": run["logs"],
        "job_phases": {f"job-{j['seed']}": j["phases"] for j in jobs},
    }


def failed(a: argparse.Namespace, mode: str, backend: str, err: BenchError, logs: Path) -> dict[str, Any]:
    """The result of a run whose servers did not start."""
    return {"benchmark": "rl_grpo", "mode": mode, "backend": backend, "jobs": a.jobs, "size": a.size,
            "steps": a.steps, "extra_gb": a.extra_gb, "error": str(err), "logs": {"folder": str(logs)}}


def ok(result: dict[str, Any]) -> bool:
    return "error" not in result and not result["jobs_lost"] and result["bitwise_equal"] and result["extra_ok"]


async def main_async(a: argparse.Namespace, solo_runs: list[dict[str, Any]] | None, logs: Path,
                     save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """The solo runs (unless given), then one shared run per mode and backend; `save` gets the results so far
    after each run (a bench stopped midway keeps the runs it finished)."""
    if solo_runs is None:
        (logs / "solo").mkdir(parents=True, exist_ok=True)
        solo_runs = await solo(a, logs / "solo")
    if a.save_solo:
        await asyncio.to_thread(Path(a.save_solo).write_text, json.dumps(solo_runs))
    out = []
    for mode in a.modes:
        for backend in a.backends:
            run_logs = logs / f"{mode}-{backend}"
            run_logs.mkdir(parents=True, exist_ok=True)
            try:
                result = summarize(a, solo_runs, await shared(a, mode, backend, run_logs, solo_runs))
            except BenchError as err:
                result = failed(a, mode, backend, err, run_logs)
            result["solo_source"] = a.solo_json or "measured in this run"
            result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            brief = {k: v for k, v in result.items() if k not in (
                "switch_records", "job_phases", "status", "commands", "logs", "servers", "group_config", "job_ids")}
            print(json.dumps(brief), file=sys.stderr)
            out.append(result)
            save(out)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--modes", "--mode", dest="modes", nargs="+", choices=["serve", "agent"], default=["serve"],
                   help="serve: `timeslice serve`; agent: `timeslice node-agent` + `timeslice orchestrator`")
    p.add_argument("--backends", nargs="*", default=["cuda", "cooperative"],
                   choices=["cuda", "cuda-checkpoint", "vmm", "cooperative", "freeze", "none"],
                   help="the group's backend, one shared run each per mode (freeze or none for --device cpu; none "
                        "given: the solo runs only, with --save-solo; vmm: the jobs start with the shim in "
                        "LD_PRELOAD, as serve's ready line or `timeslice vmm-shim` says)")
    p.add_argument("--timeslice", help="the timeslice command (default: beside this Python, else on PATH, else "
                                       "python -m timeslice.cli.main)")
    g = p.add_argument_group("group settings (left out of GROUPS.yaml, hence the product's default, unless given)")
    g.add_argument("--lease-seconds", type=float, help="lease_seconds")
    g.add_argument("--step-timeout", type=float, help="step_timeout_seconds")
    g.add_argument("--residency", choices=["auto", "exclusive"], help="residency")
    g.add_argument("--headroom", help="memory_headroom: percent of GPU memory or a quantity")
    g.add_argument("--resident-first", type=float, help="resident_first_seconds")
    g.add_argument("--pool-gb", type=float, default=0.0, help="cooperative: the orchestrator's pinned_pool, GB "
                                                              "(0: none in the file)")
    g.add_argument("--pool-dir", default="/dev/shm", help="where that pool file lives (a memory filesystem)")
    m = p.add_argument_group("memory declared by the jobs (TIMESLICE_MEMORY)")
    m.add_argument("--declare-memory", action="store_true",
                   help="each job declares its solo peak (bytes per GPU) in TIMESLICE_MEMORY")
    m.add_argument("--declare-memory-gb", type=float, help="each job declares this many GB (implies --declare-memory)")
    j = p.add_argument_group("the jobs (bench/rl_job.py)")
    j.add_argument("--size", default="1b", choices=["tiny", "small", "1b"])
    j.add_argument("--steps", type=int, default=4)
    j.add_argument("--batch", type=int, default=16)
    j.add_argument("--new-tokens", type=int, default=128)
    j.add_argument("--reward-seconds", type=float, default=3.0)
    j.add_argument("--extra-gb", type=float, default=0.0, help="extra resident GB per job (sizes its footprint)")
    j.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    j.add_argument("--nproc", type=int, default=1, help="ranks per job (torchrun, one GPU each)")
    j.add_argument("--nccl-transparent", action="store_true",
                   help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 for every job (solo too)")
    t = p.add_argument_group("waits (seconds)")
    t.add_argument("--ready-timeout", type=float, default=300.0, help="for each server's ready line")
    t.add_argument("--job-timeout", type=float, default=3600.0, help="for all the jobs of a run (then killed: lost)")
    t.add_argument("--stop-timeout", type=float, default=30.0, help="from SIGTERM to SIGKILL of a server")
    t.add_argument("--status-interval", type=float, default=0.5, help="between reads of the orchestrator's status")
    p.add_argument("--solo-json", help="reuse solo runs saved by --save-solo (same model, steps and --extra-gb)")
    p.add_argument("--save-solo", help="write the solo runs here")
    p.add_argument("--logs", help="folder for every server's and job's log (default: a new one under /tmp)")
    p.add_argument("--out", help="write the JSON list of results here")
    p.add_argument("--plot", metavar="PNG", help="draw the shared runs' timelines into this image (needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error("--jobs must be at least 1")
    if a.plot:
        try:
            timeline.require_matplotlib()  # before the runs, not after
        except ModuleNotFoundError:
            print(f"rl_grpo.py: error: --plot needs matplotlib, which is not installed: {timeline.INSTALL}",
                  file=sys.stderr)
            return 2
    solo_runs = json.loads(Path(a.solo_json).read_text())[: a.jobs] if a.solo_json else None
    if solo_runs is not None and len(solo_runs) < a.jobs:
        p.error(f"--solo-json holds {len(solo_runs)} solo runs, --jobs is {a.jobs}")
    logs = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="rl-grpo-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs in {logs}", file=sys.stderr)
    described = machine.describe()

    def stamped(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "machine": described} for r in results]

    def save(results: list[dict[str, Any]]) -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(stamped(results), indent=1) + "\n")

    try:
        results = stamped(asyncio.run(main_async(a, solo_runs, logs, save)))
    except BenchError as err:  # a solo run failed: nothing to compare with
        print(f"rl_grpo.py: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=1))
    if a.plot and any("error" not in r for r in results):
        timeline.draw(timeline.timelines([r for r in results if "error" not in r]), a.plot)
    return 0 if all(ok(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
