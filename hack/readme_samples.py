#!/usr/bin/env python3
"""Regenerate the README's sample `make demo` output from the committed measurement.

Usage: `python hack/readme_samples.py` rewrites the code block that follows the README line
naming `bench/results/demo-cpu-2core.json` with `timeslice.cli.demo.render` of that file;
`--check` exits 1 when the README differs (tests/test_readme.py). To measure again:
`timeslice demo --jobs 2 --json > bench/results/demo-cpu-2core.json` (then this script).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from timeslice.cli.demo import render

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULT = "bench/results/demo-cpu-2core.json"
BLOCK = re.compile(r"(\(`" + re.escape(RESULT) + r"`\):\n\n```\n)(.*?)(\n```)", re.S)


def regenerated(readme: str) -> str:
    """`readme` with its sample block rendered from the committed result. Raises ValueError
    when the README has no such block."""
    result = json.loads((ROOT / RESULT).read_text())
    new, n = BLOCK.subn(lambda m: m.group(1) + render(result) + m.group(3), readme, count=1)
    if n != 1:
        raise ValueError(f"README.md has no code block after a line naming `{RESULT}`")
    return new


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the README's sample is not current")
    a = p.parse_args()
    text = README.read_text()
    new = regenerated(text)
    if a.check:
        if new != text:
            print("README.md's demo sample differs from render(" + RESULT + "): run hack/readme_samples.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
