"""Memory headroom: the GPU memory residency `auto` keeps free, as a percent or a quantity.

Owned by the driver package; used by `TimeSliceConfig.memoryHeadroom` and the
orchestrator's `GroupSpec.memory_headroom`. Quantity suffixes as in Kubernetes
resource quantities (decimal k/M/G/T, binary Ki/Mi/Gi/Ti), parsed by `timeslice.quantity`.
"""

from __future__ import annotations

import re

from timeslice.quantity import bare_number, parse_bytes

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_headroom(value: str | int | float) -> tuple[float, int]:
    """`"10%"` -> (0.10, 0); `"8Gi"`, `"500M"`, `"1073741824B"` -> (0, bytes); 0 -> (0, 0).
    Units are the Kubernetes quantity suffixes (decimal k/M/G/T, binary Ki/Mi/Gi/Ti) and B.
    A bare number other than 0 is refused: `memory_headroom: 10` meant 10 bytes where its
    writer meant 10% (issue 25). Raises ValueError."""
    if bare_number(value):
        raise ValueError(f"memory headroom {value!r}: a bare number is ambiguous; give a percent of device memory "
                         f"(\"{value}%\") or a quantity with its unit (\"{value}Gi\", \"{value}B\")")
    if isinstance(value, str) and (m := _PERCENT.match(value)):
        number = float(m.group(1))
        if number > 90:
            raise ValueError(f"memory headroom {value!r}: at most 90%")
        return number / 100.0, 0
    try:
        return 0.0, parse_bytes(value, "memory headroom")
    except ValueError as err:
        raise ValueError(f"{err}; or a percent of device memory (\"10%\")") from None
