"""What every timeslice gRPC server shares: the request-log interceptor and health.

Owned by the driver package; used by the orchestrator and node-agent servers.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger("timeslice.grpc")
_ids = itertools.count(1)


class RequestLogInterceptor(grpc.aio.ServerInterceptor):
    """Logs `rpc=<method> req=<n> code=<status> seconds=<duration>` for unary calls.

    Successful calls log at DEBUG, failed ones at INFO (the status message is the
    user-facing error; the servicer already chose it).
    """

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = details.method

        async def logged(request: Any, context: grpc.aio.ServicerContext) -> Any:
            rid = next(_ids)
            t0 = time.monotonic()
            try:
                return await inner(request, context)
            finally:
                code = context.code() or grpc.StatusCode.OK
                level = logging.DEBUG if code == grpc.StatusCode.OK else logging.INFO
                log.log(level, "rpc=%s req=%d code=%s seconds=%.4f details=%r", method, rid,
                        getattr(code, "name", code), time.monotonic() - t0, context.details() or "")

        return grpc.unary_unary_rpc_method_handler(
            logged, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


# Accept the clients' keep-alive pings (every 20 s, also while an Acquire blocks).
SERVER_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(interceptors=[RequestLogInterceptor()], options=SERVER_OPTIONS)


async def add_health(server: grpc.aio.Server, services: Iterable[str]) -> health.aio.HealthServicer:
    """Register `grpc.health.v1.Health`, SERVING for "" and each named service."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *services):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def bind(server: grpc.aio.Server, listen: str) -> int:
    """Bind `listen` (`host:port` or `unix:///path`) without TLS; returns the port (0 for unix)."""
    port = server.add_insecure_port(listen)
    if port == 0 and not listen.startswith("unix:"):
        raise OSError(f"cannot listen on {listen}")
    return port
