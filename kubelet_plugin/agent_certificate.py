"""CertificatePublisher: the node agent's TLS certificate, published on the plugin's own pod.

Owned by the kubelet plugin's wiring (`app.py`, with `--agent-tls`): after the agent
serves TLS with a fresh self-signed certificate (`agent/tls.py`), this puts the
certificate (PEM) on the plugin's own pod as the annotation
`timeslice.dev/agent-certificate` (`names.AGENT_CERTIFICATE_ANNOTATION`), where the
controller reads it with the pod's IP (`controller/node_agents.py`) and pins it. The pod
is named by the downward API (env `POD_NAME`, `POD_NAMESPACE`); the call is a JSON merge
patch (RFC 7386, `application/merge-patch+json`) of `metadata.annotations` through
`kubernetes.aio` `CoreV1Api.patch_namespaced_pod`, so other annotations stay; RBAC: `patch`
on `pods` in the plugin's namespace (`manifests/base/rbac-kubelet-plugin.yaml`).

A failed patch (API server away, 5xx, or a rejection such as 403 without that RBAC, 404
when the pod name is wrong) is logged with the API server's message and retried with
exponential backoff until it succeeds or `stop()`: the agent serves meanwhile, and
callers that pinned nothing or an older certificate fail their TLS handshake with a clear
error until the new one is published. Every `recheck_seconds` after that the same patch is
sent again, so an annotation someone removed or edited comes back (an unchanged pod is
not written by the API server).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from kubernetes.aio.client.exceptions import ApiException
from timeslice.driver.backoff import Backoff
from timeslice.driver.certificates import fingerprint
from timeslice.driver.errors import KubernetesApiRejected
from timeslice.driver.kubeapi import api_error
from timeslice.driver.names import AGENT_CERTIFICATE_ANNOTATION
from timeslice.driver.tasks import cancel_and_wait

log = logging.getLogger("timeslice.kubelet_plugin.agent_certificate")

MERGE_PATCH = "application/merge-patch+json"
# Bound on one patch call, seconds.
DEFAULT_TIMEOUT_SECONDS = 10.0
DEFAULT_BACKOFF = Backoff(initial=1.0, maximum=60.0, overshoot=False)
# Between re-assertions of a published annotation, seconds.
DEFAULT_RECHECK_SECONDS = 300.0
_RBAC_HINT = ("the plugin's ServiceAccount needs 'patch' on pods in its namespace (Role timeslice-kubelet-plugin "
              "in manifests/base/rbac-kubelet-plugin.yaml)")


class CertificatePublisher:
    """Publishes `certificate` (one PEM certificate) on pod `namespace`/`name` with
    `core_api` (kubernetes.aio `CoreV1Api`, or anything with its `patch_namespaced_pod`).
    `start()` runs the publishing task (it re-sends the patch every `recheck_seconds`);
    `published` is set once the patch succeeded;
    `attempts` counts patch calls. Times in seconds."""

    def __init__(self, core_api: Any, namespace: str, name: str, certificate: str,
                 backoff: Backoff = DEFAULT_BACKOFF, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                 recheck_seconds: float = DEFAULT_RECHECK_SECONDS) -> None:
        self._api = core_api
        self.namespace = namespace
        self.name = name
        self.certificate = certificate
        self.fingerprint = fingerprint(certificate)  # ValueError for a malformed certificate: a bug
        self.backoff = backoff
        self._timeout = timeout
        self._recheck = recheck_seconds
        self.published = asyncio.Event()
        self.attempts = 0
        self.last_error: Exception | None = None
        self._task: asyncio.Task[None] | None = None

    def body(self) -> dict[str, Any]:
        """The merge patch: our annotation only."""
        return {"metadata": {"annotations": {AGENT_CERTIFICATE_ANNOTATION: self.certificate}}}

    async def publish_once(self) -> None:
        """One patch. Raises `KubernetesApiError` (retryable: no connection, timeout, 5xx) or
        `KubernetesApiRejected` (e.g. 403 without RBAC, 404 no such pod)."""
        self.attempts += 1
        try:
            await asyncio.wait_for(self._api.patch_namespaced_pod(self.name, self.namespace, self.body(),
                                                                  _content_type=MERGE_PATCH), self._timeout)
        except (ApiException, aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            raise api_error(err, f"annotating pod {self.namespace}/{self.name} with the agent certificate") from err

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The background task (None before `start()`), for liveness checks."""
        return self._task

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="agent-certificate-publisher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self.publish_once()
            except Exception as err:  # every failure is retried; none ends publishing
                failures += 1
                self.last_error = err
                delay = self.backoff.delay(failures - 1)
                hint = f" ({_RBAC_HINT})" if isinstance(err, KubernetesApiRejected) and err.status == 403 else ""
                log.log(logging.ERROR if isinstance(err, KubernetesApiRejected) else logging.WARNING,
                        "agent certificate not published pod=%s/%s failures=%d retry_in=%.1fs: %s%s "
                        "(the agent serves TLS meanwhile; the controller cannot pin it yet)",
                        self.namespace, self.name, failures, delay, err, hint)
                await asyncio.sleep(delay)
                continue
            if not self.published.is_set():
                log.info("agent certificate published pod=%s/%s annotation=%s certificate=%s attempts=%d",
                         self.namespace, self.name, AGENT_CERTIFICATE_ANNOTATION, self.fingerprint, self.attempts)
                self.published.set()
            failures = 0
            await asyncio.sleep(self._recheck)
