"""Job identity of a pod (DESIGN.md, "Lock groups and the orchestrator").

Owned by the controller; called by `grouping` (claim sets are keyed by job) and, for
authenticated callers, by the orchestrator (caller pod -> job). Pure functions on pod
objects in API JSON form (camelCase dicts); no I/O.

Which identity wins, first match:

1. the `job` of the claim's `TimeSliceConfig` (an override the caller passes in);
2. the pod label `timeslice.dev/job`;
3. the pod's controller owner (`ownerReferences[].controller: true`): Job, RayCluster,
   PyTorchJob, ... Two owners are lifted one level, because the direct owner is not the
   workload a user thinks of: a pod labelled `jobset.sigs.k8s.io/jobset-name` belongs to
   its JobSet (its direct owner is one child Job per replicated job, so a multi-node SPMD
   JobSet would otherwise split into several jobs), and a ReplicaSet named
   `<deployment>-<pod-template-hash>` stands for its Deployment (a rollout makes a new
   ReplicaSet; the job must not change with it);
4. the pod itself.

Id forms. Every id starts with the pod's namespace, so no namespace can name (and so
join the claim sets of) a job of another namespace:

    <namespace>/<name>          override or label (label values hold no "/")
    <namespace>/<kind>/<name>   controller owner; kind lower-cased: job, jobset, raycluster
    <namespace>/pod/<name>      the pod alone

Ids are orchestrator ids (`^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,252}$`, see
`controller/orchestrator/service.py`). One that would not be (too long, odd characters
in an override) is shortened deterministically by `safe_id`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from timeslice.driver import names

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,252}$")
MAX_ID_LENGTH = 253
_BAD_CHARS = re.compile(r"[^A-Za-z0-9._:/@-]")
_HASH_HEX = 16

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
POD_TEMPLATE_HASH_LABEL = "pod-template-hash"
# The only pod labels `job_id` reads (a cache of pods may keep just these).
IDENTITY_LABELS = (names.JOB_LABEL, JOBSET_NAME_LABEL, POD_TEMPLATE_HASH_LABEL)


def safe_id(raw: str) -> str:
    """`raw` when it is a valid orchestrator id; otherwise a valid id made of its sanitised
    prefix, "@" and 16 hex digits of its SHA-256 (same input, same output)."""
    if ID_PATTERN.fullmatch(raw):  # fullmatch: "$" alone would let a trailing newline through
        return raw
    digest = hashlib.sha256(raw.encode()).hexdigest()[:_HASH_HEX]
    prefix = _BAD_CHARS.sub("-", raw)[:MAX_ID_LENGTH - _HASH_HEX - 1].lstrip("._:/@-")
    return f"{prefix}@{digest}" if prefix else f"h@{digest}"


def controller_owner(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ownerReference marked `controller: true`, if any."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return ref  # type: ignore[no-any-return]
    return None


def job_id(pod: Mapping[str, Any], override: str | None = None) -> str:
    """The job `pod` belongs to, as an orchestrator id (module docstring: precedence, forms).

    `override` is the `job` of the `TimeSliceConfig` that applies to the claim through
    which the pod is seen; it is qualified with the pod's namespace like a label value.
    """
    meta = pod.get("metadata") or {}
    ns = meta.get("namespace") or "default"
    labels = meta.get("labels") or {}
    if override:
        return safe_id(f"{ns}/{override}")
    if labels.get(names.JOB_LABEL):
        return safe_id(f"{ns}/{labels[names.JOB_LABEL]}")
    owner = controller_owner(pod)
    if owner is not None and owner.get("kind") and owner.get("name"):
        kind, name = str(owner["kind"]), str(owner["name"])
        if labels.get(JOBSET_NAME_LABEL):
            kind, name = "JobSet", labels[JOBSET_NAME_LABEL]
        elif kind == "ReplicaSet" and labels.get(POD_TEMPLATE_HASH_LABEL):
            suffix = "-" + labels[POD_TEMPLATE_HASH_LABEL]
            if name.endswith(suffix) and len(name) > len(suffix):
                kind, name = "Deployment", name[:-len(suffix)]
        return safe_id(f"{ns}/{kind.lower()}/{name}")
    return safe_id(f"{ns}/pod/{meta.get('name', '')}")
