#!/usr/bin/env python3
"""Type-check the orchestrator and the node agent with mypy (`make lint`).

The source folders are not laid out as the import names (pyproject.toml's
`[tool.setuptools] package-dir`: `timeslice` is client/, `timeslice.controller` is
controller/, ...), and the editable install resolves them with an import hook mypy does
not use. So this lays the packages out as they are imported, with symbolic links in a
temporary folder, runs mypy there, and prints its findings with the repository's paths.

    python hack/typecheck.py            # exit status: mypy's
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["timeslice.controller.orchestrator", "timeslice.kubelet_plugin.agent"]


def lay_out(into: Path) -> dict[str, str]:
    """Link each package folder of `package-dir` at its import path under `into`; returns
    {path under `into`: repository path} prefixes, longest first (to map findings back)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    back: dict[str, str] = {}
    for name, folder in sorted(dirs.items()):  # parents before children
        target = into.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in (ROOT / folder).iterdir():
            if not (target / entry.name).exists() and entry.name not in dirs.values():
                (target / entry.name).symlink_to(entry)
        back[f"{target.relative_to(into)}/"] = f"{folder}/"
    return dict(sorted(back.items(), key=lambda kv: -len(kv[0])))


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="timeslice-typecheck-") as tmp:
        back = lay_out(Path(tmp))
        args = [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-error-summary",
                *(a for p in PACKAGES for a in ("-p", p))]
        proc = subprocess.run(args, cwd=tmp, capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        for mine, theirs in back.items():
            if line.startswith(mine):
                line = theirs + line[len(mine):]
                break
        print(line)
    if proc.returncode == 0:
        print(f"mypy: no issues in {', '.join(PACKAGES)}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
