"""FakeApiServer: list and watch of Pods, ResourceClaims and ResourceSlices over real HTTP.

The seam of the ClusterState / Reflector tests: the real `kubernetes.aio` client talks to
it on 127.0.0.1 (aiohttp.web). It serves what a reflector uses, the way the API server
does: lists with `limit`/`continue` and a `resourceVersion`; watches from a
`resourceVersion` with `timeoutSeconds`, one JSON event per line; field selectors
`path=value` / `path!=value` on dotted paths. Faults for the tests:

- `fail(kind, status, times)`: the next requests of that kind get a Status error;
- `compact()`: history is gone; watches from an older version get an ERROR 410 event,
  open watches end with one;
- `put(obj, silent=True)` / `delete(obj, silent=True)`: a change no watch reports (only
  a list shows it), as when events were missed;
- `stop()` / `start()` again on the same port: an API server outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

Obj = dict[str, Any]
PATHS = {
    "/api/v1/pods": "Pod",
    "/apis/resource.k8s.io/v1/resourceclaims": "ResourceClaim",
    "/apis/resource.k8s.io/v1/resourceslices": "ResourceSlice",
}


def _field(obj: Mapping[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    return "" if cur is None else str(cur)


def matches(obj: Obj, selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            path, value = term.split("!=", 1)
            if _field(obj, path) == value:
                return False
        else:
            path, value = term.split("=", 1)
            if _field(obj, path) != value:
                return False
    return True


def status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeApiServer:
    def __init__(self) -> None:
        self.rv = 1
        self.objects: dict[str, dict[str, Obj]] = {kind: {} for kind in PATHS.values()}
        self.history: list[tuple[int, str, str, Obj]] = []  # (rv, kind, event type, object)
        self.compacted = 0
        self.faults: dict[str, list[int]] = {}
        self.requests: list[tuple[str, bool, dict[str, str]]] = []  # (kind, watch?, query)
        self.port = 0
        self._changed = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        app = web.Application()
        for path in PATHS:
            app.router.add_get(path, self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            self._notify()  # open watches see the runner gone and end
            await runner.cleanup()

    # -- state -------------------------------------------------------------------
    def put(self, obj: Obj, silent: bool = False) -> Obj:
        """Create or update (by uid); returns the stored copy with its resourceVersion."""
        self.rv += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.rv)
        kind, uid = stored["kind"], stored["metadata"]["uid"]
        event = "MODIFIED" if uid in self.objects[kind] else "ADDED"
        self.objects[kind][uid] = stored
        if not silent:
            self.history.append((self.rv, kind, event, stored))
        self._notify()
        return stored

    def delete(self, obj: Obj, silent: bool = False) -> None:
        kind, uid = obj["kind"], obj["metadata"]["uid"]
        gone = self.objects[kind].pop(uid)
        self.rv += 1
        if not silent:
            self.history.append((self.rv, kind, "DELETED", {**gone, "metadata": {
                **gone["metadata"], "resourceVersion": str(self.rv)}}))
        self._notify()

    def compact(self) -> None:
        self.compacted = self.rv
        self.history.clear()
        self._notify()

    def fail(self, kind: str, code: int = 500, times: int = 1) -> None:
        self.faults.setdefault(kind, []).extend([code] * times)

    def count(self, kind: str, watch: bool) -> int:
        return sum(1 for k, w, _ in self.requests if k == kind and w == watch)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- HTTP --------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        kind = PATHS[request.path]
        query = dict(request.query)
        watch = query.get("watch") == "true"
        self.requests.append((kind, watch, query))
        if self.faults.get(kind):
            code = self.faults[kind].pop(0)
            return web.json_response(status(code, "Injected", f"injected {code}"), status=code)
        selector = query.get("fieldSelector", "")
        if watch:
            return await self._watch(request, kind, int(query.get("resourceVersion") or 0),
                                     float(query.get("timeoutSeconds") or 30), selector)
        items = sorted((o for o in self.objects[kind].values() if matches(o, selector)),
                       key=lambda o: o["metadata"]["uid"])
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0) or len(items) or 1
        page = items[start:start + limit]
        meta: Obj = {"resourceVersion": str(self.rv)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        return web.json_response({"kind": f"{kind}List", "apiVersion": "v1", "metadata": meta, "items": page})

    async def _watch(self, request: web.Request, kind: str, since: int, timeout: float,
                     selector: str) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "application/json"
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):  # the client went away (stopped, reconnecting)
            await self._stream(resp, kind, since, timeout, selector)
        return resp

    async def _stream(self, resp: web.StreamResponse, kind: str, since: int, timeout: float,
                      selector: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        epoch = self.compacted
        pos = since
        while True:
            if since < self.compacted or epoch != self.compacted:
                await self._send(resp, "ERROR", status(410, "Expired", "too old resource version"))
                break
            for rv, k, event, obj in list(self.history):
                if rv > pos and k == kind and matches(obj, selector):
                    await self._send(resp, event, obj)
                pos = max(pos, rv)
            remaining = deadline - loop.time()
            if remaining <= 0 or self._runner is None:
                break
            waiter = self._changed
            try:
                await asyncio.wait_for(waiter.wait(), remaining)
            except TimeoutError:
                pass
        await resp.write_eof()

    @staticmethod
    async def _send(resp: web.StreamResponse, event: str, obj: Obj) -> None:
        await resp.write((json.dumps({"type": event, "object": obj}) + "\n").encode())
