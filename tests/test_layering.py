"""The layering of DESIGN.md / STYLE.md, checked on the imports of every module.

- client/ (timeslice, timeslice.v1) imports no other timeslice package;
- kubelet_plugin/ and controller/ import driver/ and the stubs, never each other;
- driver/ imports no component;
- only cli/ (the composition root) may import everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "client": ("timeslice.driver", "timeslice.controller", "timeslice.kubelet_plugin", "timeslice.cli"),
    "driver": ("timeslice.controller", "timeslice.kubelet_plugin", "timeslice.cli"),
    "kubelet_plugin": ("timeslice.controller", "timeslice.cli"),
    "controller": ("timeslice.kubelet_plugin", "timeslice.cli"),
}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layering(folder: str) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(ROOT)} imports {name}" for f in files for name in sorted(imports(f))
           if any(name == p or name.startswith(p + ".") for p in FORBIDDEN[folder])]
    assert not bad, "\n".join(bad)


def test_every_module_has_a_docstring() -> None:
    missing = [str(f.relative_to(ROOT)) for folder in (*FORBIDDEN, "cli") for f in (ROOT / folder).rglob("*.py")
               if "/v1/" not in str(f) and f.stat().st_size and ast.get_docstring(ast.parse(f.read_text())) is None]
    assert not missing, missing
