"""`timeslice`: command-line entry point (composition root).

Subcommands parse flags, build one config object and start one component:

    timeslice demo           orchestrator + node agent + synthetic RL jobs on this machine
    timeslice orchestrator   the orchestrator gRPC server with static groups (YAML)
    timeslice status         groups, holders, queues and recent switches of an orchestrator
    timeslice kubelet-plugin the DRA kubelet plugin and node agent (DaemonSet on GPU nodes)
    timeslice controller     claims -> lock groups, with the orchestrator inside (Deployment)
    timeslice plot           draw a demo or benchmark result's timeline (PNG; the `plot` extra)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from timeslice.driver.errors import FailedPrecondition
from timeslice.driver.names import install_hint

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TARGET_HELP = ("orchestrator address: unix:///PATH (what `timeslice serve` prints) or HOST:PORT (default "
               "$TIMESLICE_ORCHESTRATOR)")


class _Version(argparse.Action):
    """`--version`: the client package's `__version__`, imported only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        import timeslice

        print(f"timeslice-dra {timeslice.__version__}")
        parser.exit()


def _demo(a: argparse.Namespace) -> int:
    from timeslice.cli.demo import DemoConfig, run
    from timeslice.driver import logs

    if a.plot:
        from timeslice.cli.timeline import require_matplotlib

        require_matplotlib()  # before the demo runs, not after
        if not Path(a.plot).resolve().parent.is_dir():
            raise FileNotFoundError(f"--plot {a.plot}: the folder {Path(a.plot).resolve().parent} does not exist")
    logs.setup("WARNING" if not a.verbose else "INFO")
    cfg = DemoConfig(jobs=a.jobs, rounds=a.rounds, backend=a.backend, gen_seconds=a.gen_seconds,
                     reward_seconds=a.reward_seconds, state_mb=a.state_mb, state_gb=a.state_gb,
                     max_hold_seconds=a.max_hold_seconds)
    return run(cfg, a.json, a.plot)


def _vmm_shim(a: argparse.Namespace) -> int:
    from timeslice.driver import vmm_shim
    print(vmm_shim.library())
    return 0


def _plot(a: argparse.Namespace) -> int:
    from timeslice.cli import timeline

    timeline.require_matplotlib()
    out = a.output or Path(a.result).with_suffix(".png").name  # here: never over a file beside the result
    timeline.draw(timeline.load(a.result), out)
    print(out)
    return 0


def default_state_file() -> Path:
    """`timeslice orchestrator`'s state file when none is named: orchestrator/state.json in the
    default state dir (`serve.default_state_dir`), its folder made (mode 0700). Without one, a
    restarted orchestrator forgot the holder, granted a checkpointed job, and both computed (a
    helper's attack on a standalone node: 3.4 s of double compute, the holder then lost its lease)."""
    from timeslice.cli.serve import default_state_dir

    folder = default_state_dir() / "orchestrator"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / "state.json"


def _orchestrator(a: argparse.Namespace) -> int:
    from timeslice.cli.serve import private_pool
    from timeslice.controller.orchestrator.config import OrchestratorConfig
    from timeslice.controller.orchestrator.server import serve
    from timeslice.driver import logs

    logs.setup(a.log_level)
    cfg = OrchestratorConfig.from_yaml(a.config) if a.config else OrchestratorConfig()
    if a.listen:
        cfg = cfg.model_copy(update={"listen": a.listen})
    if a.metrics_listen:
        cfg = cfg.model_copy(update={"metrics_listen": a.metrics_listen})
    if not cfg.groups:
        logging.getLogger("timeslice.orchestrator").warning(
            "no groups configured (%s): every acquire is refused with GroupNotFound; list them under `groups:`",
            a.config or "no --config")
    if a.state_file:
        cfg = cfg.model_copy(update={"state_file": Path(a.state_file)})
    elif cfg.state_file is None and not a.no_state_file:
        cfg = cfg.model_copy(update={"state_file": default_state_file()})
    # cooperative groups get the node's pool as under `timeslice serve`: without one, each job's
    # checkpoint went to host memory of its own, and on the H200 host two jobs of 47 GB each
    # were killed with their states (bench/results/rl-grpo-b-agent-cooperative-nopool-h200.json)
    with private_pool(cfg, None if a.pinned_pool_gb is None else int(a.pinned_pool_gb * 1e9)) as cfg:
        asyncio.run(serve(cfg))
    return 0


