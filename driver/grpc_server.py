"""What every timeslice gRPC server shares: error translation and request logs, health.

Owned by the driver package; used by the orchestrator and node-agent servers.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from timeslice.driver.errors import REASON_METADATA, TimeSliceServerError
from timeslice.driver.private_paths import free_socket_path

log = logging.getLogger("timeslice.grpc")
_ids = itertools.count(1)
F = TypeVar("F", bound=Callable[..., Any])


def rpc_method(fn: F) -> F:
    """Decorate a servicer method: translate `TimeSliceServerError` into its gRPC status
    (with its `reason`, if any, as the trailing metadata `REASON_METADATA`) and log
    `rpc=<method> req=<n> code=<status> seconds=<duration>`.

    Successful calls log at DEBUG, failed ones at INFO with the status message (the
    user-facing error). A decorator rather than a `grpc.aio.ServerInterceptor`: the
    aio interceptor path added ~3 ms to the p99 hand-off (bench/handoff.py).
    """
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        rid = next(_ids)
        t0 = time.monotonic()
        try:
            return await fn(self, request, context)
        except TimeSliceServerError as err:
            await context.abort(err.code, str(err), ((REASON_METADATA, err.reason),) if err.reason else ())
        finally:
            code = context.code() or grpc.StatusCode.OK
            if code != grpc.StatusCode.OK or log.isEnabledFor(logging.DEBUG):
                log.log(logging.DEBUG if code == grpc.StatusCode.OK else logging.INFO,
                        "rpc=%s req=%d code=%s seconds=%.4f details=%r", method, rid, getattr(code, "name", code),
                        time.monotonic() - t0, context.details() or "")

    return wrapper  # type: ignore[return-value]


# Accept the clients' keep-alive pings (every 20 s, also while an Acquire blocks), and ping
# them: a client that does not answer within `grpc.http2.ping_timeout_ms` (a stopped or hung
# process, a host gone without closing its connection) loses its connection, so its blocked
# Acquire is cancelled and its waiter leaves the queue instead of being granted a lease
# nobody uses (issue 10, item 6); a waiter whose job this orchestrator froze or
# checkpointed keeps its place (`Callers.lost`). `keepalive_timeout_ms` alone did not
# close the connection (gRPC 1.85): the ping timeout does. No SO_REUSEPORT (gRPC's default
# on Linux): a second server on a busy port must fail, not share it (two orchestrators
# answering at random would be two lock tables).
SERVER_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging a client that only waits
    ("grpc.http2.min_time_between_pings_ms", 10000),
    ("grpc.so_reuseport", 0),
    # Calls the core has received but the asyncio server has not picked up yet: past 1000 (the
    # core's default soft limit, GRPC_ARG_SERVER_MAX_PENDING_REQUESTS) it cancels new ones at
    # random (random early detection) up to 3000 (the hard limit), and the client sees CANCELLED
    # with no details. Hundreds of clients connecting at once hit it (issue 10, item 15: ~30
    # cancelled first Acquires per run of 200 groups x 8 clients); pending calls cost little.
    ("grpc.server.max_pending_requests", 100000),
    ("grpc.server.max_pending_requests_hard_limit", 200000),
]


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS)


async def add_health(server: grpc.aio.Server, services: Iterable[str]) -> health.aio.HealthServicer:
    """Register `grpc.health.v1.Health`, SERVING for "" and each named service."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *services):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def host_port(listen: str, what: str = "listen address") -> tuple[str, int]:
    """(host, port) of a `HOST:PORT` address (`[::1]:50051` gives host `::1`; an empty host
    means every address). Raises ValueError naming `what` unless the port is 0..65535."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"{what} {listen!r}: use HOST:PORT; the port must be a number in 0..65535")
    return host.strip("[]"), int(port_text)


def bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `listen` (`host:port` or `unix:///path`); returns the port (0 for unix).

    Without `credentials` the port is plaintext (`add_insecure_port`); with them (e.g.
    `grpc.ssl_server_credentials`) it serves TLS only (`add_secure_port`), and a plaintext
    caller's connection is closed during the handshake. Raises ValueError for a port
    outside 0..65535, OSError when the address cannot be bound (in use, not local)."""
    if not listen.startswith("unix:"):
        host_port(listen)
    else:  # (grpc removes whatever file is there, a live server's socket too)
        free_socket_path(Path(listen.removeprefix("unix://").removeprefix("unix:")))
    try:
        port = (server.add_insecure_port(listen) if credentials is None
                else server.add_secure_port(listen, credentials))
    except RuntimeError as err:  # grpc raises RuntimeError("Failed to bind to address ...")
        raise OSError(f"cannot listen on {listen}: address in use or not local") from err
    if port == 0 and not listen.startswith("unix:"):
        raise OSError(f"cannot listen on {listen}: address in use or not local")
    return port


async def start(add_servicer: Callable[[grpc.aio.Server], object], services: Iterable[str], listen: str,
                credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """A started server: `add_servicer(server)` registers the service, health reports
    SERVING for `services`, bound to `listen` (TLS with `credentials`, see `bind`). Returns
    (server, port; 0 for unix sockets). Raises ValueError / OSError as `bind` does."""
    server = new_server()
    add_servicer(server)
    await add_health(server, services)
    port = bind(server, listen, credentials)
    await server.start()
    return server, port
