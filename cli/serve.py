"""`timeslice serve`: one-box mode, the orchestrator and a node agent on one machine.

The composition root of one-box mode (no Kubernetes): the same orchestrator, node agent
and backends as in a cluster, wired so that a job needs no id and no PIDs. Clients call
the public unix socket (`UnixFront`: mode 0600 by default, so only its owner's processes
can connect); each call is identified by its socket's peer credentials and acts for the
job of the caller's process group (or cgroup), whose processes the node agent moves
(`PeerJobs`, `PeerProcessResolver`). Groups come from a YAML file (the orchestrator's
config format; a group without `agents` uses this machine's agent) or are one per GPU.
Cooperative groups get the node's pinned pool (`PinnedPool`, built by the orchestrator's
`running` as for `timeslice orchestrator`): a file in a private directory (mode 0700)
under /dev/shm (on hugetlbfs where the host reserved huge pages for it: `huge_pages`), sized by
`--pinned-pool-gb` or `host_ranges.default_size`, removed on stop;
one that a killed serve left is removed at the next start with its state dir, once nothing
maps it (`pinned_pool.remove_left`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from timeslice.controller.orchestrator import pinned_pool, state_format
from timeslice.controller.orchestrator.config import OrchestratorConfig, PinnedPoolSpec
from timeslice.controller.orchestrator.server import running
from timeslice.controller.peer_auth import PeerAuthenticator
from timeslice.driver import host_ranges, huge_pages, names, signals, vmm_shim
from timeslice.driver.config import problem_lines
from timeslice.driver.peercred import PeerJobs, ScopeKind, UnixFront
from timeslice.driver.private_paths import lock_state_dir
from timeslice.kubelet_plugin.agent.backends.base import Backend
from timeslice.kubelet_plugin.agent.backends.vmm import VmmBackend
from timeslice.kubelet_plugin.agent.gpu_memory import gpus
from timeslice.kubelet_plugin.agent.host_processes import PeerProcessResolver
from timeslice.kubelet_plugin.agent.node_agent import NodeAgent
from timeslice.kubelet_plugin.agent.server import create_server as create_agent_server

log = logging.getLogger("timeslice.serve")


def default_socket() -> Path:
    """/run/timeslice/orchestrator.sock for root, else under $XDG_RUNTIME_DIR (or /tmp)."""
    if os.geteuid() == 0:
        return Path("/run/timeslice/orchestrator.sock")
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/timeslice-{os.geteuid()}"
    return Path(base) / "timeslice" / "orchestrator.sock"


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/timeslice when it is set, else /var/lib/timeslice for root, else
    ~/.local/state/timeslice (the XDG base directory spec's default)."""
    if os.environ.get("XDG_STATE_HOME"):
        return Path(os.environ["XDG_STATE_HOME"]) / "timeslice"
    if os.geteuid() == 0:
        return Path("/var/lib/timeslice")
    return Path.home() / ".local" / "state" / "timeslice"


@dataclass(frozen=True)
class ServeConfig:
    """`socket`: the public unix socket and `socket_mode` its permission bits; `scope`: what
    makes a job ("process-group" or "cgroup"); `groups_file`: YAML groups (None: one group
    per GPU, `gpu<index>`, with `backend`); `state_dir`: the agent's checkpoint records and
    the orchestrator's epoch floors, kept across restarts; `pinned_pool_bytes`: the size of
    the cooperative groups' pinned pool and of the node agent's for `vmm` groups (None:
    `host_ranges.default_size`; 0: none, each job keeps its own host copy)."""

    socket: Path
    socket_mode: int = 0o600
    scope: ScopeKind = "process-group"
    groups_file: Path | None = None
    backend: str = names.BACKEND_CUDA
    state_dir: Path | None = None
    pinned_pool_bytes: int | None = None


def gpu_count() -> int:
    """NVIDIA GPUs here (NVML); 0 without NVML or GPUs."""
    return len(gpus())


