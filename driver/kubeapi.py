"""Kubernetes API errors -> the driver's exception tree (`errors.py`).

Owned by the driver package; used by the kubelet plugin's slice publisher and by the
TokenReview check (`tokenreview.py`). Needs the `kubernetes` extra.
"""

from __future__ import annotations

import contextlib
import json

from kubernetes.aio.client.exceptions import ApiException
from timeslice.driver.errors import KubernetesApiError, KubernetesApiRejected

# HTTP statuses after which the same request can succeed later (the rest are rejections).
RETRYABLE_STATUS = {0, 408, 409, 410, 429}


def api_error(err: Exception, what: str) -> KubernetesApiError:
    """Translate a `kubernetes.aio` or connection error, keeping the API server's message:
    `KubernetesApiError` (retryable: no connection, 408/409/410/429, 5xx) or
    `KubernetesApiRejected` (any other HTTP status, e.g. 403 forbidden by RBAC)."""
    if isinstance(err, ApiException):
        status = int(err.status or 0)
        message = err.reason or ""
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            message = json.loads(err.body).get("message") or message
        cls = KubernetesApiError if status in RETRYABLE_STATUS or status >= 500 else KubernetesApiRejected
        return cls(f"{what}: HTTP {status}: {message}", status)
    return KubernetesApiError(f"{what}: {type(err).__name__}: {err}", 0)
