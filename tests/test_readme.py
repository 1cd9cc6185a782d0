"""The README and docs/ say what is true (issue 12, item 14; issue 25): the README's sample
demo output is rendered from the committed measurement (hack/readme_samples.py) and carries
every field the demo prints now; the README stays a front door (at most 15 KB) that links
every docs page; in the README and every docs page the `make` targets and `timeslice`
commands named exist, relative links and the repository paths named resolve; the README's
headline gains are those of the committed H200 results."""

from __future__ import annotations

import glob
import json
import re
import sys
from pathlib import Path

import pytest
from timeslice.cli.demo import SUMMARY_KEYS
from timeslice.cli.main import parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "DESIGN.md", *DOCS]
sys.path.insert(0, str(ROOT / "hack"))

import readme_samples  # noqa: E402


def test_the_demo_sample_is_rendered_from_a_current_measurement() -> None:
    assert readme_samples.regenerated(README) == README, "run hack/readme_samples.py"
    result = json.loads((ROOT / readme_samples.RESULT).read_text())
    assert not [k for k in SUMMARY_KEYS if k not in result], "measure again: timeslice demo --jobs 2 --json"


def test_the_readme_is_a_front_door_that_links_every_docs_page() -> None:
    assert len(README.encode()) <= 15_000, len(README.encode())
    assert DOCS and not [p.name for p in DOCS if f"(docs/{p.name})" not in README]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_make_targets_and_commands_it_names_exist(page: Path) -> None:
    text = page.read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = {*re.findall(r"`make ([a-z][a-z0-9-]*)", text), *re.findall(r"^make ([a-z][a-z0-9-]*)", text, re.M)}
    assert not named - targets, named - targets
    subcommands = set(next(a for a in parser()._actions if a.dest == "command").choices)  # argparse's subparsers
    used = set(re.findall(r"`timeslice ([a-z][a-z-]*)", text)) | set(re.findall(r"^timeslice ([a-z][a-z-]*)",
                                                                              text, re.M))
    assert not used - subcommands, used - subcommands


def _expand(path: str) -> list[str]:
    """`a/{b,c}-*.json` -> the names it stands for ({} alternatives, then glob patterns)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m:
        return [x for alt in m.group(1).split(",") for x in _expand(path[:m.start()] + alt + path[m.end():])]
    return [path]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_links_and_repository_paths_it_names_exist(page: Path) -> None:
    text = page.read_text()
    missing = []
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not link.startswith(("http://", "https://", "mailto:")) and not (page.parent / link).exists():
            missing.append(link)
    tops = {p.name for p in ROOT.iterdir()} - {".git", ".venv", "build", "dist"}
    for path in re.findall(r"`([A-Za-z0-9_.{},*-]+/[A-Za-z0-9_./{},*-]*)`", text):
        if path.split("/")[0] not in tops:
            continue  # not a path of this repository (a module, an image, a URL path)
        for p in _expand(path.rstrip("/")):
            if not glob.glob(str(ROOT / p)):
                missing.append(p)
    assert not missing, missing


def test_the_readme_headline_gains_are_the_committed_results() -> None:
    results = ROOT / "bench" / "results"

    def gains(name: str) -> dict[str, str]:
        return {r["backend"]: f"{r['gain']:.2f}x" for r in json.loads((results / name).read_text()) if "gain" in r}

    a, a_undeclared = gains("rl-grpo-a-serve-declared-h200.json"), gains("rl-grpo-a-serve-54d3b80-h200.json")
    c_undeclared = gains("rl-grpo-c-serve-54d3b80-h200.json")
    huge = "rl-grpo-b-serve-cooperative-declared-hugepages-54d3b80"
    rows = {
        "2 x 19.7 GB (fit) | yes": [a["cuda"], gains("rl-grpo-a-serve-cooperative-declared-h200.json")["cooperative"]],
        "4 x 30 GB (fit) | yes": [gains("rl-grpo-c-serve-cooperative-declared-h200.json")["cooperative"]],
        "3 x 57.7 GB (two fit) | yes": [gains(f"{huge}-h200.json")["cooperative"],
                                        gains(f"{huge}-run2-h200.json")["cooperative"]],
        "2 x 19.7 GB | no": [a_undeclared["cuda"], a_undeclared["cooperative"]],
        "4 x 31.7 GB | no": [c_undeclared["cuda"], c_undeclared["cooperative"]],
    }
    for row, values in rows.items():
        line = next(line for line in README.splitlines() if line.startswith(f"| {row}"))
        assert all(v in line for v in values), (line, values)


def test_the_changelog_has_a_release_of_the_installed_version_in_keep_a_changelog_form() -> None:
    from importlib.metadata import version

    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert releases[0] == ("Unreleased", "") and releases[1][0] == version("timeslice-dra") and releases[1][1]
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        kinds = re.findall(r"^### (\w+)$", block, re.M)
        assert len(kinds) == len(set(kinds)) and set(kinds) <= {"Added", "Changed", "Deprecated", "Removed",
                                                                "Fixed", "Security"}, kinds


def _gains(value: object) -> list[float]:
    """Every `gain` in a committed result (a run, or a list or mapping of runs)."""
    if isinstance(value, dict):
        return [g for k, v in value.items() for g in ([v] if k == "gain" and isinstance(v, int | float) else _gains(v))]
    if isinstance(value, list):
        return [g for v in value for g in _gains(v)]
    return []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_table_rows_gain_is_one_its_result_file_holds(page: Path) -> None:
    """A table row that names a committed result (`rl-grpo-*.json`, ...) and a gain (`1.86x`)
    shows a gain of that file (rounded to the hundredth)."""
    wrong = []
    for row in page.read_text().splitlines():
        files, gains = re.findall(r"`([\w.-]+\.json)`", row), re.findall(r"(\d+\.\d+)x\b", row)
        if row.startswith("|") and files and gains and (ROOT / "bench" / "results" / files[0]).exists():
            held = _gains(json.loads((ROOT / "bench" / "results" / files[0]).read_text()))
            if not any(abs(float(gains[0]) - g) <= 0.0051 for g in held):
                wrong.append((files[0], gains[0], held))
    assert not wrong, wrong