def orchestrator_config(cfg: ServeConfig, agent_target: str, state_dir: Path) -> OrchestratorConfig:
    """The orchestrator's config: the groups of `cfg.groups_file` (a group with no `agents`
    gets this machine's agent) or one per GPU; it listens on a loopback port that only
    `UnixFront` should use. Raises ValueError (a bad file, no GPU and no file)."""
    if cfg.groups_file is not None:
        try:
            raw: dict[str, Any] = yaml.safe_load(cfg.groups_file.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ValueError(f"--config {cfg.groups_file}: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--config {cfg.groups_file}: want a mapping with `groups:`")
        listed = raw.get("groups") or []
        if not isinstance(listed, list) or not all(isinstance(g, dict) for g in listed):
            raise ValueError(f"--config {cfg.groups_file}: `groups:` is a list of mappings, one per group "
                             "(`groups: [{id: g, backend: freeze}]`)")
        groups = [dict(g) for g in listed]
        for g in groups:  # (a `none` group's agent only looks up its holder: dropped at once when gone)
            if not g.get("agents"):
                g["agents"] = [agent_target]
        raw = {**raw, "groups": groups}
    else:
        n = gpu_count()
        if n == 0:
            raise ValueError("no NVIDIA GPU found (NVML): name the groups in a file, --config FILE "
                             "(`groups: [{id: g, backend: freeze}]`; docs/one-box.md)")
        raw = {"groups": [{"id": f"gpu{i}", "backend": cfg.backend, "agents": [agent_target]} for i in range(n)]}
    raw.setdefault("state_file", str(state_dir / "orchestrator-state.json"))
    try:
        config = OrchestratorConfig.model_validate(raw)
    except ValidationError as err:
        raise ValueError("\n".join(problem_lines(err, f"--config {cfg.groups_file}: "))) from None
    if not config.groups:
        raise ValueError(f"--config {cfg.groups_file}: no groups")
    return config.model_copy(update={"listen": "127.0.0.1:0"})


@contextlib.contextmanager
def private_pool(config: OrchestratorConfig, size: int | None, shm: Path = host_ranges.SHM
                 ) -> Iterator[OrchestratorConfig]:
    """`config` with a pinned pool for its cooperative groups: a file in a new directory
    (mode 0700, the serving user's: no other user's job can map it) on a hugetlbfs mount whose
    reserved huge pages hold it (`huge_pages.mount_for`: each process registers it with CUDA
    several times faster), else under `shm`; `size` bytes (None: `host_ranges.default_size` of
    this machine's GPUs; 0: no pool; on hugetlbfs rounded down to whole pages); the
    directory and everything in it is removed on exit. `config` as it is when no group is
    cooperative or it names its own `pinned_pool`. Raises ValueError (a size and a
    `pinned_pool` both given), OSError (`shm` unusable)."""
    if config.pinned_pool is not None and size is not None:
        raise ValueError("--pinned-pool-gb and the config's pinned_pool both size the pool: keep one")
    if config.pinned_pool is not None or not any(g.backend == names.BACKEND_COOPERATIVE for g in config.groups):
        yield config
        return
    left = recorded_pool(config.state_file)  # before the size: what it takes of `shm` comes back
    if left is not None:
        pinned_pool.remove_left(left, shm)
    gpu_bytes = sum(g.total for g in gpus()) if size is None else 0
    want = host_ranges.default_size(gpu_bytes, None) if size is None else size
    huge = huge_pages.mount_for(want) if want else None
    root = shm if huge is None else huge.path
    if huge is not None:
        size = want // huge.page_size * huge.page_size
    elif size is None:
        size = host_ranges.default_size(gpu_bytes, shm)
        if size == 0:
            log.warning("no pinned pool: %s has no free space; cooperative jobs keep their own host copies "
                        "(slower)", shm)
    if size == 0:
        yield config
        return
    with tempfile.TemporaryDirectory(prefix="timeslice-pool-", dir=root) as folder:  # mkdtemp: mode 0700
        log.info("pinned pool bytes=%d on %s%s", size, root,
                 f" (hugetlbfs, {huge.page_size}-byte pages reserved by the host)" if huge is not None else
                 " (no huge pages reserved for it: each job process registers its part on its first checkpoints, "
                 "several seconds for tens of GB; huge pages make first switches faster: docs/one-box.md)")
        yield config.model_copy(update={"pinned_pool": PinnedPoolSpec(path=Path(folder) / "pool", bytes=size)})


def recorded_pool(state_file: Path | None) -> Path | None:
    """The pinned pool `state_file` names (an earlier start's: its snapshot and journal,
    `state_format.load`), None when none or unreadable."""
    try:
        doc = state_format.load(state_file) if state_file is not None else None
    except ValueError:
        return None
    return Path(doc.pool.path) if doc is not None and doc.pool is not None else None


def preload_word(config: OrchestratorConfig) -> str:
    """` LD_PRELOAD=<the timeslice-vmm shim>` when a group is on backend `vmm` (its jobs' processes
    load the shim: `timeslice.driver.vmm_shim`), else "". Raises ValueError when this install has
    no shim."""
    if not any(g.backend == names.BACKEND_VMM for g in config.groups):
        return ""
    try:
        return f" LD_PRELOAD={vmm_shim.library()}"
    except FileNotFoundError as err:
        raise ValueError(f"backend vmm: {err}") from err


async def serve(cfg: ServeConfig) -> None:
    """Run until SIGINT/SIGTERM/SIGHUP. Prints one line to stdout when ready:
    `ready TIMESLICE_ORCHESTRATOR=unix://<socket> [LD_PRELOAD=<shim>] groups=<id>(<backend>),...`
    (LD_PRELOAD where a group is on `vmm`: its jobs start with it, `preload_word`). Raises
    ValueError (configuration) or OSError (the socket cannot be bound)."""
    state_dir = cfg.state_dir or default_state_dir()
    # a bad file (or backend vmm without its shim) says so before anything else
    preload_word(orchestrator_config(cfg, "unix:///checked-first.sock", state_dir))
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    stop = signals.stop_event()
    with lock_state_dir(state_dir):  # first: a second serve on this state dir stops here, touching nothing
        await _serve(cfg, state_dir, stop)


async def _serve(cfg: ServeConfig, state_dir: Path, stop: asyncio.Event) -> None:
    front = UnixFront(cfg.socket, cfg.socket_mode)
    await front.bind()  # a second server on this socket stops here, touching nothing
    try:
        with contextlib.ExitStack() as stack:
            private = stack.enter_context(tempfile.TemporaryDirectory(prefix="timeslice-agent-"))  # 0700: ours
            agent_target = f"unix://{Path(private) / 'agent.sock'}"
            config = stack.enter_context(private_pool(orchestrator_config(cfg, agent_target, state_dir),
                                                      cfg.pinned_pool_bytes))
            # cooperative jobs move their own state: their agent only reports memory
            backends: list[str | Backend] = sorted({g.backend for g in config.groups} - {names.BACKEND_COOPERATIVE}
                                                   | {names.BACKEND_NONE})
            # vmm: the agent's own pool, of the size asked; unasked, none beside a cooperative pool (each
            # would take up to three quarters of the host's memory)
            vmm_pool = cfg.pinned_pool_bytes if cfg.pinned_pool_bytes is not None else \
                0 if config.pinned_pool is not None else None
            backends = [VmmBackend(names.DEFAULT_LOCK_TIMEOUT_SECONDS, pool_bytes=vmm_pool)
                        if b == names.BACKEND_VMM else b for b in backends]
            jobs = PeerJobs(state_dir / "jobs.json")
            # its orchestrator starts and stops with it: what no group of this config restores is put back at start
            agent = NodeAgent(PeerProcessResolver(jobs), backends=backends, records_path=state_dir / "agent.json",
                              groups={g.id: g.backend for g in config.groups})
            agent_server, _ = await create_agent_server(agent, agent_target)
            try:
                async with running(config, PeerAuthenticator(front, jobs, cfg.scope)) as (_, port):
                    front.splice_to(port)
                    groups = ",".join(f"{g.id}({g.backend})" for g in config.groups)
                    pool = config.pinned_pool
                    log.info("serving socket=%s scope=%s groups=%s pinned_pool=%s", cfg.socket, cfg.scope, groups,
                             f"{pool.path}({pool.bytes})" if pool else "-")
                    print(f"ready TIMESLICE_ORCHESTRATOR=unix://{cfg.socket}{preload_word(config)} groups={groups}",
                          flush=True)
                    await stop.wait()
            finally:
                await agent_server.stop(1)
                # the orchestrator is gone with it: no job may stay frozen or checkpointed for nobody
                await agent.restore_all("timeslice serve stopped")
    finally:
        await front.close()