def _serve(a: argparse.Namespace) -> int:
    from timeslice.cli.serve import ServeConfig, default_socket, serve
    from timeslice.driver import logs

    logs.setup(a.log_level)
    cfg = ServeConfig(socket=Path(a.socket).absolute() if a.socket else default_socket(), socket_mode=a.socket_mode,
                      scope=a.job_scope, groups_file=Path(a.config) if a.config else None, backend=a.backend,
                      state_dir=Path(a.state_dir) if a.state_dir else None,
                      pinned_pool_bytes=None if a.pinned_pool_gb is None else int(a.pinned_pool_gb * 1e9))
    asyncio.run(serve(cfg))
    return 0


def _node_agent(a: argparse.Namespace) -> int:
    from timeslice.cli.node_agent import NodeAgentConfig, serve
    from timeslice.driver import logs

    logs.setup(a.log_level)
    cfg = NodeAgentConfig(listen=a.listen, backends=_names(a.backends) or (), state_dir=Path(a.state_dir),
                          token_file=a.token_file, tls=a.tls,
                          certificate_file=Path(a.certificate_file) if a.certificate_file else None)
    asyncio.run(serve(cfg))
    return 0


def _octal_mode(text: str) -> int:
    """Permission bits written in octal (600, 0660); argparse reports a ValueError's message."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not octal permission bits (e.g. 600)") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r}: permission bits are 000 to 777")
    return mode


def _pinned_pool_gb(parser: argparse.ArgumentParser, unless: str = "") -> None:
    """`--pinned-pool-gb` of `serve` and `orchestrator` (`cli.serve.private_pool`)."""
    parser.add_argument("--pinned-pool-gb", type=_at_least(0, float), metavar="GB",
                        help="size of the pinned host pool that cooperative groups checkpoint into (GB, 1e9 bytes; "
                             "0: none, each job keeps its own host copy, slower). Made at start in a private "
                             f"directory (mode 0700) under /dev/shm and removed on stop{unless}; only with a "
                             "cooperative group. Default: the GPUs' total memory, at most three quarters of the "
                             "host's memory and the free space of /dev/shm (1 GB without a GPU)" + (
                                 ". serve: also the size of the node agent's pool for vmm groups (a memfd taken as "
                                 "its first job registers it; default as above, without the /dev/shm bound)"
                                 if not unless else ""))


def _at_least(low: float, kind: type) -> Any:
    """An argparse type: `kind(text)`, at least `low`."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _names(text: str | None) -> tuple[str, ...] | None:
    """A comma-separated flag as a tuple (blanks dropped); None when the flag is absent."""
    return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())


def _kubelet_plugin(a: argparse.Namespace) -> int:
    from timeslice.driver import logs
    from timeslice.kubelet_plugin.app import KubeletPluginConfig, run

    logs.setup(a.log_level)
    fields = {k: v for k, v in {
        "node_name": a.node_name, "fake_gpus": a.fake_gpus, "sharing": a.sharing, "seats": a.seats,
        "state_dir": a.state_dir, "cdi_dir": a.cdi_dir, "plugin_data_dir": a.plugin_data_dir,
        "registry_dir": a.registry_dir, "agent_listen": a.agent_listen, "agent_auth": a.agent_auth,
        "agent_allowed_users": _names(a.agent_allowed_users), "agent_tls": a.agent_tls or None,
        "backends": tuple(a.backends.split(",")) if a.backends else None, "orchestrator": a.orchestrator,
        "liveness_file": a.liveness_file, "driver_root": a.driver_root, "driver_root_host": a.driver_root_host,
    }.items() if v is not None}
    asyncio.run(run(KubeletPluginConfig(**fields)))
    return 0


def _controller(a: argparse.Namespace) -> int:
    from timeslice.controller.app import ControllerConfig, run
    from timeslice.driver import logs

    logs.setup(a.log_level)
    fields = {"listen": a.listen, "metrics_listen": a.metrics_listen, "agent_template": a.agent_template,
              "agent_namespace": a.agent_namespace, "default_backend": a.default_backend,
              "leader_election": a.leader_election or None, "lease_duration": a.lease_duration,
              "renew_deadline": a.renew_deadline, "retry_period": a.retry_period, "auth": a.auth,
              "agent_token_file": a.agent_token_file, "require_agent_tls": a.require_agent_tls or None,
              "resync_seconds": a.resync_seconds, "liveness_file": a.liveness_file}
    asyncio.run(run(ControllerConfig(**{k: v for k, v in fields.items() if v is not None})))
    return 0


