"""EpochFloors: fencing epochs that never repeat across orchestrator restarts (standalone mode).

Owned by the orchestrator (`timeslice orchestrator --state-file`). A group's epochs are used
in blocks of `BLOCK`: before the first epoch of a new block is granted, the block's end is
written to the state file (`write_atomic`), so a restarted orchestrator starts every group
at the persisted end, past every epoch the previous run granted, at the cost of one write
per `BLOCK` grants (none on the hand-off path otherwise). File format (JSON):

    {"apiVersion": "timeslice.dev/orchestrator-state/v1", "epochs": {"<group>": <end of block>}}

In a cluster the controller adopts epochs from claim status instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from timeslice.driver.atomic import write_atomic

log = logging.getLogger("timeslice.orchestrator")
API_VERSION = "timeslice.dev/orchestrator-state/v1"
BLOCK = 1000


class EpochFloors:
    """`path`: the state file (None: in memory only, epochs restart at 0)."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._ends: dict[str, int] = {}
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                if data.get("apiVersion") != API_VERSION:
                    raise ValueError(f"apiVersion {data.get('apiVersion')!r}, want {API_VERSION}")
                self._ends = {str(g): int(e) for g, e in data["epochs"].items()}
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"orchestrator state file {path} is unreadable ({err}): move it away to start "
                                 "afresh (fencing epochs may then repeat those of the last run)") from None

    def start(self, group_id: str) -> int:
        """The epoch a group starts from: the end of its last persisted block (0: none)."""
        return self._ends.get(group_id, 0)

    def reserve(self, group_id: str, epoch: int) -> None:
        """Before `epoch` is granted: persist a new block when it passes the current one.
        Raises OSError (the grant must not happen: its epoch could repeat after a restart)."""
        if self._path is None or epoch <= self._ends.get(group_id, 0):
            return
        self._ends[group_id] = epoch + BLOCK
        write_atomic(self._path, json.dumps({"apiVersion": API_VERSION, "epochs": self._ends}).encode())
        log.debug("epoch block reserved group=%s up_to=%d", group_id, self._ends[group_id])
