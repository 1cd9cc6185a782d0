"""Reflector: one kind of API object kept in memory by list + watch (`kubernetes.aio`).

Owned by `ClusterState`, one per kind (ResourceClaims, Pods, ResourceSlices). Runs as
one asyncio task until cancelled; errors are logged and retried, never raised.

The stream itself is the library's `kubernetes.aio.watch.Watch`. Not
`kubernetes.informer.SharedInformer`: it runs the synchronous client on a thread of its
own, calls handlers on that thread, retries at a fixed 5 s and turns every object into a
model, while the controller is one asyncio loop (DESIGN.md) that needs a few fields of
each object. What this module adds around `Watch`:

- list in pages (`limit`/`continue`), then watch from the list's resourceVersion with
  bookmarks; a watch ends after `watch_seconds` (server-side timeout) and resumes from
  the last resourceVersion seen;
- 410 Gone (resourceVersion compacted away, expired continue token) -> list again at
  once; a second 410 in a row waits like any error;
- every `resync_seconds` a full list replaces the cache (a missed event heals);
- other errors (connection refused, 5xx, 403, a malformed line) -> exponential backoff
  with jitter (`Backoff`), reset by the next list or watch that completes;
- `trim(obj)` keeps what the caller needs of an object, or None to leave it out (a
  filter the API server cannot apply, and the memory bound: only trimmed copies stay).

Objects are API JSON dicts keyed by `metadata.uid`. `on_change()` runs after every
list or event that changed the cache; it must not block (ClusterState only sets a flag).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.aio.client.exceptions import ApiException
from kubernetes.aio.watch import Watch
from timeslice.driver.backoff import Backoff

log = logging.getLogger("timeslice.controller.reflector")

Obj = dict[str, Any]
Trim = Callable[[Obj], "Obj | None"]
GONE = 410
# Client-side bound on one HTTP call beyond the server-side watch timeout (seconds).
REQUEST_SLACK_SECONDS = 30.0
# A watch's server-side timeout (seconds). A connection dropped without a FIN or RST (a NAT or
# firewall forgetting it) shows nothing to the client until its own bound, this + the slack: with
# 240 s a controller missed every change for 268 s (issue 24); now at most 90 s. A watch resumes
# from its last resourceVersion, so a shorter one costs one request a minute per kind.
WATCH_SECONDS = 60


DEFAULT_BACKOFF = Backoff()


@dataclass
class ReflectorStats:
    lists: int = 0
    watches: int = 0
    events: int = 0
    errors: int = 0
    gone: int = 0


class Reflector:
    """`list_method` is a bound list method of a `kubernetes.aio` API, e.g.
    `CoreV1Api(api).list_pod_for_all_namespaces`; its `_without_preload_content` twin
    is used so that objects stay JSON dicts."""

    def __init__(self, kind: str, list_method: Callable[..., Any], trim: Trim, on_change: Callable[[], None], *,
                 field_selector: str | None = None, label_selector: str | None = None,
                 resync_seconds: float = 300.0, watch_seconds: int = WATCH_SECONDS, page_size: int = 500,
                 backoff: Backoff = DEFAULT_BACKOFF) -> None:
        self.kind = kind
        self._list_method = list_method
        self._raw_list = getattr(list_method.__self__, f"{list_method.__name__}_without_preload_content")
        self._trim = trim
        self._on_change = on_change
        self._selector = {k: v for k, v in (("field_selector", field_selector), ("label_selector", label_selector))
                          if v}
        self._resync_seconds = resync_seconds
        self._watch_seconds = watch_seconds
        self._page_size = page_size
        self._backoff = backoff
        self.objects: dict[str, Obj] = {}
        self.synced = asyncio.Event()
        self.stats = ReflectorStats()

    async def run(self) -> None:
        """List and watch until cancelled."""
        rv: str | None = None
        next_resync = 0.0
        attempt = 0
        while True:
            try:
                if rv is None or time.monotonic() >= next_resync:
                    rv = await self._list()
                    next_resync = time.monotonic() + self._resync_seconds
                    attempt = 0
                rv = await self._watch(rv, next_resync)
                attempt = 0
            except ApiException as err:
                if err.status == GONE:
                    self.stats.gone += 1
                    log.info("relist kind=%s reason=gone resource_version=%s", self.kind, rv)
                    rv = None
                    if attempt:
                        await asyncio.sleep(self._backoff.delay(attempt - 1))
                    attempt += 1
                else:
                    attempt = await self._failed(err, attempt)
            except Exception as err:  # connection refused, reset, a malformed line, ...
                attempt = await self._failed(err, attempt)

    async def _failed(self, err: BaseException, attempt: int) -> int:
        self.stats.errors += 1
        delay = self._backoff.delay(attempt)
        log.warning("list/watch failed kind=%s attempt=%d retry_in=%.2fs error=%s", self.kind, attempt + 1, delay,
                    describe_error(err))
        await asyncio.sleep(delay)
        return attempt + 1

    async def _list(self) -> str:
        """Replace the cache with a full list; returns its resourceVersion."""
        items: list[Obj] = []
        cont: str | None = None
        while True:
            resp = await self._raw_list(limit=self._page_size, _continue=cont, **self._selector,
                                        _request_timeout=REQUEST_SLACK_SECONDS)
            try:
                data = await resp.read()
                if resp.status >= 400:
                    raise ApiException(status=resp.status, reason=resp.reason, body=data.decode(errors="replace"))
            finally:
                resp.release()
            body = json.loads(data)
            items.extend(body.get("items") or ())
            meta = body.get("metadata") or {}
            cont = meta.get("continue")
            if not cont:
                break
        fresh = {}
        for obj in items:
            kept = self._trim(obj)
            uid = (obj.get("metadata") or {}).get("uid")
            if kept is not None and uid:
                fresh[uid] = kept
        changed = fresh != self.objects or not self.synced.is_set()
        self.objects = fresh
        self.stats.lists += 1
        log.debug("listed kind=%s items=%d kept=%d resource_version=%s", self.kind, len(items), len(fresh),
                  meta.get("resourceVersion"))
        self.synced.set()
        if changed:
            self._on_change()
        return str(meta.get("resourceVersion") or "0")

    async def _watch(self, rv: str, until: float) -> str:
        """Apply events from `rv` until the server ends the watch (at most `until`, the
        next resync); returns the last resourceVersion seen."""
        timeout = max(1, min(self._watch_seconds, int(until - time.monotonic())))
        watch = Watch(return_type="object")
        self.stats.watches += 1
        async with watch:
            stream = watch.stream(self._list_method, resource_version=rv, allow_watch_bookmarks=True,
                                  timeout_seconds=timeout, **self._selector,
                                  _request_timeout=timeout + REQUEST_SLACK_SECONDS)
            async for event in stream:
                kind, obj = event.get("type"), event.get("raw_object") or {}
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.stats.events += 1
                    if self._apply(kind, obj):
                        self._on_change()
        return str(watch.resource_version or rv)

    def _apply(self, kind: str, obj: Obj) -> bool:
        uid = (obj.get("metadata") or {}).get("uid")
        if not uid:
            return False
        kept = None if kind == "DELETED" else self._trim(obj)
        if kept is None:
            return self.objects.pop(uid, None) is not None
        if self.objects.get(uid) == kept:
            return False
        self.objects[uid] = kept
        return True


def describe_error(err: BaseException) -> str:
    if isinstance(err, ApiException):
        return f"ApiException status={err.status} reason={err.reason}"
    return f"{type(err).__name__}: {err}"
