"""Memory headroom: the GPU memory residency `auto` keeps free, as a percent or a quantity.

Owned by the driver package; used by `TimeSliceConfig.memoryHeadroom` and the
orchestrator's `GroupSpec.memory_headroom`. Quantity suffixes as in Kubernetes
resource quantities (decimal k/M/G/T, binary Ki/Mi/Gi/Ti).
"""

from __future__ import annotations

import re

_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|k|[MGT]|[KMGT]i|B)?\s*$")
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_headroom(value: str | int | float) -> tuple[float, int]:
    """`"10%"` -> (0.10, 0); `"8Gi"`, `"500M"`, `1073741824` -> (0, bytes). Units are the
    Kubernetes quantity suffixes (decimal k/M/G/T, binary Ki/Mi/Gi/Ti). Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"memory headroom {value!r}: not a quantity")
    if isinstance(value, int | float):
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"memory headroom {value!r}: a number of bytes >= 0")
        return 0.0, int(value)
    m = _QUANTITY.match(value)
    if m is None:
        raise ValueError(f"memory headroom {value!r}: use a percent of device memory (\"10%\") or a quantity "
                         "(\"8Gi\", \"500M\", bytes)")
    number, unit = float(m.group(1)), m.group(2) or ""
    if unit == "%":
        if number > 90:
            raise ValueError(f"memory headroom {value!r}: at most 90%")
        return number / 100.0, 0
    unit = unit[0].upper() + unit[1:] if unit not in ("", "B") else unit
    return 0.0, int(number * _UNITS[unit])


