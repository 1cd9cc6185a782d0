"""Kubernetes Events on ResourceClaims: where users look (`kubectl describe resourceclaim`).

Owned by the driver package; used by the kubelet plugin (prepare failures) and the
controller (grants, switches). Writes `events.k8s.io/v1`-equivalent core/v1 Events
through `kubernetes.aio`; a failure to record an Event is logged, never raised (an API
server outage must not fail a prepare or a grant).
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from typing import Any

log = logging.getLogger("timeslice.events")


class EventRecorder:
    """`core_api`: a `kubernetes.aio.client.CoreV1Api`; `component`: the reporting component."""

    def __init__(self, core_api: Any, component: str, host: str = "") -> None:
        self._api = core_api
        self._component = component
        self._host = host

    async def claim_event(self, namespace: str, name: str, uid: str, reason: str, message: str,
                          warning: bool = False) -> None:
        now = dt.datetime.now(dt.timezone.utc)
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:12]}", "namespace": namespace},
            "involvedObject": {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "name": name,
                               "namespace": namespace, "uid": uid},
            "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
            "source": {"component": self._component, "host": self._host},
            "reportingComponent": self._component, "reportingInstance": self._host or self._component,
            "firstTimestamp": now.isoformat(), "lastTimestamp": now.isoformat(), "count": 1,
        }
        try:
            await self._api.create_namespaced_event(namespace, body)
        except Exception as err:
            log.warning("could not record event claim=%s/%s reason=%s: %s", namespace, name, reason, err)