def _size(n: int) -> str:
    """Bytes as GB (1e9) or, under 1 GB, MB (1e6)."""
    return f"{n / 1e9:.2f} GB" if n >= 10**9 else f"{n / 1e6:.1f} MB"


def _run(a: argparse.Namespace) -> int:
    from timeslice.cli.run import run

    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        print("timeslice run: error: no command: timeslice run [options] -- CMD [ARG ...]", file=sys.stderr)
        return 2
    return run(cmd, a.target, a.job, a.group, a.timeout, a.priority)


def _acquire(a: argparse.Namespace) -> int:
    from timeslice.cli import hold

    job = hold.default_job(a.job, a.target)
    return hold.acquire(hold.hold_file(a.group, job, a.hold_file), a.target, job, a.group, a.timeout, a.priority)


def _release(a: argparse.Namespace) -> int:
    from timeslice.cli import hold

    return hold.release(hold.hold_file(a.group, hold.default_job(a.job, None), a.hold_file))


def _plain(msg: Any) -> dict[str, Any]:
    """A protobuf message as JSON-ready values: every field, zero ones too, under its proto
    name; numbers as numbers (protobuf's JSON mapping writes 64-bit integers as strings and
    leaves zero fields out), enums by name, maps as objects, lists as lists."""
    from google.protobuf.descriptor import FieldDescriptor

    def value(field: Any, v: Any) -> Any:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            return _plain(v)
        if field.type == FieldDescriptor.TYPE_ENUM:
            return field.enum_type.values_by_number[v].name if v in field.enum_type.values_by_number else v
        return v

    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        v = getattr(msg, field.name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            out[field.name] = {k: value(entry.fields_by_name["value"], x) for k, x in v.items()}
        elif field.is_repeated:
            out[field.name] = [value(field, x) for x in v]
        else:
            out[field.name] = value(field, v)
    return out


def _status(a: argparse.Namespace) -> int:
    import grpc
    from timeslice import _rpc
    from timeslice.v1 import orchestrator_pb2 as pb
    from timeslice.v1 import orchestrator_pb2_grpc as pb_grpc

    if not a.target:
        print("timeslice status: no orchestrator address: pass --target or set TIMESLICE_ORCHESTRATOR",
              file=sys.stderr)
        return 2
    with grpc.insecure_channel(_rpc.address(a.target)) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        try:
            md = _rpc.call_metadata()
            groups = ([stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id=a.group), timeout=10, metadata=md)]
                      if a.group else list(stub.ListGroups(pb.ListGroupsRequest(), timeout=10, metadata=md).groups))
        except grpc.RpcError as err:
            print(f"timeslice status: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if a.json:
        print(json.dumps([_plain(g) for g in groups], indent=2))
        return 0
    for g in groups:
        lease = (f"past its lease, kept: {g.holder.kept_past_lease}" if g.holder.kept_past_lease else
                 f"lease {g.holder.lease_remaining_seconds:.1f}s left")
        holder = (f"{g.holder.job_id} (epoch {g.holder.epoch}, held {g.holder.held_seconds:.1f}s, {lease})"
                  if g.holder.job_id else "-")
        print(f"group {g.group_id}  backend={g.backend}  residency={g.residency or '-'}  phase={g.phase}  "
              f"holder={holder}  resident={','.join(g.resident_job_ids) or g.resident_job_id or '-'}")
        print(f"  grants={g.grants} switches={g.switches} failed={g.failed_switches} "
              f"lease_expiries={g.lease_expiries} preemptions={g.preemptions} "
              f"checkpointed={','.join(g.checkpointed_job_ids) or '-'}")
        for d in g.devices:
            print(f"  device {d.device}: {_size(d.free_bytes)} of {_size(d.total_bytes)} free "
                  f"({d.age_seconds:.1f}s ago)")
        for j in g.jobs:
            declared = f"  declared {_size(j.declared_bytes)}" if j.declared_bytes else ""
            if not g.devices:  # footprints need a memory report
                print(f"  job {j.job_id}: {j.state}{declared}  (no GPU memory report: one job on the GPUs at a time)")
                continue
            reserved = f"reserved {_size(j.reserved_bytes)}" if j.settled else "unsettled: runs alone"
            print(f"  job {j.job_id}: {j.state}  on GPU {_size(j.device_bytes)}  peak {_size(j.peak_bytes)}  "
                  f"checkpointed {_size(j.checkpointed_bytes)}  {reserved}{declared}")
        for w in g.waiters:
            print(f"  waiting #{w.position}: {w.job_id} priority={w.priority} for {w.waiting_seconds:.1f}s")
        for line in g.warnings:
            print(f"  warning: {line}")
        for r in g.recent_switches[-5:]:
            result = "ok" if r.ok else f"FAILED: {r.error}"
            print(f"  switch {r.from_job_id or '-'} -> {r.to_job_id}: {result} (checkpoint "
                  f"{r.checkpoint_seconds:.2f}s {r.bytes_checkpointed} B, restore {r.restore_seconds:.2f}s "
                  f"{r.bytes_restored} B)")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="timeslice", description="GPU time-slicing for RL jobs (DRA driver)")
    p.add_argument("--version", action=_Version, help="print the installed version (timeslice.__version__) and exit")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the orchestrator, a node agent and synthetic RL jobs on this machine",
                       description="Run N synthetic RL jobs that share one accelerator through the real "
                                   "orchestrator and node agent; print a timeline and a summary.")
    d.add_argument("--jobs", type=_at_least(1, int), default=2, help="jobs sharing the accelerator (default 2)")
    d.add_argument("--rounds", type=_at_least(1, int), default=6,
                   help="generate/train + reward rounds per job (default 6)")
    d.add_argument("--backend", default="auto", choices=["auto", "freeze", "cuda", "cuda-checkpoint", "none"],
                   help="checkpoint backend; auto: cuda with a GPU and PyTorch, else freeze")
    d.add_argument("--gen-seconds", type=_at_least(0, float), default=0.3,
                   help="accelerator phase length, seconds (default 0.3)")
    d.add_argument("--reward-seconds", type=_at_least(0, float), default=0.3,
                   help="reward phase length, seconds (default 0.3)")
    d.add_argument("--state-mb", type=_at_least(1, int), default=16, help="CPU worker state, MiB (default 16)")
    d.add_argument("--state-gb", type=_at_least(0.001, float), default=1.0, help="GPU worker state, GB (default 1)")
    d.add_argument("--max-hold-seconds", type=_at_least(0.001, float),
                   help="preempt a holder after this long while another job waits (default: no limit)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the timeline")
    d.add_argument("--plot", metavar="PNG", help="also draw the shared jobs' timeline into this image file: GPU "
                                                 "phases, waits, checkpoints and restores (needs the plot extra)")
    d.add_argument("-v", "--verbose", action="store_true", help="log orchestrator and agent activity")
    d.set_defaults(fn=_demo)

    o = sub.add_parser("orchestrator", help="serve the orchestrator with static groups")
    o.add_argument("--config", help="YAML: {listen: host:port, metrics_listen: host:port, pinned_pool: {path, bytes}, "
                                    "groups: [{id, backend, agents, lease_seconds, residency, memory_headroom, "
                                    "max_hold_seconds}], state_file: path, agent_token_file: path, "
                                    "agent_certificates: {target: pem path}}")
    o.add_argument("--listen", help="override the config's listen address (default 127.0.0.1:50051)")
    o.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks one; overrides the "
                        "config's metrics_listen; default off)")
    o.add_argument("--state-file", metavar="PATH",
                   help="persist fencing-epoch floors and each group's holder here (written before each grant), so "
                        "a restart never repeats an epoch nor grants beside a job that may still compute "
                        "(overrides the config's state_file; default: the config's, else orchestrator/state.json "
                        "in the state dir: $XDG_STATE_HOME/timeslice when set, else /var/lib/timeslice as root, "
                        "else ~/.local/state/timeslice)")
    o.add_argument("--no-state-file", action="store_true",
                   help="keep nothing across a restart (unsafe: a restarted orchestrator forgets which job held each "
                        "group, and may grant another beside it while it still computes)")
    _pinned_pool_gb(o, " (unless the config names its pinned_pool)")
    o.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    o.set_defaults(fn=_orchestrator)

    v = sub.add_parser("serve", help="one-box mode: orchestrator and node agent on this machine, no Kubernetes",
                       description="Serve the orchestrator on a unix socket and a node agent beside it. A client "
                                   "needs no job id: each call acts for the job of the calling process's process "
                                   "group (or cgroup), read from the socket's peer credentials, and the agent moves "
                                   "that job's GPU processes. Prints `ready TIMESLICE_ORCHESTRATOR=unix://...` "
                                   "when serving. Exit codes: 0 stopped by SIGINT/SIGTERM/SIGHUP, 2 bad configuration "
                                   "or socket.")
    v.add_argument("--config", metavar="FILE",
                   help="YAML groups, as for `timeslice orchestrator --config` (a group without `agents` uses this "
                        "machine's agent; any backend, cooperative too; pinned_pool, state_file, metrics_listen "
                        "apply; listen does not). Default: one group per GPU, gpu0, gpu1, ...")
    v.add_argument("--backend", default="cuda",
                   choices=["cuda", "cuda-checkpoint", "vmm", "cooperative", "freeze", "none"],
                   help="backend of the default per-GPU groups (default cuda; cooperative: jobs move the state they "
                        "registered with timeslice.torch through the pinned pool, see --pinned-pool-gb; vmm: "
                        "unmodified jobs started with the LD_PRELOAD the ready line prints)")
    v.add_argument("--socket", metavar="PATH", help="the unix socket clients call (default /run/timeslice/"
                                                    "orchestrator.sock as root, else $XDG_RUNTIME_DIR/timeslice/... "
                                                    "or /tmp/timeslice-UID/timeslice/...)")
    v.add_argument("--socket-mode", type=_octal_mode, default=0o600, metavar="OCTAL",
                   help="permission bits of the socket (default 600: only its owner's processes can call)")
    v.add_argument("--job-scope", choices=["process-group", "cgroup"], default="process-group",
                   help="a job's processes: the caller's process group (default) or its cgroup")
    v.add_argument("--state-dir", help="agent records and epoch floors, kept across restarts (default "
                                       "$XDG_STATE_HOME/timeslice when set, else /var/lib/timeslice as root, else "
                                       "~/.local/state/timeslice)")
    _pinned_pool_gb(v)
    v.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    v.set_defaults(fn=_serve)

    n = sub.add_parser("node-agent", help="a node agent outside Kubernetes, for `timeslice orchestrator`'s static "
                                          "groups on several machines",
                       description="Serve the node agent: checkpoint and restore jobs' processes on this machine "
                                   "for a `timeslice orchestrator` whose groups list this address under `agents`. A "
                                   "job's processes are those whose environment has TIMESLICE_JOB=<job> (start the "
                                   "job with it; children inherit it), narrowed to those with a CUDA context (or, "
                                   "without NVML, marked TIMESLICE_ACCELERATOR_PROCESS=1). Prints `ready listen=...` "
                                   "when serving. Exit codes: 0 stopped by SIGINT/SIGTERM/SIGHUP, 2 bad flags or "
                                   "address.")
    n.add_argument("--listen", default="unix:///run/timeslice/agent.sock",
                   help="unix:///path (mode 0600; default unix:///run/timeslice/agent.sock) or host:port (needs "
                        "--token-file; port 0 picks one)")
    n.add_argument("--backends", default="cuda,cuda-checkpoint,vmm,freeze,none",
                   help="comma-separated backends this node offers (default cuda,cuda-checkpoint,vmm,freeze,none; "
                        "add app for inference engines; cooperative jobs move themselves and need no agent backend)")
    n.add_argument("--token-file", help="callers must send this file's token (the orchestrator's agent_token_file)")
    n.add_argument("--tls", action="store_true", help="serve TLS with a self-signed certificate (made once, kept in "
                                                       "--state-dir across restarts; renewed 30 days before expiry)")
    n.add_argument("--certificate-file", help="with --tls: write the certificate (PEM) here, for the orchestrator's "
                                              "agent_certificates")
    n.add_argument("--state-dir", default="/var/lib/timeslice/node-agent", help="checkpoint records, kept across "
                                                                               "restarts")
    n.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    n.set_defaults(fn=_node_agent)

    k = sub.add_parser("kubelet-plugin", help="serve the DRA kubelet plugin and the node agent on this node",
                       description="Publish this node's GPUs as ResourceSlices, prepare claims for the kubelet "
                                   "(CDI), and checkpoint/restore claims' processes for the orchestrator.")
    k.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node (default $NODE_NAME)")
    k.add_argument("--fake-gpus", help="publish fake GPUs instead of NVML's, e.g. 4xH200 (tests, demos)")
    k.add_argument("--driver-root", metavar="PATH",
                   help="the NVIDIA driver's root as mounted in this container: libnvidia-ml.so.1 and libcuda.so.1 "
                        "are loaded from there, a node without them is refused at start, and claims' CDI specs "
                        "bind-mount the driver's libraries into /usr/local/nvidia/lib64 (default: none; the "
                        "libraries the image or the host's loader finds, no mounts)")
    k.add_argument("--driver-root-host", metavar="PATH",
                   help="the same directory as --driver-root on the node, for the CDI mounts (default: "
                        "--driver-root)")
    k.add_argument("--sharing", choices=["seats", "consumable"], help="how a GPU is published (default seats)")
    k.add_argument("--seats", type=int, help="seats per GPU in seats mode (default 4)")
    k.add_argument("--state-dir", help="checkpoint and agent records (default <plugins>/gpu.timeslice.dev/state)")
    k.add_argument("--cdi-dir", help="CDI spec directory (default /var/run/cdi)")
    k.add_argument("--plugin-data-dir", help="DRA socket directory (default /var/lib/kubelet/plugins/<driver>)")
    k.add_argument("--registry-dir", help="kubelet plugin registry (default /var/lib/kubelet/plugins_registry)")
    k.add_argument("--agent-listen", help="node agent gRPC address: unix:///path or, with --agent-auth "
                                          "tokenreview, HOST:PORT (default unix:///var/lib/kubelet/plugins/"
                                          "gpu.timeslice.dev/agent.sock)")
    k.add_argument("--agent-auth", choices=["none", "tokenreview"],
                   help="who may call the node agent: tokenreview = callers send a projected ServiceAccount "
                        "token (audience timeslice.dev/node-agent), checked with TokenReview, of a user in "
                        "--agent-allowed-users; none = the owner of its unix socket (mode 0600; refused with a "
                        "HOST:PORT --agent-listen) (default none)")
    k.add_argument("--agent-allowed-users",
                   help="with --agent-auth tokenreview: TokenReview user names allowed to call the agent, "
                        "comma-separated (default system:serviceaccount:timeslice-system:timeslice-controller)")
    k.add_argument("--agent-tls", action="store_true",
                   help="serve the node agent with TLS: a self-signed ECDSA P-256 certificate made at start (valid "
                        "1 year, name timeslice-node-agent; the key stays in memory), published on this pod as "
                        "annotation timeslice.dev/agent-certificate (needs $POD_NAME, $POD_NAMESPACE and RBAC "
                        "'patch pods'), where the controller pins it (default off: plaintext)")
    k.add_argument("--backends", help="checkpoint backends offered, comma-separated, of cuda, cuda-checkpoint, "
                                      "freeze, app (the job's inference engine sleeps and wakes), none "
                                      "(default freeze,none)")
    k.add_argument("--orchestrator", default=os.environ.get("TIMESLICE_ORCHESTRATOR"),
                   help="orchestrator address injected into containers (default $TIMESLICE_ORCHESTRATOR)")
    k.add_argument("--liveness-file", metavar="PATH",
                   help="touch PATH every 5 s while the plugin works, for a livenessProbe that runs "
                        "`python3 -m timeslice.driver.liveness PATH 30` (exit 1 when it is older than 30 s: "
                        "a stuck event loop or a background task that ended) (default off)")
    k.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    k.set_defaults(fn=_kubelet_plugin)

    c = sub.add_parser("controller", help="watch claims, build lock groups, serve the orchestrator",
                       description="Derive lock groups from ResourceClaims allocated by gpu.timeslice.dev and "
                                   "serve the orchestrator API for them; write claim status and Events.")
    c.add_argument("--listen", help="orchestrator gRPC address (default 0.0.0.0:50051)")
    c.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics on every replica; a replica that "
                        "does not lead reports no groups (default off)")
    c.add_argument("--agent-template",
                   help="a node's agent address, {node} = node name, for agents that are not pods (default: the "
                        "node-plugin pods' IP and 'agent' port)")
    c.add_argument("--agent-namespace",
                   help="namespace of the node-plugin pods (default $POD_NAMESPACE or timeslice-system)")
    c.add_argument("--default-backend", choices=["cuda", "cuda-checkpoint", "vmm", "freeze", "none"],
                   help="backend for groups whose claims leave it to auto (default cuda)")
    c.add_argument("--auth", choices=["none", "tokenreview"],
                   help="client authentication: projected ServiceAccount tokens checked with TokenReview "
                        "(default none)")
    c.add_argument("--agent-token-file",
                   help="token file sent to the node agents as 'authorization: Bearer' on every call, re-read "
                        "when the file changes: a projected ServiceAccount token with audience "
                        "timeslice.dev/node-agent, for agents run with --agent-auth tokenreview (default: none)")
    c.add_argument("--require-agent-tls", action="store_true",
                   help="call only node agents whose plugin pod publishes a TLS certificate (annotation "
                        "timeslice.dev/agent-certificate, kubelet-plugin --agent-tls); switches on a node whose "
                        "agent publishes none fail (UNAVAILABLE) and roll back. Without it, agents that publish a "
                        "certificate are called over TLS pinning it, the others in plaintext. Needs the plugin "
                        "pods: not with --agent-template")
    c.add_argument("--leader-election", action="store_true",
                   help="serve only while holding the Lease timeslice-system/timeslice-controller")
    c.add_argument("--lease-duration", type=int, help="seconds (default 15)")
    c.add_argument("--renew-deadline", type=float, help="seconds (default 10)")
    c.add_argument("--retry-period", type=float, help="seconds (default 2)")
    c.add_argument("--resync-seconds", type=float,
                   help="full relist of claims, pods and ResourceSlices every this many seconds, so that a missed "
                        "watch event (a deleted pod still holding its GPUs) heals (default 300)")
    c.add_argument("--liveness-file", metavar="PATH",
                   help="touch PATH every 5 s while the replica (leader or standby) works, for a livenessProbe "
                        "that runs "
                        "`python3 -m timeslice.driver.liveness PATH 30` (exit 1 when it is older than 30 s: "
                        "a stuck event loop or a background task that ended) (default off)")
    c.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    c.set_defaults(fn=_controller)

    r = sub.add_parser("run", help="run a command while this job holds a group (like flock)",
                       description="Acquire the group, run CMD, release when it ends and so have the "
                                   "processes it left running (a worker started with &: they are the job's); exit "
                                   "with CMD's status. "
                                   "Other exit codes: 75 no grant within --timeout, 69 orchestrator unreachable, "
                                   "group unknown or the job failed, 70 the hold was lost while CMD ran, 127 CMD "
                                   "cannot start, 2 usage.",
                       usage="timeslice run [-h] [--target ADDRESS] [--job JOB] [--group GROUP] "
                             "[--timeout SECONDS] [--priority N] -- CMD [ARG ...]")
    r.add_argument("--target", metavar="ADDRESS", help=TARGET_HELP)
    r.add_argument("--job", help="job id (default $TIMESLICE_JOB; in a pod with a token: the pod's job); CMD runs "
                                 "with TIMESLICE_JOB set to it")
    r.add_argument("--group", help="group or claim name (default $TIMESLICE_GROUP)")
    r.add_argument("--timeout", type=float, metavar="SECONDS", help="seconds to wait for the grant (default: no bound)")
    r.add_argument("--priority", type=int, default=0, metavar="N", help="queue priority, higher first (default 0)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    r.set_defaults(fn=_run)

    for name, text in (("acquire", "hold a group until `timeslice release` (for shell scripts)"),
                       ("release", "end a hold taken by `timeslice acquire`")):
        codes = ("0 granted, 75 no grant within --timeout, 69 orchestrator unreachable, group unknown or the job "
                 "failed, 130 interrupted (no hold is left), 2 usage or a hold already there" if name == "acquire" else
                 "0 released, 70 the hold was lost before release (its lease lapsed, or the holder was killed), "
                 "2 no hold file")
        h = sub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}. A holder process keeps the "
                           "lease alive in between, and releases when the process that ran `acquire` (the script) "
                           "ends without releasing; its hold file (JSON: pid, group, job, epoch) says where it is. "
                           "`timeslice run` of the same job joins the hold; a second acquire of it is refused (2). "
                           f"Exit codes: {codes}.")
        h.add_argument("--job", help="job id (default $TIMESLICE_JOB; with a unix: target, timeslice serve, "
                                     "pgid-<N>: this process group, the script's). On a standalone node, export "
                                     "TIMESLICE_JOB instead: the node agent finds the script's commands by it")
        h.add_argument("--group", help="group or claim name (default $TIMESLICE_GROUP)")
        h.add_argument("--hold-file", help="where the hold is recorded (default $XDG_RUNTIME_DIR or /tmp, "
                                           "timeslice-<uid>/hold-<job>@<group>.json)")
        if name == "acquire":
            h.add_argument("--target", metavar="ADDRESS", help=TARGET_HELP)
            h.add_argument("--timeout", type=float, metavar="SECONDS", help="seconds to wait for the grant (default: "
                           "no bound)")
            h.add_argument("--priority", type=int, default=0, metavar="N", help="queue priority, higher first "
                           "(default 0)")
        h.set_defaults(fn=_acquire if name == "acquire" else _release)

    s = sub.add_parser("status", help="print groups, holders, queues and recent switches",
                       description="An orchestrator with --auth tokenreview wants a token (audience timeslice.dev) "
                                   "in $TIMESLICE_TOKEN_FILE, e.g. from `kubectl create token <serviceaccount> "
                                   "--audience timeslice.dev`.")
    s.add_argument("--target", default=os.environ.get("TIMESLICE_ORCHESTRATOR"), metavar="ADDRESS", help=TARGET_HELP)
    s.add_argument("--group", help="one group only")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_status)

    g = sub.add_parser("plot", help="draw the timeline of a demo or benchmark result (PNG)",
                       description="Draw one row per job on one time axis: waits for the lock, holds, GPU phases, "
                                   "checkpoints and restores (with the bytes moved). RESULT: the JSON of `timeslice "
                                   "demo --json` or of bench/rl_grpo.py (a list: one panel each). Needs matplotlib: "
                                   f"{install_hint('plot')}.")
    g.add_argument("result", metavar="RESULT", help="a result JSON file")
    g.add_argument("-o", "--output", metavar="PNG",
                   help="the image (default: RESULT's name with .png, in the current directory; the suffix picks "
                        "the format)")
    g.set_defaults(fn=_plot)

    m = sub.add_parser("vmm-shim", help="print the path of the timeslice-vmm shim (backend vmm: a job's processes "
                                        "load it, e.g. `LD_PRELOAD=$(timeslice vmm-shim) python train.py`)",
                       description="Backend vmm moves an unmodified job's GPU memory through this shim in its "
                                   "processes (docs/backends.md). `timeslice serve` prints it in its ready line and "
                                   "the kubelet plugin puts it into a claim's containers; start a job's processes "
                                   "with it yourself elsewhere. Exit code 2: this install has no shim (built without "
                                   "a C compiler).")
    m.set_defaults(fn=_vmm_shim)
    return p


