"""ClaimStatusWriter: lock state where users look, on the ResourceClaims themselves.

Owned by the controller app; fed by the orchestrator's group observer. For every
allocated device of our driver it writes `status.devices[]` of the claim (KEP-4817,
gate DRAResourceClaimDeviceStatus) with conditions `LockHeld` and `Resident` (reason
`Checkpointed` when False) and `data` {groupId, holder, queuePosition,
lastSwitchSeconds, bytesMoved}; and records Events for grants, switches (seconds and
bytes), failed switches and lease expiries. Writes are coalesced per group (every
`interval` seconds at most); API errors are logged and retried at the next change, so
an API server outage pauses status but never a grant.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from timeslice.controller.grouping import Snapshot
from timeslice.controller.orchestrator.group import GroupEvent, LockGroup
from timeslice.driver import names
from timeslice.driver.events import EventRecorder

log = logging.getLogger("timeslice.controller.status")

EVENTS = {  # group event kind -> (reason, warning?)
    "granted": ("LockGranted", False),
    "switched": ("Switched", False),
    "switch-failed": ("SwitchFailed", True),
    "lease-expired": ("LeaseExpired", True),
}


def condition(kind: str, ok: bool, reason: str, message: str, now: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message,
            "lastTransitionTime": now}


class ClaimStatusWriter:
    """`resource_api`: kubernetes.aio ResourceV1Api; `snapshot()` the reconciler's latest."""

    def __init__(self, resource_api: Any, events: EventRecorder, snapshot: Callable[[], Snapshot],
                 interval: float = 0.5) -> None:
        self._api = resource_api
        self._events = events
        self._snapshot = snapshot
        self._interval = interval
        self._dirty: dict[str, LockGroup] = {}
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

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="claim-status")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, {}
            for group in dirty.values():
                try:
                    await self.write(group)
                except Exception as err:  # API server away: retry with the next change
                    log.warning("claim status not written group=%s: %s", group.id, err)
                    self._dirty.setdefault(group.id, group)
            await asyncio.sleep(self._interval)

    def _claims_of(self, member: str) -> list[tuple[str, str]]:
        cs = self._snapshot().claim_sets.get(member)
        return [(c.namespace, c.name) for c in cs.claims] if cs else []

    async def write(self, group: LockGroup) -> None:
        v = group.view()
        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
        positions = {w.job_id: w.position for w in v.waiters}
        last = v.recent_switches[-1] if v.recent_switches else None
        for member in group.spec.members:
            held = v.holder is not None and v.holder.job_id == member.job
            resident = v.resident_job == member.job
            data = {"groupId": v.group_id, "holder": v.holder.job_id if v.holder else "",
                    "epoch": v.epoch,
                    "queuePosition": positions.get(member.job, -1),
                    "lastSwitchSeconds": round(last.seconds, 3) if last else 0.0,
                    "bytesMoved": (last.bytes_checkpointed + last.bytes_restored) if last else 0}
            conditions = [
                condition("LockHeld", held, "Holder" if held else ("Waiting" if member.job in positions else "Idle"),
                          f"group {v.group_id}: holder {data['holder'] or 'none'}", now),
                condition("Resident", resident, "Resident" if resident else "Checkpointed"
                          if member.job in v.checkpointed_jobs else "NotLoaded",
                          f"group {v.group_id}: resident {v.resident_job or 'none'}", now)]
            for namespace, name in self._claims_of(member.job):
                claim = self._api.api_client.sanitize_for_serialization(
                    await self._api.read_namespaced_resource_claim(name, namespace))
                results = claim.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
                devices = [{"driver": r["driver"], "pool": r["pool"], "device": r["device"],
                            "conditions": conditions, "data": data}
                           for r in results if r["driver"] == names.DRIVER_NAME]
                await self._api.patch_namespaced_resource_claim_status(
                    name, namespace, {"status": {"devices": devices}})

    async def recorded(self, group: LockGroup) -> tuple[str | None, int]:
        """(resident job, last epoch) as the claims' status.devices record them."""
        resident, epoch = None, 0
        for member in group.spec.members:
            for namespace, name in self._claims_of(member.job):
                claim = self._api.api_client.sanitize_for_serialization(
                    await self._api.read_namespaced_resource_claim(name, namespace))
                for d in claim.get("status", {}).get("devices", []) or []:
                    data = d.get("data") or {}
                    if d.get("driver") != names.DRIVER_NAME or data.get("groupId") != group.id:
                        continue
                    epoch = max(epoch, int(data.get("epoch", 0)))
                    if any(c["type"] == "Resident" and c["status"] == "True" for c in d.get("conditions", [])):
                        resident = member.job
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
        }[e.kind]
        for namespace, name in self._claims_of(e.job_id):
            await self._events.claim_event(namespace, name, "", reason, message, warning=warning)
