"""Kubernetes API access shared by the components: the API client (`api_client`) and
API errors -> the driver's exception tree (`api_error`, `errors.py`).

Owned by the driver package; used by the kubelet plugin and the controller (their API
client), the slice publisher and the TokenReview check (`tokenreview.py`). Needs the
`kubernetes` extra.
"""

from __future__ import annotations

import contextlib
import json

from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config
from kubernetes.aio.client.exceptions import ApiException
from timeslice.driver.errors import KubernetesApiError, KubernetesApiRejected

# HTTP statuses after which the same request can succeed later (the rest are rejections).
RETRYABLE_STATUS = {0, 408, 409, 410, 429}


async def api_client() -> k8s.ApiClient:
    """A `kubernetes.aio` API client: in a pod its ServiceAccount (in-cluster config), else
    $KUBECONFIG or ~/.kube/config. The caller closes it. Raises
    `kubernetes.config.ConfigException` when neither is there."""
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        await k8s_config.load_kube_config()
    return k8s.ApiClient()


def api_error(err: Exception, what: str) -> KubernetesApiError:
    """Translate a `kubernetes.aio` or connection error, keeping the API server's message:
    `KubernetesApiError` (retryable: no connection, 408/409/410/429, 5xx) or
    `KubernetesApiRejected` (any other HTTP status, e.g. 403 forbidden by RBAC)."""
    if isinstance(err, ApiException):
        status = int(err.status or 0)
        message = err.reason or ""
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            message = json.loads(err.body or "").get("message") or message
        cls = KubernetesApiError if status in RETRYABLE_STATUS or status >= 500 else KubernetesApiRejected
        return cls(f"{what}: HTTP {status}: {message}", status)
    return KubernetesApiError(f"{what}: {type(err).__name__}: {err}", 0)
