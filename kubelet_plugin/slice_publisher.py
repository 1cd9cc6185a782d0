"""SlicePublisher: keeps this node's ResourceSlices equal to the devices it was given.

Owned by the kubelet plugin; its entry point creates one per node, calls `publish()`
at start-up (and again whenever the devices change) and `stop()` at shutdown.

One asyncio task does all the work, in a loop:

1. list the slices of our driver on this node (field selectors `spec.driver`,
   `spec.nodeName`); when they already hold the wanted devices with one generation
   and the right slice count, adopt them as they are;
2. otherwise write the whole pool again with `generation` = highest seen + 1: replace
   the slices that exist, create the missing ones, delete the extra ones;
3. watch the same selection from the list's resourceVersion until someone else
   deletes or changes one of our slices (the kubelet deletes all of a node's slices
   when it starts), a slice we did not write appears, `publish()` brings new devices,
   or `resync_seconds` pass; then go to 1.

Our own writes are told apart from others' by the resourceVersion each write returned.
API errors never end the loop: they are logged and retried with exponential backoff
(`KubernetesApiRejected`, e.g. a 422 from server-side validation, is logged as an error:
it needs a fix, not patience). When the API server drops fields it does not serve
(a feature gate is off: e.g. `allowMultipleAllocations` without DRAConsumableCapacity),
the loss is logged once and the stored form is accepted, so the loop does not rewrite
the pool for ever.

The Kubernetes API sits behind `SliceStore` (the seam): `ApiSliceStore` talks to a
real API server through `kubernetes.aio`; tests may put an in-memory store there.
`stop()` leaves the slices in place: the kubelet removes a driver's slices 30 s after
its plugin disconnects, and a restarted plugin adopts them; `stop(delete_slices=True)`
removes them at once (uninstall, tests).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Sequence
from decimal import Decimal
from typing import Any, Protocol

import aiohttp
from kubernetes.aio import watch as kwatch
from kubernetes.aio.client import ApiClient, CoreV1Api, ResourceV1Api
from kubernetes.aio.client.exceptions import ApiException
from kubernetes.utils.quantity import parse_quantity
from timeslice.driver.backoff import Backoff
from timeslice.driver.errors import KubernetesApiError, KubernetesApiRejected
from timeslice.driver.kubeapi import api_error
from timeslice.driver.names import DRIVER_NAME
from timeslice.driver.tasks import cancel_and_wait
from timeslice.kubelet_plugin.resourceslices import (
    MAX_DEVICES_PER_SLICE,
    Device,
    Slice,
    build_slices,
    check_devices,
)

log = logging.getLogger("timeslice.kubelet_plugin.slices")


class SliceStore(Protocol):
    """The API calls the publisher makes; objects are dicts in API JSON form.

    Every method raises `KubernetesApiError` (retryable) or `KubernetesApiRejected`.
    """

    async def node_uid(self, node: str) -> str: ...

    async def list(self, driver: str, node: str) -> tuple[list[Slice], str]:
        """The slices of `driver` on `node`, and the list's resourceVersion."""
        ...

    async def create(self, body: Slice) -> Slice: ...

    async def replace(self, body: Slice) -> Slice:
        """Update the slice `body.metadata.name`; `metadata.resourceVersion` is the precondition."""
        ...

    async def delete(self, name: str) -> None:
        """Delete one slice; one that is already gone is not an error."""
        ...

    def watch(self, driver: str, node: str, resource_version: str,
              timeout_seconds: float) -> AsyncIterator[tuple[str, Slice]]:
        """(event type, object) from `resource_version` on; ends after `timeout_seconds`."""
        ...


_TRANSPORT_ERRORS = (ApiException, aiohttp.ClientError, asyncio.TimeoutError, OSError)


