"""ClaimStatusWriter: lock state where users look, on the ResourceClaims themselves.

Owned by the controller app; fed by the orchestrator's group observer. For every
allocated device of our driver it writes `status.devices[]` of the claim (KEP-4817,
gate DRAResourceClaimDeviceStatus) with conditions `LockHeld` and `Resident` (reason
`Checkpointed` when False) and `data` {groupId, holder, queuePosition,
lastSwitchSeconds, bytesMoved}; and records Events for grants, switches (seconds and
bytes), failed switches, lease expiries and preemptions (maxHoldSeconds). Writes are coalesced per group (every
`interval` seconds at most). A group whose write fails (API server away, 5xx) stays
dirty and is retried on its own with backoff (`retry`), so its claims catch up once the
API server is back even when no lock event follows; the lock never waits on a write, so
an API server outage pauses status but never a grant. Events are best effort: one that
cannot be recorded is logged and dropped (`driver/events.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from typing import Any

from timeslice.controller.grouping import DeviceRef, PhysicalGpu, Snapshot
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.group_model import GroupEvent
from timeslice.controller.reflector import describe_error
from timeslice.driver import names
from timeslice.driver.backoff import Backoff
from timeslice.driver.events import EventRecorder
from timeslice.driver.tasks import cancel_and_wait

log = logging.getLogger("timeslice.controller.status")

EVENTS = {  # group event kind -> (reason, warning?)
    "granted": ("LockGranted", False),
    "switched": ("Switched", False),
    "switch-failed": ("SwitchFailed", True),
    "lease-expired": ("LeaseExpired", True),
    "preempted": ("Preempted", False),
    "job-failed": ("JobFailed", True),
}
# After a failed write of a group: 0.5 s, 1 s, 2 s, ... at most 10 s (+-20%) until one succeeds.
RETRY_BACKOFF = Backoff(initial=0.5, maximum=10.0)


def merged_devices(current: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`status.devices` with `ours` written into it. An entry belongs to its driver
    (resource.k8s.io/v1 AllocatedDeviceStatus, keyed by driver, pool, device and shareID):
    other drivers' entries stay as they are, and so do other writers' conditions on ours;
    our entries for devices no longer allocated go. A merge patch replaces a list whole, so
    the caller sends this list, not ours alone."""
    def key(d: dict[str, Any]) -> tuple[str, str, str, str]:
        return (d.get("driver", ""), d.get("pool", ""), d.get("device", ""), d.get("shareID") or "")

    mine = {key(d): d for d in ours}
    ours_types = {c["type"] for d in ours for c in d.get("conditions", [])}
    out = []
    for d in current:
        new = mine.pop(key(d), None)
        if new is not None:
            kept = [c for c in d.get("conditions") or [] if c.get("type") not in ours_types]
            out.append({**d, **new, "conditions": kept + new["conditions"]})
        elif d.get("driver") != names.DRIVER_NAME:
            out.append(d)
    return out + list(mine.values())


async def write_claim(api: Any, namespace: str, name: str, conditions: list[dict[str, Any]],
                      data: dict[str, Any], gpus: Mapping[DeviceRef, PhysicalGpu]) -> None:
    """Write our `status.devices` entries of one claim: one per allocation result of our
    driver, keyed by driver, pool, device and (consumable mode) the result's `shareID`
    (resource.k8s.io/v1 AllocatedDeviceStatus; the API server refuses an entry that names
    no allocated device with HTTP 422). Each entry carries `conditions`, `data` and its
    GPU's `uuid`, `productName` and `driverVersion` from the ResourceSlices (`gpus`).
    `api`: kubernetes.aio ResourceV1Api. Raises the API's exceptions (409 on a concurrent
    write: the caller retries)."""
    claim = api.api_client.sanitize_for_serialization(await api.read_namespaced_resource_claim(name, namespace))
    status = claim.get("status") or {}
    results = status.get("allocation", {}).get("devices", {}).get("results", [])
    ours = []
    for r in results:
        if r["driver"] != names.DRIVER_NAME:
            continue
        gpu = gpus.get((r["pool"], r["device"]))
        ours.append({"driver": r["driver"], "pool": r["pool"], "device": r["device"],
                     **({"shareID": r["shareID"]} if r.get("shareID") else {}),
                     "conditions": conditions,
                     "data": {**data, **(gpu.status_data() if gpu else {})}})
    # the whole list, as read at this resourceVersion (a concurrent write: 409, retried)
    await api.patch_namespaced_resource_claim_status(name, namespace, {
        "metadata": {"resourceVersion": claim["metadata"]["resourceVersion"]},
        "status": {"devices": merged_devices(status.get("devices") or [], ours)}})


