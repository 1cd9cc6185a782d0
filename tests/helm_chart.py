"""Render the Helm chart (manifests/helm/timeslice-dra) and compare it with kustomize's objects.

Shared by tests/test_helm_chart.py (defaults == manifests/base) and e2e/test_helm.py (the local
values == hack/local-driver, then installed for real). helm is hack/helm.sh: the version pinned
in hack/versions.env, built with `go install` on first use.

Objects are compared after parsing the YAML, keyed by (apiVersion, kind, namespace, name): the
order of objects and of mapping keys does not count; list order does (a container's command,
env). Nothing is normalised away: the chart adds no labels or annotations of its own.
"""

from __future__ import annotations

import difflib
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "manifests" / "helm" / "timeslice-dra"
BASE = ROOT / "manifests" / "base"
HELM = ROOT / "hack" / "helm.sh"
LOCAL_VALUES = ROOT / "hack" / "local-helm-values.yaml"
# helm template checks Chart.yaml's kubeVersion against this (no cluster is asked): the local cluster's
KUBE_VERSION = next(line.split("=", 1)[1].strip() for line in (ROOT / "hack" / "versions.env").read_text().splitlines()
                    if line.startswith("K8S_VERSION="))
# first use builds helm (about 1 min with warm Go caches, several cold): seconds
BUILD_TIMEOUT = 1800

Key = tuple[str, str, str, str]


class RenderError(AssertionError):
    """helm template failed; the message carries helm's stderr."""


def helm(*args: str, timeout: float = BUILD_TIMEOUT,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run hack/helm.sh with `args` (environment `env`, default ours); returns the finished
    process (not checked)."""
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(env) if env is not None else None)


def render(chart: Path = CHART, values: Iterable[Path] = (), sets: Iterable[str] = ()) -> list[dict]:
    """`helm template` of `chart` with values files and `--set` pairs; the objects it renders.
    Raises RenderError with helm's message when helm refuses the values."""
    args = ["template", "timeslice-dra", str(chart), "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["--values", str(v)]
    for s in sets:
        args += ["--set", s]
    p = helm(*args)
    if p.returncode != 0:
        raise RenderError(f"helm {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return [o for o in yaml.safe_load_all(p.stdout) if o]


def kustomization_resources(directory: Path = BASE) -> list[dict]:
    """The objects of a kustomization that only lists `resources` (files): what kustomize builds
    from it is those files' objects, unchanged. Raises AssertionError if it does more
    (patches, labels, images, components...): then this reading is no longer kustomize's."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    extra = set(kust) - {"apiVersion", "kind", "resources"}
    assert not extra, (f"{directory}/kustomization.yaml uses {sorted(extra)}: tests/helm_chart.py reads it as a "
                       "plain list of files; compare with `kubectl kustomize` output instead")
    objs: list[dict] = []
    for res in kust["resources"]:
        path = directory / res
        assert path.is_file(), f"{path}: a resource that is not a file (a directory or a URL) is not read here"
        objs += [o for o in yaml.safe_load_all(path.read_text()) if o]
    return objs


def key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", ""))


def by_key(objs: Iterable[dict], what: str) -> dict[Key, dict]:
    out: dict[Key, dict] = {}
    for o in objs:
        assert key(o) not in out, f"{what}: {key(o)} twice"
        out[key(o)] = o
    return out


def differences(chart_objs: Iterable[dict], kustomize_objs: Iterable[dict]) -> list[str]:
    """One entry per object that is only on one side or differs (a unified diff of both as YAML);
    [] when the two sets of objects are equal."""
    a, b = by_key(chart_objs, "chart"), by_key(kustomize_objs, "kustomize")
    out = [f"only in the chart: {k}" for k in sorted(a.keys() - b.keys())]
    out += [f"only in kustomize: {k}" for k in sorted(b.keys() - a.keys())]
    for k in sorted(a.keys() & b.keys()):
        if a[k] != b[k]:
            diff = difflib.unified_diff(yaml.safe_dump(b[k], sort_keys=True).splitlines(),
                                        yaml.safe_dump(a[k], sort_keys=True).splitlines(),
                                        "kustomize", "chart", lineterm="")
            out.append(f"{k} differs:\n" + "\n".join(diff))
    return out
