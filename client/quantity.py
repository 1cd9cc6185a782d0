"""Byte quantities as Kubernetes writes them: `"57Gi"`, `"500M"`, `"1.5G"`, `1073741824`.

Suffixes as in Kubernetes resource quantities (k8s.io/apimachinery `resource.Quantity`):
decimal k/M/G/T (also K) and binary Ki/Mi/Gi/Ti; no suffix or `B` means bytes. One parser
for the client's `memory=` / `$TIMESLICE_MEMORY` and the driver's memory headroom.
"""

from __future__ import annotations

import re

_BARE = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")
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


def bare_number(value: object) -> bool:
    """Whether `value` is a number written without a unit (`"57"`, `57`, `2.5`), other than 0:
    where bytes and a larger unit both read plausibly (`TIMESLICE_MEMORY=57` was 57 bytes,
    `memory_headroom: 10` 10 bytes), so callers refuse it and ask for the unit."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value != 0
    return isinstance(value, str) and bool(_BARE.match(value)) and float(value) != 0
