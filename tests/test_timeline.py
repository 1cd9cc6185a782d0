"""Timeline pictures (cli/timeline.py): `timeslice demo --plot`, `timeslice plot`, bench/rl_grpo.py's
results. The demo runs as a user runs it (real orchestrator, agent and job processes); the image is
checked as a PNG a viewer opens; the extraction is checked on that run and on committed results."""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from timeslice.cli import timeline
from timeslice.cli.timeline import Span, Timeline
from timeslice.driver.names import install_hint

from bench import rl_grpo

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def timeslice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "timeslice.cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def without_matplotlib(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a Python whose `import matplotlib` fails (None in sys.modules: Python's
    import system raises ModuleNotFoundError, as on a host without the package)."""
    return subprocess.run([sys.executable, "-c", f"import sys; sys.modules['matplotlib'] = None\n{code}"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def assert_png(path: Path) -> None:
    """A PNG of a sensible size that shows something: several colours, the compute colour among them."""
    with Image.open(path) as img:
        assert img.format == "PNG"
        w, h = img.size
        assert 800 <= w <= 3000 and 200 <= h <= 3000, img.size
        colors = img.convert("RGB").getcolors(maxcolors=1 << 16) or []
    assert len(colors) > 8
    assert any(c == (0x1F, 0x77, 0xB4) for _, c in colors)  # COLORS["compute"]


def assert_sane(t: Timeline) -> None:
    """Spans sorted by start, each on a known row, none inverted; two jobs never hold the lock
    at once (one group, no preemption in these runs)."""
    assert [s.start for s in t.spans] == sorted(s.start for s in t.spans)
    assert all(s.job in t.jobs and s.end > s.start >= 0 for s in t.spans)
    holds = sorted((s for s in t.spans if s.kind == "hold"), key=lambda s: s.start)
    for a, b in itertools.pairwise(holds):
        assert a.job == b.job or a.end <= b.start + 1e-6, (a, b)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """`timeslice demo --plot` with the freeze backend (real switches), short phases: (result, image)."""
    png = tmp_path_factory.mktemp("plot") / "timeline.png"
    r = timeslice("demo", "--jobs", "2", "--rounds", "2", "--backend", "freeze", "--gen-seconds", "0.05",
                  "--reward-seconds", "0.05", "--json", "--plot", str(png))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return json.loads(r.stdout), png


def test_demo_plot_writes_a_png(demo: tuple[dict[str, Any], Path]) -> None:
    assert_png(demo[1])


def test_demo_timeline_rows_phases_and_switches(demo: tuple[dict[str, Any], Path]) -> None:
    result, _ = demo
    [t] = timeline.timelines(result)
    assert t.jobs == ["shared-job-0", "shared-job-1"] and not t.notes  # the demo records its clock offset
    assert_sane(t)
    for job in t.jobs:  # per round: wait, then hold, the compute inside the hold
        holds, computes = t.of(job, "hold"), t.of(job, "compute")
        assert len(holds) == len(computes) == 2
        assert all(h.start <= c.start and c.end <= h.end for h, c in zip(holds, computes))
        assert all(w.end <= h.start + 1e-6 for w, h in zip(t.of(job, "wait"), holds))
    # every switch is drawn: a freeze backend checkpoints the previous holder before each grant
    records = [r for r in result["switch_records"] if r["ok"]]
    assert result["switches"] == len(records) >= 2
    assert len(t.of("shared-job-0", "checkpoint") + t.of("shared-job-1", "checkpoint")) == sum(
        bool(r["evicted"]) for r in records)
    for s in (s for s in t.spans if s.kind == "checkpoint"):  # before the next holder's grant
        others = [h for h in t.spans if h.kind == "hold" and h.job != s.job and h.start >= s.end - 1e-6]
        assert others and min(h.start for h in others) - s.end < 1.0, s


@pytest.mark.parametrize("name", ["demo-cpu-2core.json", "interleave-60gb-h200.json", "preempt-cuda-h200.json"])
def test_committed_demo_results_line_switches_up_with_grants(name: str) -> None:
    """Results written before the demo recorded its clock offset: the estimate puts each
    switch's end just before the grant that reported it (within 50 ms)."""
    result = json.loads((RESULTS / name).read_text())
    [t] = timeline.timelines(result)
    assert t.notes == ["switch times estimated from the grants that followed them"]
    t0 = min(e["acquire"] for e in result["timeline"])
    ends = sorted(s.end for s in t.spans if s.kind in ("checkpoint", "restore"))
    switched = [e["granted"] - t0 for e in result["timeline"] if e["switch_seconds"] > 0]
    assert switched and all(any(-0.001 <= g - end < 0.05 for end in ends) for g in switched)
    if name != "preempt-cuda-h200.json":  # a preempted holder's hold overlaps the next one
        assert_sane(t)
    if name == "interleave-60gb-h200.json":
        assert {s.bytes for s in t.spans if s.kind in ("checkpoint", "restore")} == {0, 60813213696}  # 0: an exited job


