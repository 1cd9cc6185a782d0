"""Prometheus metrics of the orchestrator, and the asyncio HTTP server that exposes them.

Owned by `Orchestrator` (one `OrchestratorMetrics` each, with its own registry, never
the process-wide default one); served by `timeslice orchestrator` and `timeslice
controller` with `--metrics-listen HOST:PORT`. Two kinds of series, all labelled `group`:

- read from the groups at scrape time (`GroupCollector` over `Orchestrator.groups()`):
  `timeslice_group_waiters` (queue depth), `timeslice_group_holder_held_seconds` (the
  current hold, 0 when none), `timeslice_group_epoch`, `timeslice_group_info{backend,
  residency}` (always 1: joined on `group` to break other series down by backend), the counters
  `timeslice_group_{grants,switches,failed_switches,lease_expiries,preemptions}_total`
  and `timeslice_group_held_seconds_total` (seconds a holder held the lock, the current
  hold included: `rate(timeslice_group_held_seconds_total[5m])` is the group's duty
  cycle, 0..1). Per job (label `timeslice_job`, `JOB`): the counters
  `timeslice_job_{grants,held_seconds,waited_seconds,checkpoints,restores}_total` and
  `timeslice_job_switch_bytes_total{direction}` (`JobCounters`; held seconds include the
  current hold), and the gauge `timeslice_job_device_bytes{kind}` (memory reports). A
  removed group, or a job the group dropped, is simply not there at the next scrape.
- fed by group events (`observe`, chained with the other observers): the histograms
  `timeslice_switch_duration_seconds{group,result}` (result ok|failed; checkpoint plus
  restore seconds) and `timeslice_acquire_wait_seconds{group}` (per grant, the longest
  wait among the granted job's callers), and the counter
  `timeslice_switch_bytes_total{group,direction}` (direction checkpointed|restored).
  `forget(group_id)` drops a removed group's label sets, so cardinality stays bounded.

Collectors run on the event loop thread (the HTTP server is aiohttp on the same loop,
prometheus-client's own aiohttp exporter: gzip when asked, OpenMetrics when the scraper
negotiates it): they read group state that only that thread changes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from timeslice.driver.grpc_server import host_port

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup
    from timeslice.controller.orchestrator.group_model import GroupEvent

log = logging.getLogger("timeslice.orchestrator")

# 1 ms .. 600 s, roughly x2.5 per step: lock hand-offs are milliseconds, GPU switches seconds,
# waits behind a long phase minutes.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0,
           250.0, 600.0)
RESULTS = ("ok", "failed")
JOB = "timeslice_job"
"""The job's label: Prometheus sets `job` on every scraped series (the scrape config's job
name) and renames a target's own `job` label to `exported_job`, so a `job` label of ours
would not survive a scrape under its name."""
DIRECTIONS = ("checkpointed", "restored")


class GroupCollector(Collector):
    """Per-group series read from `groups()` at each scrape (while `active()`)."""

    def __init__(self, groups: Callable[[], Sequence[LockGroup]], active: Callable[[], bool]) -> None:
        self._groups = groups
        self._active = active

    def collect(self) -> Iterator[Metric]:
        waiters = GaugeMetricFamily("timeslice_group_waiters", "Queue entries waiting for the group's lock.",
                                    labels=["group"])
        held = GaugeMetricFamily("timeslice_group_holder_held_seconds",
                                 "Seconds the current holder has held the lock (0 when none).", labels=["group"])
        epoch = GaugeMetricFamily("timeslice_group_epoch", "The group's fencing epoch (+1 per grant).",
                                  labels=["group"])
        info = GaugeMetricFamily("timeslice_group_info", "Always 1; the group's checkpoint backend and residency "
                                 "(join: * on(group) group_left(backend) timeslice_group_info).",
                                 labels=["group", "backend", "residency"])
        counters = {
            "grants": CounterMetricFamily("timeslice_group_grants", "Grants of the group's lock.",
                                          labels=["group"]),
            "switches": CounterMetricFamily("timeslice_group_switches",
                                            "Switches (checkpoint and/or restore) that succeeded.", labels=["group"]),
            "failed_switches": CounterMetricFamily("timeslice_group_failed_switches",
                                                   "Switches that failed and were rolled back.", labels=["group"]),
            "lease_expiries": CounterMetricFamily("timeslice_group_lease_expiries",
                                                  "Holders that lost the lock because their lease lapsed.",
                                                  labels=["group"]),
            "preemptions": CounterMetricFamily("timeslice_group_preemptions",
                                               "Holders preempted after maxHoldSeconds while others waited.",
                                               labels=["group"]),
        }
        residents = GaugeMetricFamily("timeslice_group_resident_jobs", "Jobs whose GPU state is on the GPUs.",
                                      labels=["group"])
        job_bytes = GaugeMetricFamily("timeslice_job_device_bytes", "Bytes a job holds on the group's GPUs "
                                      "(last node-agent report); kind now | peak (the most seen while resident) | "
                                      "declared (what it declared, per GPU) | reserved (what placement keeps for it; "
                                      "only once declared or settled).",
                                      labels=["group", JOB, "kind"])
        device_free = GaugeMetricFamily("timeslice_device_free_bytes", "Free memory of a GPU of the group (last "
                                        "node-agent report, NVML).", labels=["group", "device"])
        device_total = GaugeMetricFamily("timeslice_device_total_bytes", "Memory of a GPU of the group (NVML).",
                                         labels=["group", "device"])
        held_total = CounterMetricFamily("timeslice_group_held_seconds",
                                         "Seconds a holder held the group's lock, the current hold included "
                                         "(its rate is the group's duty cycle).", labels=["group"])
        per_job = {
            "grants": CounterMetricFamily("timeslice_job_grants", "Grants of the group's lock to the job.",
                                          labels=["group", JOB]),
            "held_seconds": CounterMetricFamily("timeslice_job_held_seconds", "Seconds the job held the group's "
                                                "lock, its current hold included (its rate is the job's share of "
                                                "the lock).", labels=["group", JOB]),
            "waited_seconds": CounterMetricFamily("timeslice_job_waited_seconds", "Seconds the job waited for "
                                                  "its grants (per grant, the longest wait among its callers; "
                                                  "over timeslice_job_grants_total: its mean wait).",
                                                  labels=["group", JOB]),
            "checkpoints": CounterMetricFamily("timeslice_job_checkpoints", "Switches that moved the job's "
                                               "state off the GPUs.", labels=["group", JOB]),
            "restores": CounterMetricFamily("timeslice_job_restores", "Switches that moved the job's state "
                                            "onto the GPUs.", labels=["group", JOB]),
        }
        job_moved = CounterMetricFamily("timeslice_job_switch_bytes", "Bytes switches moved of the job's state "
                                        "(summed over nodes); direction checkpointed | restored.",
                                        labels=["group", JOB, "direction"])
        for group in self._groups() if self._active() else ():
            v = group.view()
            labels = [v.group_id]
            waiters.add_metric(labels, len(v.waiters))
            held.add_metric(labels, v.held_seconds)
            epoch.add_metric(labels, v.epoch)
            info.add_metric([v.group_id, v.backend, v.residency], 1)
            for name, family in counters.items():
                family.add_metric(labels, getattr(v.counters, name))
            held_total.add_metric(labels, v.counters.held_seconds + v.held_seconds)
            for job, jc in v.jobs.items():
                current = v.held_seconds if v.holder is not None and v.holder.job_id == job else 0.0
                for name, family in per_job.items():
                    family.add_metric([v.group_id, job], getattr(jc, name) + (current if name == "held_seconds"
                                                                              else 0))
                job_moved.add_metric([v.group_id, job, "checkpointed"], jc.bytes_checkpointed)
                job_moved.add_metric([v.group_id, job, "restored"], jc.bytes_restored)
            residents.add_metric(labels, len(v.resident_jobs))
            for job, peak in v.peaks.items():
                job_bytes.add_metric([v.group_id, job, "peak"], sum(peak.values()))
            for job, declared in v.declared.items():
                job_bytes.add_metric([v.group_id, job, "declared"], declared)
            for job, reserved in v.reserved.items():
                job_bytes.add_metric([v.group_id, job, "reserved"], sum(reserved.values()))
            if v.memory is not None:
                for job, per_device in v.memory.device_bytes.items():
                    job_bytes.add_metric([v.group_id, job, "now"], sum(per_device.values()))
                for device, mem in v.memory.devices.items():
                    device_free.add_metric([v.group_id, device], mem.free)
                    device_total.add_metric([v.group_id, device], mem.total)
        yield from (waiters, held, epoch, info, *counters.values(), held_total, residents, job_bytes, device_free,
                    device_total, *per_job.values(), job_moved)


class OrchestratorMetrics:
    """The orchestrator's metrics in their own `registry`. `active`: False reports no
    groups (a controller replica that does not lead; its groups are not served)."""

    def __init__(self, groups: Callable[[], Sequence[LockGroup]]) -> None:
        self.active = True
        self.registry = CollectorRegistry()
        self.registry.register(GroupCollector(groups, lambda: self.active))
        self.switch_seconds = Histogram(
            "timeslice_switch_duration_seconds", "Switch duration (checkpoint + restore, summed over nodes), "
            "seconds; result ok|failed.", ["group", "result"], buckets=BUCKETS, registry=self.registry)
        self.switch_bytes = Counter(
            "timeslice_switch_bytes", "Bytes moved by switches (summed over nodes); direction "
            "checkpointed (off the GPU) | restored (onto it).", ["group", "direction"], registry=self.registry)
        self.acquire_wait = Histogram(
            "timeslice_acquire_wait_seconds", "Seconds from queueing to the grant (per grant: the longest wait "
            "among the job's callers).", ["group"], buckets=BUCKETS, registry=self.registry)

    def observe(self, group: LockGroup, event: GroupEvent) -> None:
        """A group observer (`group.Observer`): record switches and grants."""
        r = event.record
        if event.kind in ("switched", "switch-failed") and r is not None:
            self.switch_seconds.labels(event.group_id, "ok" if r.ok else "failed").observe(r.seconds)
            self.switch_bytes.labels(event.group_id, "checkpointed").inc(r.bytes_checkpointed)
            self.switch_bytes.labels(event.group_id, "restored").inc(r.bytes_restored)
        elif event.kind == "granted":
            self.acquire_wait.labels(event.group_id).observe(event.waited_seconds)

    def forget(self, group_id: str) -> None:
        """Drop the event-driven series of a removed group."""
        for metric, values in ((self.switch_seconds, RESULTS), (self.switch_bytes, DIRECTIONS)):
            for value in values:
                with contextlib.suppress(KeyError):
                    metric.remove(group_id, value)
        with contextlib.suppress(KeyError):
            self.acquire_wait.remove(group_id)


async def start_metrics_server(metrics: OrchestratorMetrics, listen: str) -> tuple[web.AppRunner, int]:
    """Serve `GET /metrics` on `listen` (`HOST:PORT`, port 0 picks one) on this event loop;
    returns (runner, bound port): `await runner.cleanup()` stops it. Raises ValueError for
    a malformed address, OSError when it cannot be bound."""
    host, port = host_port(listen, "metrics listen address")

    app = web.Application()
    app.router.add_get("/metrics", make_aiohttp_handler(metrics.registry))  # collectors run on the loop thread
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host or None, port).start()
    except OSError as err:
        await runner.cleanup()
        raise OSError(f"cannot serve metrics on {listen}: {err.strerror or err}") from None
    bound = next((a[1] for a in runner.addresses if isinstance(a, tuple)), port)
    log.info("metrics serving listen=%s port=%d path=/metrics", listen, bound)
    return runner, bound
