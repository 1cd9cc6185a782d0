"""The plugin's checkpoint of prepared claims, so Prepare is idempotent across restarts.

Owned by the kubelet plugin's claim preparer. After a plugin restart or a node reboot
(the CDI dir is usually tmpfs) the preparer recreates every recorded CDI spec. File
format (JSON; written to a temp file, fsynced, renamed):

    {"apiVersion": "timeslice.dev/kubelet-plugin-checkpoint/v1",
     "checksum": "<sha256 of the canonical JSON of claims>",
     "claims": {"<uid>": {"namespace", "name", "devices": [{"request_names", "pool_name",
                "device_name", "cdi_device_ids", "physical_gpu", "device_nodes"}],
                "shared_device_nodes": [...], "admin_access": bool}}}

Compatible changes: new optional keys in a claim or device. Anything else needs a new
apiVersion. A file whose checksum does not match is not trusted: it is renamed aside
and the plugin starts empty (the kubelet prepares again when it needs to).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from timeslice.driver.atomic import write_atomic

log = logging.getLogger("timeslice.kubelet_plugin")
API_VERSION = "timeslice.dev/kubelet-plugin-checkpoint/v1"


def _checksum(claims: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Checkpoint:
    """Prepared claims by UID (`claims`), persisted at `path` on every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, dict[str, Any]] = {}
        if path.exists():
            self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            if data.get("apiVersion") != API_VERSION:
                raise ValueError(f"apiVersion {data.get('apiVersion')!r}, want {API_VERSION}")
            if data.get("checksum") != _checksum(data["claims"]):
                raise ValueError("checksum mismatch")
            self.claims = data["claims"]
        except (ValueError, KeyError, TypeError) as err:
            aside = self.path.with_suffix(".corrupt")
            os.replace(self.path, aside)
            log.error("checkpoint unusable, moved to %s, starting empty: %s", aside, err)

    def put(self, uid: str, record: dict[str, Any]) -> None:
        self.claims[uid] = record
        self.save()

    def pop(self, uid: str, save: bool = True) -> dict[str, Any] | None:
        """Forget `uid`'s record and persist (`save` False: the caller calls `save()` once for
        many: each write serializes every claim and fsyncs, on the event loop)."""
        record = self.claims.pop(uid, None)
        if record is not None and save:
            self.save()
        return record

    def save(self) -> None:
        data = {"apiVersion": API_VERSION, "checksum": _checksum(self.claims), "claims": self.claims}
        write_atomic(self.path, json.dumps(data, sort_keys=True).encode())