def condition(kind: str, ok: bool, reason: str, message: str, now: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message,
            "lastTransitionTime": now}


class ClaimStatusWriter:
    """`resource_api`: kubernetes.aio ResourceV1Api; `snapshot()` the reconciler's latest.
    `interval`: seconds between write rounds; `retry`: delays before retrying a group
    whose write failed (by its failures in a row)."""

    def __init__(self, resource_api: Any, events: EventRecorder, snapshot: Callable[[], Snapshot],
                 interval: float = 0.5, retry: Backoff = RETRY_BACKOFF) -> None:
        self._api = resource_api
        self._events = events
        self._snapshot = snapshot
        self._interval = interval
        self._retry = retry
        self._dirty: dict[str, LockGroup] = {}
        self._failures: dict[str, int] = {}    # group id -> failed writes in a row
        self._retry_at: dict[str, float] = {}  # group id -> loop time before which it is not retried
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def mark(self, group: LockGroup) -> None:
        """Write the group's claims' status soon (a new or changed group, a lock event)."""
        self._dirty[group.id] = group
        self._wake.set()

    def observe(self, group: LockGroup, event: GroupEvent) -> None:
        """The orchestrator's observer: mark the group dirty, send the Event."""
        self.mark(group)
        if event.kind in EVENTS:
            asyncio.get_running_loop().create_task(self._event(event))

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The background task (None before `start()`), for liveness checks."""
        return self._task

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="claim-status")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def pending(self) -> dict[str, int]:
        """Group id -> failed writes in a row, for the groups whose status is not written yet."""
        return {gid: self._failures.get(gid, 0) for gid in self._dirty}

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._due()
            now = loop.time()
            due = [g for gid, g in self._dirty.items() if self._retry_at.get(gid, 0.0) <= now]
            for group in due:
                del self._dirty[group.id]
            live = self._snapshot().groups
            for group in due:
                if group.id not in live:  # removed meanwhile: its claims are gone or another group's
                    self._failures.pop(group.id, None)
                    self._retry_at.pop(group.id, None)
                    continue
                try:
                    await self.write(group)
                except Exception as err:  # API server away: keep it dirty, retry after a backoff
                    failures = self._failures[group.id] = self._failures.get(group.id, 0) + 1
                    delay = self._retry.delay(failures - 1)
                    self._retry_at[group.id] = loop.time() + delay
                    self._dirty.setdefault(group.id, group)
                    log.warning("claim status not written group=%s attempt=%d retry_in=%.2fs error=%s", group.id,
                                failures, delay, describe_error(err))
                else:
                    if self._failures.pop(group.id, 0):
                        log.info("claim status written again group=%s", group.id)
                    self._retry_at.pop(group.id, None)
            await asyncio.sleep(self._interval)

    async def _due(self) -> None:
        """Until a dirty group is due: at once after a change, at its retry time after a failure."""
        loop = asyncio.get_running_loop()
        while True:
            at = min((self._retry_at.get(gid, 0.0) for gid in self._dirty), default=None)
            if at is not None and at <= loop.time():
                return
            self._wake.clear()  # a change from here on wakes the wait below
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), None if at is None else at - loop.time())

    def _claims_of(self, member: str) -> list[tuple[str, str]]:
        cs = self._snapshot().claim_sets.get(member)
        return [(c.namespace, c.name) for c in cs.claims] if cs else []

    async def write(self, group: LockGroup) -> None:
        v = group.view()
        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
        positions = {w.job_id: w.position for w in v.waiters}
        last = v.recent_switches[-1] if v.recent_switches else None
        for member in group.spec.members:
            held = v.holder is not None and v.holder.job_id == member.claim_set
            resident = member.claim_set in v.resident_jobs
            data = {"groupId": v.group_id, "holder": v.holder.job_id if v.holder else "",
                    "epoch": v.epoch, "residency": v.residency, "residents": v.resident_jobs,
                    "peakBytes": sum(v.peaks.get(member.claim_set, {}).values()),
                    "declaredBytes": v.declared.get(member.claim_set, 0),
                    # 0 while unsettled (declared nothing, still growing): it runs alone
                    "reservedBytes": sum(v.reserved.get(member.claim_set, {}).values()),
                    "deviceBytes": sum(v.memory.on_device(member.claim_set).values()) if v.memory else 0,
                    "freeBytes": min((m.free for m in v.memory.devices.values()), default=0) if v.memory else 0,
                    "queuePosition": positions.get(member.claim_set, -1),
                    "lastSwitchSeconds": round(last.seconds, 3) if last else 0.0,
                    "bytesMoved": (last.bytes_checkpointed + last.bytes_restored) if last else 0}
            conditions = [
                condition("LockHeld", held,
                          "Holder" if held else ("Waiting" if member.claim_set in positions else "Idle"),
                          f"group {v.group_id}: holder {data['holder'] or 'none'}", now),
                condition("Resident", resident, "Resident" if resident else "Checkpointed"
                          if member.claim_set in v.checkpointed_jobs else "NotLoaded",
                          f"group {v.group_id}: resident {', '.join(v.resident_jobs) or 'none'}", now)]
            for namespace, name in self._claims_of(member.claim_set):
                await write_claim(self._api, namespace, name, conditions, data, self._snapshot().gpus)

    async def recorded(self, group: LockGroup) -> tuple[str | None, int]:
        """(resident job, last epoch) as the claims' status.devices record them."""
        resident, epoch = None, 0
        for member in group.spec.members:
            for namespace, name in self._claims_of(member.claim_set):
                claim = self._api.api_client.sanitize_for_serialization(
                    await self._api.read_namespaced_resource_claim(name, namespace))
                for d in claim.get("status", {}).get("devices", []) or []:
                    data = d.get("data") or {}
                    if d.get("driver") != names.DRIVER_NAME or data.get("groupId") != group.id:
                        continue
                    epoch = max(epoch, int(data.get("epoch", 0)))
                    if any(c["type"] == "Resident" and c["status"] == "True" for c in d.get("conditions", [])):
                        resident = member.claim_set
        return resident, epoch

    async def _event(self, e: GroupEvent) -> None:
        reason, warning = EVENTS[e.kind]
        r = e.record
        message = {
            "granted": f"group {e.group_id}: lock granted to {e.job_id} (epoch {e.epoch})",
            "switched": f"group {e.group_id}: switched {r.from_job if r else '-'} -> {e.job_id} in "
                        f"{r.seconds if r else 0:.3f} s, {(r.bytes_checkpointed + r.bytes_restored) if r else 0} "
                        "bytes moved",
            "switch-failed": f"group {e.group_id}: switch to {e.job_id} failed: {r.error if r else ''}",
            "lease-expired": f"group {e.group_id}: lease of {e.job_id} (epoch {e.epoch}) expired",
            "preempted": f"group {e.group_id}: {e.job_id} (epoch {e.epoch}) held past its maxHoldSeconds while "
                         "others waited: preempted (checkpointed and queued again; with backend none or cooperative, "
                         "lease revoked; app: lease revoked, its engine slept once its client released)",
            "job-failed": f"group {e.group_id}: {e.job_id} failed: {r.error if r else ''}",
        }[e.kind]
        for namespace, name in self._claims_of(e.job_id):
            await self._events.claim_event(namespace, name, "", reason, message, warning=warning)