class ApiSliceStore:
    """`SliceStore` over a `kubernetes.aio` ApiClient (not owned: the caller closes it)."""

    def __init__(self, api_client: ApiClient, request_timeout: float = 30.0):
        self._client = api_client
        self._resource = ResourceV1Api(api_client)
        self._core = CoreV1Api(api_client)
        self._timeout = request_timeout

    def _dict(self, model: Any) -> Slice:
        return self._client.sanitize_for_serialization(model)  # type: ignore[no-any-return]

    @staticmethod
    def _selector(driver: str, node: str) -> str:
        return f"spec.driver={driver},spec.nodeName={node}"

    async def node_uid(self, node: str) -> str:
        try:
            return str((await self._core.read_node(node, _request_timeout=self._timeout)).metadata.uid)
        except _TRANSPORT_ERRORS as err:
            raise api_error(err, f"get node {node}") from err

    async def list(self, driver: str, node: str) -> tuple[list[Slice], str]:
        try:
            got = await self._resource.list_resource_slice(field_selector=self._selector(driver, node),
                                                           _request_timeout=self._timeout)
        except _TRANSPORT_ERRORS as err:
            raise api_error(err, "list resourceslices") from err
        return [self._dict(s) for s in got.items], str(got.metadata.resource_version)

    async def create(self, body: Slice) -> Slice:
        try:
            return self._dict(await self._resource.create_resource_slice(body, _request_timeout=self._timeout))  # type: ignore[arg-type]
        except _TRANSPORT_ERRORS as err:
            raise api_error(err, f"create resourceslice {body['metadata']['name']}") from err

    async def replace(self, body: Slice) -> Slice:
        name = body["metadata"]["name"]
        try:
            return self._dict(await self._resource.replace_resource_slice(name, body,  # type: ignore[arg-type]
                                                                          _request_timeout=self._timeout))
        except _TRANSPORT_ERRORS as err:
            raise api_error(err, f"update resourceslice {name}") from err

    async def delete(self, name: str) -> None:
        try:
            await self._resource.delete_resource_slice(name, _request_timeout=self._timeout)
        except ApiException as err:
            if err.status != 404:
                raise api_error(err, f"delete resourceslice {name}") from err
        except _TRANSPORT_ERRORS as err:
            raise api_error(err, f"delete resourceslice {name}") from err

    async def watch(self, driver: str, node: str, resource_version: str,
                    timeout_seconds: float) -> AsyncIterator[tuple[str, Slice]]:
        try:
            async with kwatch.Watch() as w:
                stream = w.stream(self._resource.list_resource_slice, field_selector=self._selector(driver, node),
                                  resource_version=resource_version, allow_watch_bookmarks=True,
                                  timeout_seconds=max(1, int(timeout_seconds)),
                                  _request_timeout=timeout_seconds + self._timeout)
                async for event in stream:
                    yield event["type"], event["raw_object"]
        except _TRANSPORT_ERRORS as err:
            raise api_error(err, "watch resourceslices") from err


# Retries of a failed publish: 0.5 s doubling to 30 s, jittered down by up to 20 %.
DEFAULT_BACKOFF = Backoff(overshoot=False)


_QUANTITY_KEYS = {"value", "default", "min", "max", "step"}


