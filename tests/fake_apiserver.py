"""FakeApiServer: Pods, ResourceClaims, ResourceSlices and Events over real HTTP.

The seam of the ClusterState / Reflector / ClaimStatusWriter tests: the real
`kubernetes.aio` client talks to it on 127.0.0.1 (aiohttp.web). It serves what a
reflector uses, the way the API server does: lists with `limit`/`continue` and a
`resourceVersion`; watches from a `resourceVersion` with `timeoutSeconds`, one JSON
event per line; field selectors `path=value` / `path!=value` on dotted paths. And what
the claim status writer uses: GET of one ResourceClaim (404 NotFound when absent), PATCH
of its `status` subresource (a merge patch: objects merge, lists and values replace, null
deletes; only `status` is applied, a new resourceVersion and a MODIFIED watch event, as
the API server does for a strategic merge patch of `status.devices`, which has no patch
strategy), and POST of core/v1 Events (201 Created). What the kubelet plugin's
certificate publisher uses: PATCH of one Pod's `metadata` (a JSON merge patch or a
strategic merge patch, by Content-Type; for `metadata.annotations`, a map of strings, the
two are the same: keys merge, a value replaces, null deletes; any other field in the
body is refused with 422 here, and a JSON Patch with 415, so no test relies on what this
fake does not model; 404 for an unknown pod; a new resourceVersion and a MODIFIED watch
event). Fault and request keys are the kind, `ResourceClaim/status` for status patches,
`Pod/patch` for pod patches and `Event` for Event creation. Faults for the tests:

- `fail(kind, status, times)`: the next requests of that key get a Status error;
  `times=None`: every request until `heal(kind)`;
- `compact()`: history is gone; watches from an older version get an ERROR 410 event,
  open watches end with one;
- `put(obj, silent=True)` / `delete(obj, silent=True)`: a change no watch reports (only
  a list shows it), as when events were missed;
- `stop()` / `start()` again on the same port: an API server outage.

Leases (`coordination.k8s.io/v1`, what leader election uses): GET, POST and PUT of one
Lease, a PUT refused with 409 unless it carries the stored resourceVersion.

It also answers TokenReviews (`authentication.k8s.io/v1`) for the tokens given with
`add_token()`, audience-aware as the API server is for ServiceAccount tokens: a token
authenticates only for an audience it was issued for, and `status.audiences` is the
intersection; `reviews` records each review's spec. Faults: `fail("TokenReview", ...)`.
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
CLAIM_PATH = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
POD_PATH = "/api/v1/namespaces/{namespace}/pods/{name}"
MERGE_PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
EVENTS_PATH = "/api/v1/namespaces/{namespace}/events"
TOKENREVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
LEASES_PATH = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
# The audience of a TokenReview without spec.audiences (the API server's own).
API_AUDIENCE = "https://kubernetes.default.svc"


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


def _merge(target: Obj, patch: Obj) -> Obj:
    """JSON merge patch (RFC 7386): objects merge, anything else replaces, null deletes."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


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
        self.failing: dict[str, int] = {}  # key -> status code, until healed
        self.requests: list[tuple[str, bool, dict[str, str]]] = []  # (key, watch?, query)
        self.status_patches: list[tuple[str, str, Obj]] = []  # applied: (namespace, name, patch body)
        self.pod_patches: list[tuple[str, str, str, Obj]] = []  # applied: (namespace, name, content type, body)
        self.events: list[Obj] = []  # created Events
        self.tokens: dict[str, tuple[Obj, list[str]]] = {}  # token -> (status.user, audiences)
        self.reviews: list[Obj] = []  # spec of every TokenReview received
        self.leases: dict[tuple[str, str], Obj] = {}  # (namespace, name) -> coordination.k8s.io/v1 Lease
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
        app.router.add_get(CLAIM_PATH, self._get_claim)
        app.router.add_patch(CLAIM_PATH + "/status", self._patch_claim_status)
        app.router.add_patch(POD_PATH, self._patch_pod)
        app.router.add_post(EVENTS_PATH, self._create_event)
        app.router.add_post(TOKENREVIEWS, self._review)
        app.router.add_get(LEASES_PATH + "/{name}", self._get_lease)
        app.router.add_post(LEASES_PATH, self._create_lease)
        app.router.add_put(LEASES_PATH + "/{name}", self._replace_lease)
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

    def add_token(self, token: str, username: str, audiences: list[str], extra: dict[str, list[str]] | None = None,
                  groups: list[str] | None = None) -> None:
        """A token the TokenReview authenticates as `username`, for `audiences` only."""
        user = {"username": username, "uid": f"uid-{username}", "groups": groups or ["system:serviceaccounts"],
                "extra": extra or {}}
        self.tokens[token] = (user, audiences)

    def compact(self) -> None:
        self.compacted = self.rv
        self.history.clear()
        self._notify()

    def fail(self, kind: str, code: int = 500, times: int | None = 1) -> None:
        """Answer the next `times` requests of `kind` (a key, see the module docstring) with
        a `code` Status; `times=None`: all of them until `heal(kind)`."""
        if times is None:
            self.failing[kind] = code
        else:
            self.faults.setdefault(kind, []).extend([code] * times)

    def heal(self, kind: str) -> None:
        """No more injected errors for `kind`."""
        self.failing.pop(kind, None)
        self.faults.pop(kind, None)

    def count(self, kind: str, watch: bool) -> int:
        return sum(1 for k, w, _ in self.requests if k == kind and w == watch)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def claim(self, namespace: str, name: str) -> Obj | None:
        """The stored ResourceClaim of that namespace and name, if any."""
        return next((c for c in self.objects["ResourceClaim"].values()
                     if c["metadata"]["namespace"] == namespace and c["metadata"]["name"] == name), None)

    def pod(self, namespace: str, name: str) -> Obj | None:
        """The stored Pod of that namespace and name, if any."""
        return next((p for p in self.objects["Pod"].values()
                     if p["metadata"]["namespace"] == namespace and p["metadata"]["name"] == name), None)

    # -- HTTP --------------------------------------------------------------------
    def _fault(self, key: str) -> web.Response | None:
        code = self.faults[key].pop(0) if self.faults.get(key) else self.failing.get(key)
        if code is None:
            return None
        return web.json_response(status(code, "Injected", f"injected {code}"), status=code)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        kind = PATHS[request.path]
        query = dict(request.query)
        watch = query.get("watch") == "true"
        self.requests.append((kind, watch, query))
        fault = self._fault(kind)
        if fault is not None:
            return fault
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

    async def _get_claim(self, request: web.Request) -> web.Response:
        self.requests.append(("ResourceClaim", False, dict(request.query)))
        fault = self._fault("ResourceClaim")
        if fault is not None:
            return fault
        ns, name = request.match_info["namespace"], request.match_info["name"]
        claim = self.claim(ns, name)
        if claim is None:
            return web.json_response(status(404, "NotFound", f'resourceclaims "{name}" not found'), status=404)
        return web.json_response(claim)

    async def _patch_claim_status(self, request: web.Request) -> web.Response:
        self.requests.append(("ResourceClaim/status", False, dict(request.query)))
        fault = self._fault("ResourceClaim/status")
        if fault is not None:
            return fault
        ns, name = request.match_info["namespace"], request.match_info["name"]
        claim = self.claim(ns, name)
        if claim is None:
            return web.json_response(status(404, "NotFound", f'resourceclaims "{name}" not found'), status=404)
        body = await request.json()
        updated = copy.deepcopy(claim)
        updated["status"] = _merge(updated.get("status") or {}, body.get("status") or {})
        self.status_patches.append((ns, name, body))
        return web.json_response(self.put(updated))

    async def _patch_pod(self, request: web.Request) -> web.Response:
        self.requests.append(("Pod/patch", False, dict(request.query)))
        fault = self._fault("Pod/patch")
        if fault is not None:
            return fault
        ns, name = request.match_info["namespace"], request.match_info["name"]
        content_type = request.content_type
        if content_type not in MERGE_PATCHES:
            return web.json_response(status(415, "UnsupportedMediaType", f"the fake API server takes only "
                                                                         f"{', '.join(MERGE_PATCHES)}"), status=415)
        body = await request.json()
        if not isinstance(body, dict) or set(body) - {"metadata"} or \
                set(body.get("metadata") or {}) - {"annotations", "labels"}:
            return web.json_response(status(422, "Invalid", "the fake API server patches only metadata.annotations "
                                                            "and metadata.labels of a pod"), status=422)
        pod = self.pod(ns, name)
        if pod is None:
            return web.json_response(status(404, "NotFound", f'pods "{name}" not found'), status=404)
        updated = copy.deepcopy(pod)
        updated["metadata"] = _merge(updated["metadata"], body.get("metadata") or {})
        for key in ("annotations", "labels"):  # the API server drops an emptied map
            if key in updated["metadata"] and not updated["metadata"][key]:
                del updated["metadata"][key]
        self.pod_patches.append((ns, name, content_type, body))
        return web.json_response(self.put(updated))

    async def _create_event(self, request: web.Request) -> web.Response:
        self.requests.append(("Event", False, dict(request.query)))
        fault = self._fault("Event")
        if fault is not None:
            return fault
        event = await request.json()
        self.rv += 1
        event["metadata"] = {**event.get("metadata", {}), "namespace": request.match_info["namespace"],
                             "uid": f"uid-event-{self.rv}", "resourceVersion": str(self.rv)}
        self.events.append(event)
        return web.json_response(event, status=201)

    async def _get_lease(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        lease = self.leases.get((ns, name))
        if lease is None:
            return web.json_response(status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found'),
                                     status=404)
        return web.json_response(lease)

    async def _create_lease(self, request: web.Request) -> web.Response:
        ns, body = request.match_info["namespace"], await request.json()
        name = body["metadata"]["name"]
        if (ns, name) in self.leases:
            return web.json_response(status(409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already '
                                                                  "exists"), status=409)
        return web.json_response(self._store_lease(ns, name, body), status=201)

    async def _replace_lease(self, request: web.Request) -> web.Response:
        """PUT with optimistic concurrency, as the API server does: the body's resourceVersion
        must be the stored one (409 Conflict otherwise)."""
        ns, name, body = request.match_info["namespace"], request.match_info["name"], await request.json()
        lease = self.leases.get((ns, name))
        if lease is None:
            return web.json_response(status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found'),
                                     status=404)
        if (body.get("metadata") or {}).get("resourceVersion") != lease["metadata"]["resourceVersion"]:
            return web.json_response(status(409, "Conflict", "the object has been modified"), status=409)
        return web.json_response(self._store_lease(ns, name, body))

    def _store_lease(self, ns: str, name: str, body: Obj) -> Obj:
        self.rv += 1
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": body.get("spec") or {},
                 "metadata": {**(body.get("metadata") or {}), "name": name, "namespace": ns,
                              "uid": f"uid-lease-{name}", "resourceVersion": str(self.rv)}}
        self.leases[(ns, name)] = lease
        return lease

    async def _review(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("TokenReview", False, {}))
        fault = self._fault("TokenReview")
        if fault is not None:
            return fault
        spec = body.get("spec") or {}
        self.reviews.append(spec)
        user, issued = self.tokens.get(spec.get("token", ""), ({}, []))
        wanted = spec.get("audiences") or [API_AUDIENCE]
        common = [a for a in wanted if a in issued]
        result: Obj = {"authenticated": True, "user": user, "audiences": common}
        if not user:
            result = {"authenticated": False, "error": "invalid bearer token"}
        elif not common:
            result = {"authenticated": False, "error": f"[invalid bearer token, token audiences {issued} is "
                                                      f"invalid for the target audiences {wanted}]"}
        return web.json_response({"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
                                  "metadata": {}, "spec": spec, "status": result}, status=201)

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
