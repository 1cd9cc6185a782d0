"""The README says what is true (issue 12, item 14): its sample demo output is rendered from
the committed measurement (hack/readme_samples.py) and carries every field the demo prints
now, and the `make` targets and `timeslice` commands it names exist."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from timeslice.cli.demo import SUMMARY_KEYS
from timeslice.cli.main import parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "hack"))

import readme_samples  # noqa: E402


def test_the_demo_sample_is_rendered_from_a_current_measurement() -> None:
    assert readme_samples.regenerated(README) == README, "run hack/readme_samples.py"
    result = json.loads((ROOT / readme_samples.RESULT).read_text())
    assert not [k for k in SUMMARY_KEYS if k not in result], "measure again: timeslice demo --jobs 2 --json"


def test_the_make_targets_and_commands_it_names_exist() -> None:
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = {*re.findall(r"`make ([a-z][a-z0-9-]*)", README), *re.findall(r"^make ([a-z][a-z0-9-]*)", README, re.M)}
    assert named and not named - targets, named - targets
    subcommands = set(next(a for a in parser()._actions if a.dest == "command").choices)  # argparse's subparsers
    used = set(re.findall(r"`timeslice ([a-z][a-z-]*)", README)) | set(re.findall(r"^timeslice ([a-z][a-z-]*)",
                                                                                README, re.M))
    assert used and not used - subcommands, used - subcommands