# A module a command imports -> the extra of this package that installs it (pyproject.toml).
EXTRAS = {"yaml": "server", "pydantic": "server", "prometheus_client": "server", "aiohttp": "server",
          "cryptography": "server", "grpc_health": "server", "kubernetes": "kubernetes", "pynvml": "gpu",
          "cuda": "gpu", "torch": "torch", "matplotlib": "plot"}


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return int(a.fn(a))
    except ModuleNotFoundError as err:  # a client-only install running a server command: name the extra
        top = (err.name or "").split(".")[0]
        fix = install_hint(EXTRAS[top]) if top in EXTRAS else f"pip install {top}"
        print(f"timeslice {a.command}: error: it needs the Python package {top!r}, which is not installed: {fix}",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # `timeslice status | head`: the reader left; no traceback (Python docs, signal)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OSError, ValueError, FailedPrecondition) as err:  # a bad config file, flag value or address, a node
        # without the NVIDIA driver (GpuDiscoveryError): a line per problem, no traceback
        for line in str(err).splitlines() or [""]:
            print(f"timeslice {a.command}: error: {line}", file=sys.stderr)
        return 2
    except Exception as err:
        if type(err).__name__ != "ConfigException":  # kubernetes.config: no cluster to talk to
            raise
        print(f"timeslice {a.command}: error: no Kubernetes cluster: {err} (run it in a pod with a service "
              "account, or set KUBECONFIG)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
