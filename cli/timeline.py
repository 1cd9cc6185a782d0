"""Timeline pictures of a shared accelerator: one row per job, one time axis.

Used by `timeslice demo --plot PNG`, `timeslice plot RESULT.json` and `bench/rl_grpo.py
--plot PNG`, so the demo and the benchmark share one implementation. Two steps:

- `timelines(result)` reads a result as the demo (`timeslice demo --json`) or the RL
  benchmark (bench/rl_grpo.py, one object or the JSON list it writes) prints it, into typed
  `Timeline`s (pure; no matplotlib). Spans, per job: `wait` (acquire called .. granted),
  `hold` (granted .. released: the job holds the group's lock), `compute` (the GPU work inside
  the hold: the demo worker's phase, or a benchmark phase from grant to synchronised end,
  labelled generate/train/...), and from the orchestrator's switch records `checkpoint` (on
  each evicted job's row) and `restore` (on the granted job's row), with the bytes moved, or
  `failed` for a switch that failed and was rolled back.
- `draw(timelines, path)` renders them with matplotlib (the `plot` extra), one panel per
  timeline, into a PNG (or any format matplotlib infers from the file name).

Clocks: the benchmark's phases and every switch record's `finished_at_unix` are unix
seconds. The demo's events are `time.monotonic()` seconds; its result carries
`clock_offset_unix_seconds` (unix minus monotonic). Demo results written before that field
existed get it estimated from the grants that followed switches: such a grant reports the
switch's seconds (`switch_seconds`, equal to the record's checkpoint + restore seconds) and
comes right after the record's `finished_at_unix`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timeslice.driver.names import install_hint

INSTALL = install_hint("plot")
KINDS = ("wait", "hold", "compute", "checkpoint", "restore", "failed")
SWITCH_KINDS = ("checkpoint", "restore", "failed")


@dataclass(frozen=True)
class Span:
    """One interval on a job's row: seconds from the timeline's start. `label`: the phase
    kind of a compute span (generate, train, ...); `bytes`: bytes a checkpoint or restore moved."""

    job: str
    kind: str  # one of KINDS
    start: float
    end: float
    label: str = ""
    bytes: int = 0


@dataclass
class Timeline:
    """One panel: `jobs` are the rows, top to bottom; `spans` sorted by start; `notes` say
    what the picture could not show (e.g. a result measured before phases were recorded)."""

    title: str
    jobs: list[str]
    spans: list[Span]
    notes: list[str] = field(default_factory=list)

    def of(self, job: str, *kinds: str) -> list[Span]:
        """The spans of one row, of these kinds (all when none given), in start order."""
        return [s for s in self.spans if s.job == job and (not kinds or s.kind in kinds)]

    @property
    def seconds(self) -> float:
        return max((s.end for s in self.spans), default=0.0)


def timelines(result: Any) -> list[Timeline]:
    """The timelines of a demo result, an rl_grpo result, or a list of those. Raises
    ValueError for anything else (a missing key names itself)."""
    items = result if isinstance(result, list) else [result]
    out = []
    for item in items:
        if isinstance(item, dict) and "timeline" in item and "gen_seconds" in item:
            out.append(from_demo(item))
        elif isinstance(item, dict) and item.get("benchmark") == "rl_grpo":
            out.append(from_rl_grpo(item))
        else:
            raise ValueError("not a result of `timeslice demo --json` or bench/rl_grpo.py (a JSON object with "
                             "'timeline', or with \"benchmark\": \"rl_grpo\", or a list of them)")
    if not out:
        raise ValueError("the result list is empty")
    return out


def load(path: str | Path) -> list[Timeline]:
    """`timelines()` of a JSON file. Raises OSError (unreadable) or ValueError (not JSON, not a result)."""
    text = Path(path).read_text()
    try:
        return timelines(json.loads(text))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON: {err}") from None
    except KeyError as err:
        raise ValueError(f"{path}: a result without the field {err}") from None
    except (TypeError, AttributeError) as err:  # a field of another shape (a number for a list, ...)
        raise ValueError(f"{path}: not a result of the expected shape: {err}") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def from_demo(result: Mapping[str, Any]) -> Timeline:
    """The shared group of a `timeslice demo --json` result: one row per job."""
    events = result["timeline"]
    records = result.get("switch_records", [])
    offset = result.get("clock_offset_unix_seconds")
    notes = []
    if offset is None and records:
        offset = estimate_offset(events, records)
        notes.append("switch times estimated from the grants that followed them" if offset is not None
                     else "switch times unknown (no grant matched a switch record)")
    raw: list[Span] = []
    for e in events:
        # a hold ends when its job asks to release it (`release`): `released`, when the answer came
        # back, may be after the orchestrator granted the next job (a full run drew two holds 2.6 ms
        # over each other)
        end = e.get("release", e["released"])
        raw += [Span(e["job"], "wait", e["acquire"], e["granted"]), Span(e["job"], "hold", e["granted"], end),
                Span(e["job"], "compute", e["gen_start"], e["gen_end"])]
    if offset is not None:
        raw += switch_spans(records, offset)
    title = (f"timeslice demo: {result['jobs']} jobs x {result['rounds']} rounds, backend {result['backend']}, "
             f"{result['switches']} switches")
    if result.get("preemptions"):
        title += f", {result['preemptions']} preemptions"
    return _timeline(_title(title, result), sorted({s.job for s in raw}, key=_job_order), raw, notes)


def from_rl_grpo(result: Mapping[str, Any]) -> Timeline:
    """A bench/rl_grpo.py result: per-job phases (`job_phases`, unix seconds) and its switches.
    Results written before `job_phases` existed give the switches alone (a note says so)."""
    phases: dict[str, list[dict[str, Any]]] = result.get("job_phases", {})
    raw: list[Span] = []
    for job, ps in phases.items():
        for p in ps:
            raw += [Span(job, "wait", p["acquire"], p["granted"]), Span(job, "hold", p["granted"], p["released"]),
                    Span(job, "compute", p["granted"], p["done"], label=p["kind"])]
    raw += switch_spans(result.get("switch_records", []), 0.0)
    notes = [] if phases else ["no GPU phases in this result (measured before bench/rl_grpo.py recorded them): "
                               "switches only"]
    moved = result.get("bytes_moved", 0)
    title = (f"rl_grpo: {result['jobs']} jobs ({result['size']}), backend {result['backend']}, residency "
             f"{result.get('residency', 'exclusive')}: gain {result['gain']}x, {result['switches']} switches, "
             f"{moved / 1e9:.0f} GB moved")
    jobs = sorted({*phases, *(s.job for s in raw)}, key=_job_order)
    return _timeline(_title(title, result), jobs, raw, notes)


def switch_spans(records: Iterable[Mapping[str, Any]], offset: float) -> list[Span]:
    """Spans of switch records (`finished_at_unix` - `offset` = the timeline's clock): the
    checkpoint on each evicted job's row (bytes on the first), then the restore on the
    granted job's row; a failed switch as one `failed` span on the granted job's row."""
    out = []
    for r in records:
        end = r["finished_at_unix"] - offset
        ckpt, rest = r["checkpoint_seconds"], r["restore_seconds"]
        if not r["ok"]:
            out.append(Span(r["to_job"], "failed", end - ckpt - rest, end, label=r.get("error", "")[:60]))
            continue
        evicted = r.get("evicted") or ([r["from_job"]] if r.get("from_job") else [])
        if ckpt > 0 or r["bytes_checkpointed"]:
            out += [Span(job, "checkpoint", end - rest - ckpt, end - rest,
                         bytes=r["bytes_checkpointed"] if i == 0 else 0) for i, job in enumerate(evicted)]
        if rest > 0 or r["bytes_restored"]:
            out.append(Span(r["to_job"], "restore", end - rest, end, bytes=r["bytes_restored"]))
    return out


def estimate_offset(events: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]]) -> float | None:
    """Unix minus monotonic seconds for a demo result that did not record it, or None.

    Candidates: for each successful switch record and each grant of its `to_job` that reports
    the same switch seconds (within 1 ms), the record's `finished_at_unix` minus the grant's
    `granted`. The grant follows the switch by milliseconds, so the true offset gathers most
    candidates within 50 ms (equal durations can pair a record with another grant): the median
    of the largest such cluster."""
    cands = sorted(r["finished_at_unix"] - e["granted"] for r in records if r["ok"] for e in events
                   if e["job"] == r["to_job"] and e.get("switch_seconds", 0) > 0
                   and abs(e["switch_seconds"] - r["checkpoint_seconds"] - r["restore_seconds"]) < 1e-3)
    if not cands:
        return None
    best = max((tuple(c2 for c2 in cands if abs(c2 - c) <= 0.05) for c in cands), key=len)
    return statistics.median(best)


def _job_order(job: str) -> tuple[str, int]:
    """Row order: job-2 before job-10."""
    head, _, tail = job.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (job, -1)


def _title(title: str, result: Mapping[str, Any]) -> str:
    """The title, and under it the machine (its first GPU, else its kind) and the date, when known."""
    machine = result.get("machine") if isinstance(result.get("machine"), dict) else {}
    where = ((machine.get("gpus") or [""])[0].split(",")[0] or machine.get("hostname_kind", "")).strip()
    when = result.get("measured_at", "")
    return "\n".join([title, ", ".join(x for x in (where, when) if x)]) if where or when else title


def off_gpu(spans: Sequence[Span]) -> dict[str, list[tuple[float, float]]]:
    """Per job, the intervals its GPU state was away: from the start of each checkpoint to
    the end of its next restore (open-ended when none follows)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for ck in (s for s in spans if s.kind == "checkpoint"):
        back = min((s.end for s in spans if s.job == ck.job and s.kind == "restore" and s.end > ck.end),
                   default=float("inf"))
        out.setdefault(ck.job, []).append((ck.start, back))
    return out


def _minus(span: Span, gaps: Sequence[tuple[float, float]]) -> list[Span]:
    """`span` without the intervals in `gaps`."""
    pieces = [(span.start, span.end)]
    for g0, g1 in gaps:
        pieces = [p for a, b in pieces for p in ((a, min(b, g0)), (max(a, g1), b)) if p[1] > p[0]]
    return [Span(span.job, span.kind, a, b, span.label, span.bytes) for a, b in pieces]


def _timeline(title: str, jobs: list[str], raw: list[Span], notes: list[str]) -> Timeline:
    """Cut compute spans where the job's state was off the GPU (a preempted holder is frozen
    and checkpointed mid-phase: its phase goes on in wall time, its computing does not), shift
    to start at 0, drop empty spans, sort by start."""
    away = off_gpu(raw)
    raw = [p for s in raw for p in (_minus(s, away.get(s.job, ())) if s.kind == "compute" else [s])]
    t0 = min((s.start for s in raw), default=0.0)
    spans = sorted((Span(s.job, s.kind, s.start - t0, s.end - t0, s.label, s.bytes) for s in raw if s.end > s.start),
                   key=lambda s: (s.start, KINDS.index(s.kind)))
    return Timeline(title, jobs, spans, notes)


# Colours (matplotlib's tab palette); compute spans of a labelled kind take the kind's colour.
COLORS = {"wait": "#d9d9d9", "hold": "#aec7e8", "compute": "#1f77b4", "checkpoint": "#d62728", "restore": "#2ca02c",
          "failed": "#000000"}
PHASE_COLORS = {"generate": "#1f77b4", "train": "#9467bd", "hash": "#17becf"}
NAMES = {"wait": "waiting for the lock", "hold": "holding the lock", "compute": "computing (GPU phase)",
         "checkpoint": "checkpoint (off the GPU)", "restore": "restore (onto the GPU)", "failed": "failed switch"}


def require_matplotlib() -> None:
    """Import matplotlib now (a command can then fail before it starts work). Raises
    ModuleNotFoundError (name 'matplotlib') when the `plot` extra is not installed."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 10**8 else f"{n / 1e6:.0f} MB"


def draw(panels: Sequence[Timeline], path: str | Path) -> None:
    """Render `panels` (one subplot each, stacked) into `path` (PNG unless its suffix names
    another format matplotlib writes). Raises ModuleNotFoundError without matplotlib, OSError
    when `path` cannot be written."""
    require_matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [max(1.5, 0.55 * len(t.jobs) + 0.9) for t in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    used: dict[str, str] = {}
    for ax, t in zip(axes[:, 0], panels):
        rows = {job: i for i, job in enumerate(t.jobs)}
        for s in t.spans:
            y, width = rows[s.job], s.end - s.start
            if s.kind in SWITCH_KINDS:  # a thin bar under the job's phases
                box, color = (y + 0.2, 0.2), COLORS[s.kind]
            elif s.kind == "wait":
                box, color = (y - 0.1, 0.2), COLORS[s.kind]
            else:
                box, color = (y - 0.3, 0.5), PHASE_COLORS.get(s.label, COLORS[s.kind]) if s.kind == "compute" \
                    else COLORS[s.kind]
            ax.broken_barh([(s.start, width)], box, facecolors=color, linewidth=0)
            name = f"computing: {s.label}" if s.kind == "compute" and s.label else NAMES[s.kind]
            used.setdefault(name, color)
            if s.bytes and width >= 0.04 * max(t.seconds, 1e-9):  # room for a label
                ax.text(s.start + width / 2, y + 0.5, _size(s.bytes), ha="center", va="bottom", fontsize=7)
        ax.set_yticks(range(len(t.jobs)), t.jobs)
        ax.set_ylim(len(t.jobs) - 0.35, -0.45)
        ax.set_xlim(0, t.seconds * 1.01 or 1)
        ax.set_xlabel("seconds")
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(t.title + "".join(f"\n({n})" for n in t.notes), fontsize=9, loc="left")
        if not t.spans:
            ax.text(0.5, 0.5, "nothing recorded", transform=ax.transAxes, ha="center", va="center")
    if used:
        fig.legend(handles=[Patch(color=c, label=n) for n, c in used.items()], loc="lower center",
                   ncol=min(len(used), 4), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))  # the legend: the bottom 0.45 inch
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
