"""Names and constants of timeslice-dra (DESIGN.md, "Names").

Owned by the driver package; imported by every server component.
"""

from typing import Final

DRIVER_NAME = "gpu.timeslice.dev"
DEVICE_CLASS = "gpu.timeslice.dev"
LABEL_PREFIX = "timeslice.dev/"
JOB_LABEL = LABEL_PREFIX + "job"
CONFIG_API_VERSION = "timeslice.dev/v1alpha1"
CONFIG_KIND = "TimeSliceConfig"

# Backends a node agent knows (DESIGN.md, "Node agent and checkpoint backends").
BACKEND_CUDA = "cuda"
BACKEND_CUDA_CHECKPOINT = "cuda-checkpoint"
BACKEND_FREEZE = "freeze"
BACKEND_NONE = "none"
# The job's inference engine (vLLM, SGLang) frees and re-takes its GPU memory on the agent's
# call (kubelet_plugin/agent/backends/app.py; the engine in driver/app_engine.py).
BACKEND_APP = "app"
# An unmodified job's device memory moved by the timeslice-vmm shim in its processes (LD_PRELOAD;
# kubelet_plugin/agent/backends/vmm.py, shim/timeslice_vmm.c): addresses kept, at the link's speed.
BACKEND_VMM = "vmm"
BACKENDS = (BACKEND_CUDA, BACKEND_CUDA_CHECKPOINT, BACKEND_VMM, BACKEND_FREEZE, BACKEND_APP, BACKEND_NONE)
# Backends whose checkpoint stops the job's processes (SIGSTOP) or locks them (CUDA calls
# block): a checkpointed job's client may not answer. Under `app` and `cooperative` it runs on.
STOPPING_BACKENDS = (BACKEND_CUDA, BACKEND_CUDA_CHECKPOINT, BACKEND_FREEZE)
# Of those, the ones that stop a process by locking its CUDA context (cuCheckpointProcessLock):
# a process with no context yet (it has not made its first CUDA call) has nothing to lock, and a
# checkpoint leaves it running (controller/orchestrator/leases.py: such a holder is not fenced).
CONTEXT_LOCKING_BACKENDS = (BACKEND_CUDA, BACKEND_CUDA_CHECKPOINT)
# Backends that move a job's memory without stopping its processes or its client: moved under a
# holder that still computes, its work fails (`app`: its requests; `vmm`: its kernels find their
# memory unmapped, the process dies). A hold that ends without its client's release (a lapsed or
# revoked lease, `maxHoldSeconds`, a merge of groups) is moved only once its client released or
# its processes are gone (controller/orchestrator/awake_engines.py).
UNRELEASED_KEPT_BACKENDS = (BACKEND_APP, BACKEND_VMM)
# Moved by the job's own process (timeslice.torch) on the orchestrator's command, not by a
# node agent: agents only report memory for it.
BACKEND_COOPERATIVE = "cooperative"
# Residency (DESIGN.md): "auto" moves memory only when the incoming job does not fit, with
# this much of each GPU's memory kept free; "exclusive" checkpoints at every hand-off.
RESIDENCY_AUTO: Final = "auto"
RESIDENCY_EXCLUSIVE: Final = "exclusive"
DEFAULT_MEMORY_HEADROOM = "10%"
# Under residency "auto", a waiter whose grant would move memory may be passed by waiters of
# its priority that are resident (no move) for at most this long, seconds: a switch then
# serves a run of phases, not each one (0: strict queue order).
DEFAULT_RESIDENT_FIRST_SECONDS = 30.0

DEFAULT_LEASE_SECONDS = 10.0
# Bound on one checkpoint or restore step on one node, seconds. The CUDA driver
# checkpoints at ~1.5 GB/s on an H200 (reference/checkpoint-h200.md), so a full
# 141 GB GPU needs ~95 s.
DEFAULT_STEP_TIMEOUT_SECONDS = 300.0
# Bound on the CUDA process lock (cuCheckpointProcessLock timeoutMs), seconds.
DEFAULT_LOCK_TIMEOUT_SECONDS = 10.0

# Node-agent API authentication (DESIGN.md, "Security"): the orchestrator sends a projected
# ServiceAccount token with this audience; the agent accepts only these users by default.
AGENT_AUDIENCE = "timeslice.dev/node-agent"
DEFAULT_AGENT_CALLERS = ("system:serviceaccount:timeslice-system:timeslice-controller",)

# Node-agent TLS (`timeslice kubelet-plugin --agent-tls`, DESIGN.md "Security"): the agent
# serves a self-signed certificate that names this server name, and publishes it (PEM) on
# its own pod under this annotation; the controller pins exactly that certificate and
# checks this name (gRPC channel option `grpc.ssl_target_name_override`).
AGENT_TLS_SERVER_NAME = "timeslice-node-agent"
AGENT_CERTIFICATE_ANNOTATION = LABEL_PREFIX + "agent-certificate"

# NCCL without the transports that map one process's GPU memory into another: what the
# cuda backends need of a multi-GPU NCCL job (kubelet_plugin/agent/backends/peer_memory.py),
# and what TimeSliceConfig ncclPeerTransports: false puts in the claim's containers.
NCCL_NO_PEER_MEMORY_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def install_hint(extra: str) -> str:
    """How to install the extra `extra` (pyproject.toml) of this project, which is not on
    PyPI: from its checkout (or a wheel built there)."""
    return f"pip install '/path/to/timeslice-dra[{extra}]' (from your checkout: timeslice-dra is not on PyPI)"