def _canonical(value: Any, key: str = "") -> Any:
    """A comparable form of spec content: None and empty values dropped, quantities as
    numbers ("1Mi" == "1048576"), so the API server's normal form compares equal."""
    if isinstance(value, dict):
        out = {k: _canonical(v, k) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [_canonical(v, "validValues" if key == "validValues" else "") for v in value]
    if isinstance(value, str) and key in _QUANTITY_KEYS | {"validValues"}:
        try:
            return Decimal(parse_quantity(value))
        except ValueError:
            return value
    return value


def _differences(sent: Any, stored: Any, path: str = "") -> set[str]:
    """Paths where `stored` lacks or changed what was `sent`; list indices shown as `[*]`."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        out: set[str] = set()
        for k, v in sent.items():
            out |= _differences(v, stored[k], f"{path}.{k}" if path else k) if k in stored else {
                f"{path}.{k}" if path else k}
        return out
    if isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        return set().union(*(_differences(a, b, f"{path}[*]") for a, b in zip(sent, stored)))
    return set() if sent == stored else {path}


def _content(body: Slice) -> Any:
    """What must match for a stored slice to count as ours and current: spec and owners."""
    return _canonical({"spec": body.get("spec"),
                       "ownerReferences": (body.get("metadata") or {}).get("ownerReferences")})


def _meta(body: Slice, key: str) -> str:
    return str((body.get("metadata") or {}).get(key) or "")


class SlicePublisher:
    """Publishes one node's devices as the ResourceSlices of pool `<node>` and keeps them so.

    `node_uid` skips the Node lookup (the owner reference needs it); by default the uid is
    read from the API server before each write, so a re-created Node is followed.
    """

    def __init__(self, store: SliceStore, node: str, *, driver: str = DRIVER_NAME,
                 node_uid: str | None = None, resync_seconds: float = 300.0,
                 backoff: Backoff | None = None, max_devices_per_slice: int = MAX_DEVICES_PER_SLICE):
        self.store, self.node, self.driver = store, node, driver
        self.resync_seconds = resync_seconds
        self.backoff = backoff or DEFAULT_BACKOFF
        self.max_devices = max_devices_per_slice
        self._fixed_uid = node_uid
        self._desired: list[Device] | None = None
        self._desired_version = 0
        self._applied_version = 0
        self._generation = 0
        self._known: dict[str, str] = {}      # slice name -> resourceVersion we wrote or adopted
        self._written: dict[str, tuple[Any, Any]] = {}  # name -> (content sent, content stored)
        self._slices: list[Slice] = []
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.last_error: Exception | None = None
        self.failures = 0

    # -- public API --------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """The pool generation last written or adopted (0 before the first)."""
        return self._generation

    @property
    def slices(self) -> list[Slice]:
        """The slices as the API server returned them at the last successful sync."""
        return copy.deepcopy(self._slices)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The background task (None before `start()`), for liveness checks."""
        return self._task

    def start(self) -> None:
        """Start the background loop (idempotent; `publish` starts it too)."""
        if self._stopped:
            raise RuntimeError("SlicePublisher was stopped")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"slice-publisher-{self.node}")

    async def publish(self, devices: Sequence[Device], *, wait: bool = True) -> None:
        """Make the node's pool hold exactly `devices` (in this order); with `wait`, return once
        the API server holds them. Raises ValueError at once for devices the API server
        would reject; API errors are retried in the background, never raised here."""
        devices = copy.deepcopy(list(devices))
        check_devices(devices)
        self.start()
        if devices != self._desired:
            self._desired = devices
            self._desired_version += 1
            self._wake.set()
        if wait:
            await self.wait_synced()

    async def wait_synced(self) -> None:
        """Wait until the API server holds the devices of the latest `publish()`."""
        version = self._desired_version
        async with self._changed:
            await self._changed.wait_for(lambda: self._applied_version >= version or self._stopped)
        if self._applied_version < version:
            raise RuntimeError("SlicePublisher stopped before the slices were published")

    async def stop(self, *, delete_slices: bool = False) -> None:
        """Cancel the loop and its watch; with `delete_slices`, also delete the node's slices
        of this driver (once; an API error is raised)."""
        self._stopped = True
        await cancel_and_wait(self._task)
        async with self._changed:
            self._changed.notify_all()
        if delete_slices:
            items, _ = await self.store.list(self.driver, self.node)
            for item in items:
                await self.store.delete(_meta(item, "name"))
            log.info("deleted slices=%d node=%s driver=%s", len(items), self.node, self.driver)

    async def __aenter__(self) -> SlicePublisher:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            if self._desired is None:
                await self._wake.wait()
                continue
            version, devices = self._desired_version, self._desired
            try:
                list_rv = await self._sync(devices)
                await self._applied(version)
                self.failures, self.last_error = 0, None
                reason = await self._watch_until_dirty(list_rv)
                log.info("resync node=%s reason=%s", self.node, reason)
            except asyncio.CancelledError:
                raise
            except KubernetesApiError as err:
                if err.status == 410:  # the watch's resourceVersion expired: list again now
                    log.info("resync node=%s reason=expired-resource-version", self.node)
                    continue
                await self._failed(err, logging.ERROR if isinstance(err, KubernetesApiRejected) else logging.WARNING)
            except Exception as err:  # a bug must not end publishing; say so loudly
                log.exception("slice publisher node=%s unexpected error", self.node)
                await self._failed(err, None)

    async def _failed(self, err: Exception, level: int | None) -> None:
        self.failures += 1
        self.last_error = err
        delay = self.backoff.delay(self.failures - 1)
        if level is not None:
            log.log(level, "publishing slices failed node=%s failures=%d retry_in=%.1fs: %s",
                    self.node, self.failures, delay, err)
        await asyncio.sleep(delay)

    async def _applied(self, version: int) -> None:
        async with self._changed:
            self._applied_version = max(self._applied_version, version)
            self._changed.notify_all()

    def _matches(self, name: str, stored: Slice, want: Slice) -> bool:
        have, sent = _content(stored), _content(want)
        if have == sent:
            return True
        written = self._written.get(name)  # the API server dropped fields of what we sent
        return written is not None and written == (sent, have)

    async def _sync(self, devices: list[Device]) -> str:
        """One list-compare-write pass; returns the list's resourceVersion."""
        items, list_rv = await self.store.list(self.driver, self.node)
        existing = {_meta(s, "name"): s for s in items}
        uid = self._fixed_uid or await self.store.node_uid(self.node)
        generations = {int(s["spec"]["pool"].get("generation") or 0) for s in items}
        if len(generations) == 1:  # adopt a pool that already holds what we want
            gen = generations.pop()
            want = build_slices(self.node, uid, devices, max(gen, 1), driver=self.driver,
                                max_devices=self.max_devices)
            if gen >= 1 and {w["metadata"]["name"] for w in want} == set(existing) and all(
                    self._matches(w["metadata"]["name"], existing[w["metadata"]["name"]], w) for w in want):
                if gen != self._generation:
                    log.info("adopted slices=%d devices=%d generation=%d node=%s", len(want), len(devices), gen,
                             self.node)
                self._remember(gen, [existing[w["metadata"]["name"]] for w in want])
                return list_rv
        gen = max([self._generation, *(int(s["spec"]["pool"].get("generation") or 0) for s in items)]) + 1
        want = build_slices(self.node, uid, devices, gen, driver=self.driver, max_devices=self.max_devices)
        self._generation = gen  # even if a write below fails: the next pass goes higher
        stored = []
        for body in want:
            name = body["metadata"]["name"]
            if name in existing:
                body["metadata"]["resourceVersion"] = _meta(existing[name], "resourceVersion")
                got = await self.store.replace(body)
            else:
                got = await self.store.create(body)
            self._check_dropped(name, body, got)
            self._known[name] = _meta(got, "resourceVersion")
            stored.append(got)
        for name in sorted(set(existing) - {w["metadata"]["name"] for w in want}):
            self._known.pop(name, None)
            await self.store.delete(name)
        self._remember(gen, stored)
        log.info("published slices=%d devices=%d generation=%d node=%s replaced=%d deleted=%d", len(want),
                 len(devices), gen, self.node, len(set(existing) & set(self._known)),
                 len(set(existing) - set(self._known)))
        return list_rv

    def _remember(self, generation: int, stored: list[Slice]) -> None:
        self._generation = generation
        self._known = {_meta(s, "name"): _meta(s, "resourceVersion") for s in stored}
        self._slices = copy.deepcopy(stored)

    def _check_dropped(self, name: str, sent: Slice, got: Slice) -> None:
        pair = (_content(sent), _content(got))
        if pair[0] != pair[1]:
            if self._written.get(name) != pair:
                log.error("API server stored slice %s without some fields it was sent (a feature gate is off, "
                          "e.g. DRAConsumableCapacity for allowMultipleAllocations and requestPolicy): "
                          "dropped=%s", name, ",".join(sorted(_differences(pair[0], pair[1]))) or "-")
            self._written[name] = pair
        else:
            self._written.pop(name, None)

    async def _watch_until_dirty(self, list_rv: str) -> str:
        """Wait for a reason to sync again; returns it. Watch errors are raised."""
        watcher = asyncio.ensure_future(self._watch_for_drift(list_rv))
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait({watcher, waker}, timeout=self.resync_seconds,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (watcher, waker):
                t.cancel()
            await asyncio.gather(watcher, waker, return_exceptions=True)
        if watcher in done:
            return watcher.result()  # raises the watch's error
        return "publish" if waker in done else "periodic"

    async def _watch_for_drift(self, list_rv: str) -> str:
        async for kind, obj in self.store.watch(self.driver, self.node, list_rv, self.resync_seconds):
            if kind == "BOOKMARK":
                continue
            name, rv = _meta(obj, "name"), _meta(obj, "resourceVersion")
            if kind == "DELETED":
                if name in self._known:
                    log.warning("slice %s deleted by someone else node=%s", name, self.node)
                    return "deleted"
                continue
            if self._known.get(name) == rv:
                continue  # our own write
            log.warning("slice %s %s by someone else node=%s", name,
                        "changed" if name in self._known else "appeared", self.node)
            return "changed"
        return "watch-ended"
