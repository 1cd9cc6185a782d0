"""Byte quantities as Kubernetes writes them: `"57Gi"`, `"500M"`, `"1.5G"`, `1073741824`.

Suffixes as in Kubernetes resource quantities (k8s.io/apimachinery `resource.Quantity`):
decimal k/M/G/T (also K) and binary Ki/Mi/Gi/Ti; no suffix or `B` means bytes. One parser
for the client's `memory=` / `$TIMESLICE_MEMORY` and the driver's memory headroom.
"""

from __future__ import annotations

import re

_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|K|[MGT]|[KMGT]i|B)?\s*$")
_UNITS = {"": 1, "B": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_bytes(value: str | int | float, what: str = "memory") -> int:
    """Bytes of `value`: an int or float number of bytes, or a quantity string. Raises
    ValueError naming `what` for a negative, non-finite or malformed value."""
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r}: not a quantity")
    if isinstance(value, int | float):
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{what} {value!r}: a number of bytes >= 0")
        return int(value)
    m = _QUANTITY.match(value)
    if m is None:
        raise ValueError(f"{what} {value!r}: use a quantity (\"57Gi\", \"500M\", bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])
