"""The Grafana dashboard (manifests/grafana/timeslice-dra.json) queries only metrics that the
orchestrator registers: every PromQL expression is parsed (promql-parser, Prometheus' grammar)
and its metric names compared with the series names of `OrchestratorMetrics.registry`, so
renaming a metric in controller/orchestrator/metrics.py fails here until the dashboard follows."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
from timeslice.controller.orchestrator.metrics import OrchestratorMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "manifests" / "grafana" / "timeslice-dra.json"

# Series names per metric type in the Prometheus text format (prometheus_client names a counter's
# family without `_total`; histograms expose _bucket/_count/_sum; _created comes with both).
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created"), "info": ("_info",)}


def exposed_names() -> set[str]:
    """Every series name the orchestrator's registry can expose (its collectors run once)."""
    registry = OrchestratorMetrics(lambda: []).registry
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))  # a collapsed row holds its panels


def expressions(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dash["panels"]) for t in p.get("targets", [])]


def promql(expr: str) -> str:
    """Grafana's variables as values PromQL accepts: $__rate_interval and $__range are ranges,
    the others ($group, ${datasource}) appear only inside label matchers' strings."""
    return re.sub(r"\$\{?\w+\}?", "x", re.sub(r"\$__(rate_interval|range|interval)", "5m", expr))


def metric_names(expr: str) -> set[str]:
    """Metric names the expression selects. Raises promql_parser's error for bad PromQL."""
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name or "")  # a selector by {__name__=...} alone: "" (unknown, fails below)

    promql_parser.walk(promql_parser.parse(promql(expr)), visit)
    return names


def unknown_metrics(dash: dict[str, Any], known: set[str]) -> dict[str, set[str]]:
    """Expression -> the names it queries that are not in `known` (template variables too)."""
    out = {e: metric_names(e) - known for e in expressions(dash)}
    for v in dash["templating"]["list"]:
        if v["type"] == "query":  # label_values(METRIC, LABEL): Grafana's syntax, not PromQL
            m = re.fullmatch(r"label_values\((\w+), *(\w+)\)", v["query"]["query"])
            assert m, v["query"]
            out[v["query"]["query"]] = {m[1]} - known
    return {e: bad for e, bad in out.items() if bad}


def test_every_metric_the_dashboard_queries_is_registered() -> None:
    assert unknown_metrics(dashboard(), exposed_names()) == {}


def test_a_renamed_metric_is_caught() -> None:
    """The comparison fails when the code no longer registers a name the dashboard uses."""
    known = exposed_names() - {"timeslice_acquire_wait_seconds_bucket"}
    bad = unknown_metrics(dashboard(), known)
    assert bad and all(names == {"timeslice_acquire_wait_seconds_bucket"} for names in bad.values())


def test_the_dashboard_covers_locks_switches_and_failures() -> None:
    """Grants, acquire-wait quantiles, hold time, queue length, switch duration and bytes by
    backend, failures: each has a panel; panels have unique ids and use the datasource variable."""
    dash = dashboard()
    queried = set().union(*(metric_names(e) for e in expressions(dash)))
    for name in ("timeslice_group_grants_total", "timeslice_acquire_wait_seconds_bucket",
                 "timeslice_group_held_seconds_total", "timeslice_group_holder_held_seconds",
                 "timeslice_group_waiters", "timeslice_switch_duration_seconds_bucket", "timeslice_switch_bytes_total",
                 "timeslice_group_failed_switches_total", "timeslice_group_lease_expiries_total",
                 "timeslice_group_preemptions_total", "timeslice_group_info"):
        assert name in queried, name
    by_backend = [e for e in expressions(dash) if "group_left (backend)" in e]
    assert any("timeslice_switch_duration_seconds_bucket" in e for e in by_backend)
    assert any("timeslice_switch_bytes_total" in e for e in by_backend)
    assert any(e.startswith("histogram_quantile(0.99, ") for e in expressions(dash))
    ids = [p["id"] for p in panels(dash["panels"])]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels(dash["panels"]) if p["type"] != "row")
