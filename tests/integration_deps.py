"""Import a framework an integration test needs: skip the test without it, except under
`make unit` / `make unit-all`, which install the `integrations-test` extra and set
TIMESLICE_TEST_INTEGRATIONS=required so that a missing framework fails instead."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def need(module: str) -> ModuleType:
    if os.environ.get("TIMESLICE_TEST_INTEGRATIONS") == "required":
        return importlib.import_module(module)
    return pytest.importorskip(module)
