"""The seam between the kubelet's DRA calls and the code that prepares claims.

Owned by the kubelet plugin. `dra_service.DRAService` (the gRPC adapter, for both
DRAPlugin versions) calls a `ClaimPlugin` with plain domain objects defined here; the
implementation (device state, CDI specs, the node checkpoint) never sees protobuf or
gRPC. Tests put a fake `ClaimPlugin` here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as kubelet names it; the adapter guarantees all three are non-empty."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device made ready for containers.

    `request_names`: the claim's requests this device serves (empty: all of them); a
    subrequest (`req/sub`) is reported as its request (`req`) by the adapter.
    `pool_name` and `device_name` are required. `cdi_device_ids` are fully qualified
    (`<vendor>/<class>=<name>`). `share_id` identifies one share of a device allocated
    more than once; only DRAPlugin v1 carries it.
    """

    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str] = field(default_factory=list)
    share_id: str | None = None


@dataclass(frozen=True)
class PrepareResult:
    """The outcome for one claim: its devices, or an error (then the devices are ignored)."""

    devices: list[PreparedDevice] = field(default_factory=list)
    error: str | None = None


class ClaimPlugin(Protocol):
    """What prepares and unprepares claims on this node. Contract:

    - **One result per claim UID.** Both methods return a dict keyed by the UID of every
      claim passed in. A missing entry becomes an error for that claim (kubelet then
      calls again); entries for UIDs that were not asked for are dropped and logged.
    - **Failures are per claim.** A claim that cannot be prepared gets its `error`;
      the others still succeed. An exception fails every claim of the call, each with
      the exception's message: it never becomes a gRPC error (kubelet would ignore the
      whole response).
    - **Idempotent.** Kubelet calls prepare again for a claim already prepared (after a
      kubelet restart or a node reboot, when a pod sandbox is recreated): return the
      same devices, and recreate what may be gone (CDI specs live in tmpfs). Unprepare
      of a claim not prepared (or already unprepared) succeeds.
    - **Restarts.** Unprepare may run in a fresh process, for a claim prepared before
      the restart: it must work from the node checkpoint, not from memory.
    - **Concurrent.** The adapter runs calls at once (kubelet prepares different pods'
      claims in parallel): an implementation locks what its calls share (`ClaimPreparer`:
      one lock per claim).
    - **Cancellation.** Kubelet gives up on a call after 45 s; the adapter's task is
      then cancelled (`asyncio.CancelledError` inside the plugin).
    """

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare `claims` (distinct UIDs, at least one); returns {claim UID: result}."""
        ...

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        """Undo prepare for `claims`; returns {claim UID: error, or None when done}."""
        ...
