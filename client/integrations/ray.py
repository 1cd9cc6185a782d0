"""`timeslice.integrations.ray`: hold a group around Ray actor methods.

Owned by the client package; imported by jobs that run on Ray (it does not import `ray`
itself: the decorator works on any class, and Ray pickles it by reference). Usage::

    import ray
    import timeslice.integrations.ray as ts_ray

    @ray.remote(num_gpus=1, runtime_env={"env_vars": {"TIMESLICE_ORCHESTRATOR": "...", "TIMESLICE_JOB": "..."}})
    class Trainer:
        @ts_ray.on_accelerators("trainer")
        def train_step(self, batch): ...

        def shutdown(self):
            ts_ray.close(self)      # releases what it holds and sends Leave

A `TimeSliceOrchestratorClient` holds a gRPC channel and threads and cannot be pickled, so the
decorator never captures one: the first decorated call in an actor makes the actor's client in
the actor's own process (from `$TIMESLICE_ORCHESTRATOR`, `$TIMESLICE_JOB`, or the `target` /
`job_id` of the decorator; in a cluster pod with its token mounted no job id is needed) and
keeps it on the actor instance; every decorated method of the actor then uses it. Threaded
actors (`max_concurrency > 1`) and async actors (`async def` methods: acquire and release run
in a worker thread) are supported; the Ray actor itself stays picklable until its first call.
With no orchestrator configured (no `target` and no `$TIMESLICE_ORCHESTRATOR` in the actor's
process) the decorated methods run without holding anything, and one warning says so: the
same code runs with and without time-slicing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from timeslice._rpc import ENV_TARGET
from timeslice.client import TimeSliceOrchestratorClient
from timeslice.scope import AcceleratorScope

log = logging.getLogger("timeslice.integrations.ray")

F = TypeVar("F", bound=Callable[..., Any])
# The attribute of the actor instance that keeps its client (one per actor, made on first use).
CLIENT_ATTRIBUTE = "_timeslice_client"


def client_of(actor: object, *, target: str | None = None, job_id: str | None = None) -> TimeSliceOrchestratorClient:
    """The client of `actor` (an instance, `self` in a method), made on first use with
    `target` and `job_id` (None: `$TIMESLICE_ORCHESTRATOR`, `$TIMESLICE_JOB`); later calls
    return it whatever they pass. Raises ValueError when the target or job is set nowhere."""
    attrs = vars(actor)
    client = attrs.get(CLIENT_ATTRIBUTE)
    if client is None:
        made = TimeSliceOrchestratorClient(target, job_id)
        client = attrs.setdefault(CLIENT_ATTRIBUTE, made)  # atomic: a racing thread's client wins or ours does
        if client is not made:
            made.close()
    return client  # type: ignore[no-any-return]


def close(actor: object) -> None:
    """Close `actor`'s client if it has one (releases its holds, sends `Leave`, closes the
    channel); the next decorated call makes a new one."""
    client = vars(actor).pop(CLIENT_ATTRIBUTE, None)
    if client is not None:
        client.close()


def on_accelerators(group_id: str | None = None, *, timeout: float | None = None, priority: int | None = None,
                    target: str | None = None, job_id: str | None = None) -> Callable[[F], F]:
    """Decorate an actor method (plain or `async def`) to hold `group_id` (the claim set,
    None: `$TIMESLICE_GROUP`) while it runs, through `client_of(self, target=, job_id=)`.

    Same contract as `TimeSliceOrchestratorClient.on_accelerators`: `timeout` seconds for
    the grant, nested decorated calls share one hold, the hold ends when the method
    returns or raises; raises what `acquire()` raises, and `LeaseLost` when the lease
    lapsed during the call.
    """
    def decorate(method: F) -> F:
        def scope(actor: object) -> AcceleratorScope | contextlib.nullcontext[None]:
            if target is None and not os.environ.get(ENV_TARGET):
                _unconfigured()
                return contextlib.nullcontext()
            return client_of(actor, target=target, job_id=job_id).on_accelerators(
                group_id, timeout=timeout, priority=priority)

        if inspect.iscoroutinefunction(method):
            @functools.wraps(method)
            async def run_async(self: object, *args: Any, **kwargs: Any) -> Any:
                async with scope(self):
                    return await method(self, *args, **kwargs)
            return run_async  # type: ignore[return-value]

        @functools.wraps(method)
        def run(self: object, *args: Any, **kwargs: Any) -> Any:
            with scope(self):
                return method(self, *args, **kwargs)
        return run  # type: ignore[return-value]
    return decorate


@functools.cache
def _unconfigured() -> None:
    """Say once per process that decorated methods run without holding."""
    log.warning("no orchestrator configured (%s is unset and no target was given): methods decorated with "
                "timeslice.integrations.ray.on_accelerators run without holding a group", ENV_TARGET)
