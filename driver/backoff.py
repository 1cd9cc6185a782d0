"""`Backoff`: how long to wait before retrying a failed call to the API server.

Owned by the driver package; used by the controller (reflectors, claim status writes) and
the kubelet plugin (slice publisher, agent certificate publisher).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delay in seconds before retry `attempt` (0, 1, ...): initial * factor**attempt, at
    most `maximum`, times a random factor in [1 - jitter, 1 + jitter] so that replicas do
    not retry in step; with `overshoot=False` in [1 - jitter, 1], never above `maximum`."""

    initial: float = 0.5
    maximum: float = 30.0
    factor: float = 2.0
    jitter: float = 0.2
    overshoot: bool = True

    def delay(self, attempt: int) -> float:
        base = min(self.maximum, self.initial * self.factor ** min(max(attempt, 0), 64))
        return base * random.uniform(1 - self.jitter, 1 + self.jitter if self.overshoot else 1.0)