def test_a_preempted_holders_compute_stops_while_it_is_off_the_gpu() -> None:
    t = timeline._timeline("t", ["a"], [Span("a", "compute", 0, 10), Span("a", "checkpoint", 2, 3),
                                        Span("a", "restore", 6, 7)], [])
    assert [(s.start, s.end) for s in t.of("a", "compute")] == [(0, 2), (7, 10)]


def rl_job(seed: int, t0: float, gpu: float) -> dict[str, Any]:
    """A job's result as bench/rl_job.py prints it: 2 steps of generate and train, unix seconds."""
    phases, t = [], t0
    for step, kind in itertools.product(range(2), ("generate", "train")):
        phases.append({"kind": kind, "step": step, "acquire": t, "granted": t + gpu, "done": t + 2 * gpu,
                       "released": t + 2 * gpu + 0.001})
        t += 4 * gpu
    return {"seed": seed, "params": 10, "param_hash": "h", "extra_ok": True, "phases": phases, "total_seconds": t - t0,
            "startup_seconds": 0.5, "gpu_busy_seconds": 4 * gpu, "peak_allocated_bytes": 1000, "wall_seconds": t - t0}


def test_rl_grpo_results_carry_job_phases_that_draw() -> None:
    """bench/rl_grpo.py's summary keeps each job's phases; the timeline has one row per job,
    compute spans labelled by phase kind, and the switch's bytes."""
    a = argparse.Namespace(residency="auto", headroom="10%", resident_first=30.0, jobs=2, size="tiny", steps=2,
                           batch=4, new_tokens=8, reward_seconds=0.1, extra_gb=0.0, pool_gb=0.0, nproc=1,
                           nccl_transparent=False, device="cpu")
    jobs = [rl_job(0, 1000.0, 1.0), rl_job(1, 1002.0, 1.0)]
    # job-0 out, job-1 in before job-1's first grant; job-0 back in (job-1 stays) before job-0's second
    switches = [{"from_job": "job-0", "to_job": "job-1", "ok": True, "error": "", "checkpoint_seconds": 0.3,
                 "restore_seconds": 0.2, "bytes_checkpointed": 5 * 10**9, "bytes_restored": 4 * 10**9,
                 "finished_at_unix": 1003.0, "evicted": ["job-0"], "unreachable": False, "seconds": 0.5},
                {"from_job": None, "to_job": "job-0", "ok": True, "error": "", "checkpoint_seconds": 0.0,
                 "restore_seconds": 0.3, "bytes_checkpointed": 0, "bytes_restored": 5 * 10**9,
                 "finished_at_unix": 1004.9, "evicted": [], "unreachable": False, "seconds": 0.3}]
    run = {"mode": "serve", "backend": "cooperative", "seconds": 20.0, "servers_ready_seconds": 1.0,
           "jobs": [rl_grpo.JobRun(f"job-{j['seed']}", j["seed"], 100 + j["seed"], 0, j, Path("/dev/null"))
                    for j in jobs],
           "switches": switches, "status": [], "status_read_errors": 0, "group_config": {}, "declared_memory": {},
           "host_memory": {},
           "commands": [], "job_ids": {}, "servers": [], "logs": {}}
    result = rl_grpo.summarize(a, [rl_job(0, 0, 1.0), rl_job(1, 0, 1.0)], run)
    assert list(result["job_phases"]) == ["job-0", "job-1"]
    [t] = timeline.timelines(json.loads(json.dumps([result])))  # as written to --out
    assert t.jobs == ["job-0", "job-1"] and not t.notes
    assert [s.label for s in t.of("job-0", "compute")] == ["generate", "train"] * 2
    def spans(job: str, kind: str) -> list[tuple[float, float, int]]:
        return [(round(s.start, 6), round(s.end, 6), s.bytes) for s in t.of(job, kind)]

    assert spans("job-0", "checkpoint") == [(2.5, 2.8, 5 * 10**9)]
    assert spans("job-1", "restore") == [(2.8, 3.0, 4 * 10**9)]
    assert spans("job-0", "restore") == [(4.6, 4.9, 5 * 10**9)]
    assert spans("job-0", "compute") == [(1, 2, 0), (5, 6, 0), (9, 10, 0), (13, 14, 0)]
    assert_sane(t)


def test_committed_rl_grpo_result_without_phases_draws_its_switches(tmp_path: Path) -> None:
    [t] = timeline.load(RESULTS / "rl-grpo-b-h200.json")
    assert t.jobs == ["job-0", "job-1", "job-2"] and "switches only" in t.notes[0]
    records = json.loads((RESULTS / "rl-grpo-b-h200.json").read_text())[0]["switch_records"]
    assert len(t.of("job-0", "checkpoint", "restore") + t.of("job-1") + t.of("job-2")) == len(t.spans) == sum(
        len(r["evicted"]) + (r["restore_seconds"] > 0) for r in records)
    r = timeslice("plot", str(RESULTS / "rl-grpo-a-h200.json"), "-o", str(tmp_path / "a.png"))
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "a.png"), r.stderr
    with Image.open(tmp_path / "a.png") as img:  # two panels (cuda, cooperative), nothing switched
        assert img.format == "PNG" and img.size[1] > 300


def test_plot_command_draws_a_saved_demo_result(tmp_path: Path) -> None:
    r = timeslice("plot", str(RESULTS / "interleave-60gb-h200.json"), "-o", str(tmp_path / "i.png"))
    assert r.returncode == 0, r.stderr
    assert_png(tmp_path / "i.png")


@pytest.mark.parametrize(("content", "says"), [("{}", "not a result of `timeslice demo --json`"),
                                               ("[1", "not JSON"), ('{"timeline": [], "gen_seconds": 1}', "'jobs'"),
                                               ('{"timeline": 3, "gen_seconds": 1}', "expected shape")])
def test_plot_command_rejects_other_files_in_one_line(tmp_path: Path, content: str, says: str) -> None:
    (tmp_path / "r.json").write_text(content)
    r = timeslice("plot", str(tmp_path / "r.json"))
    assert r.returncode == 2 and says in r.stderr and r.stderr.startswith("timeslice plot: error: ")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "r.png").exists()


def test_demo_plot_into_a_missing_folder_fails_before_the_demo(tmp_path: Path) -> None:
    r = timeslice("demo", "--plot", str(tmp_path / "no" / "t.png"))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip() == (
        f"timeslice demo: error: --plot {tmp_path / 'no' / 't.png'}: the folder {tmp_path / 'no'} does not exist")


def test_without_matplotlib_the_commands_name_the_extra(tmp_path: Path) -> None:
    """One line with the pip command, exit 2, before any work (the demo does not start)."""
    fix = install_hint("plot")
    for argv in (["plot", str(RESULTS / "demo-cpu-2core.json")], ["demo", "--plot", str(tmp_path / "d.png")]):
        r = without_matplotlib(f"from timeslice.cli.main import main; sys.exit(main({argv!r}))")
        assert r.returncode == 2 and r.stderr.strip().endswith(fix), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    r = without_matplotlib(f"import runpy; sys.argv = ['rl_grpo.py', '--plot', {str(tmp_path / 'b.png')!r}]; "
                           "runpy.run_path('bench/rl_grpo.py', run_name='__main__')")
    assert r.returncode == 2 and r.stderr.strip() == f"rl_grpo.py: error: --plot needs matplotlib, which is not " \
                                                      f"installed: {fix}", r.stderr
    assert not list(tmp_path.iterdir())


def test_the_docs_pictures_exist() -> None:
    """The docs show a committed result drawn by `timeslice plot`, next to that result."""
    images = [(page.parent / path).resolve() for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
              for path in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page.read_text())]
    assert ROOT / "bench/results/interleave-60gb-h200.png" in images
    for path in images:
        assert_png(path)
        assert path.with_suffix(".json").exists()
