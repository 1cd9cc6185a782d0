"""ResourceSlice bodies for one node: pure functions from `GpuInfo`s to API JSON.

Owned by the kubelet plugin; `SlicePublisher` (slice_publisher.py) writes what these
build, and tests call them directly. No I/O here: the same input gives the same output.

Bodies are `resource.k8s.io/v1` objects in API JSON form (camelCase keys, quantities as
strings), facts from reference/dra-protocol.md section 3.1:

- one pool per node, named after the node; `spec.nodeName` = node; an ownerReference
  to the Node (`controller: true`) so the garbage collector removes the slices with it;
- at most 128 devices per slice (`ResourceSliceMaxDevices`); more are split over
  several slices, all with the pool's one `generation` and `resourceSliceCount`;
- device names are DNS labels unique in the pool; attribute and capacity names are C
  identifiers (<= 32 characters) in the driver's implicit domain, at most 32 per
  device; string and version values are at most 64 characters, versions are semver.

Two sharing modes (DESIGN.md, "Devices and claims"):

- `seats` (default): each GPU is K devices `gpu-<i>-seat-<k>`, published seat-major
  (`gpu-0-seat-0, gpu-1-seat-0, ..., gpu-0-seat-1, ...`): the allocator is first-fit
  over this order, so independent claims spread over idle GPUs before they share one.
  The order holds within a slice and across slices when the consumer keeps slice-name
  order (names end in a zero-padded slice index).
- `consumable`: one device `gpu-<i>` per GPU with `allowMultipleAllocations: true`
  (KEP-5075, gate `DRAConsumableCapacity`). Its `memory` capacity has a request policy
  whose default is 0: a claim that asks for no memory consumes none, so any number of
  time-sliced claims share the GPU; a claim may reserve memory (1 MiB steps, up to the
  GPU's size) and the scheduler keeps the sum of reservations within the GPU.

Every device carries the physical GPU's attributes: `uuid`, `index`, `productName`,
`architecture`, `cudaComputeCapability` and `driverVersion` (semver versions, so CEL can
compare them), `fake`, and `physicalGpu` (the GPU's uuid: two devices are the same GPU
iff their `physicalGpu` is equal); seats add `seat`. Capacity `memory` is the GPU's
memory in bytes.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Sequence
from typing import Any

from timeslice.driver.names import DRIVER_NAME
from timeslice.kubelet_plugin.devices import GpuInfo

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"

SEATS = "seats"
CONSUMABLE = "consumable"
SHARING_MODES = (SEATS, CONSUMABLE)
DEFAULT_SEATS_PER_GPU = 4

MAX_DEVICES_PER_SLICE = 128          # ResourceSliceMaxDevices
MAX_ATTRIBUTES_AND_CAPACITIES = 32   # per device
MAX_ATTRIBUTE_VALUE_LENGTH = 64      # DeviceAttributeMaxValueLength
MEMORY_STEP_BYTES = 1 << 20          # consumable memory is reserved in MiB steps

Device = dict[str, Any]
Slice = dict[str, Any]

_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# semver 2.0.0 (semver.org's regular expression), as the API server checks versions.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$")
_ATTRIBUTE_TYPES = ("int", "bool", "string", "version")


def semver(version: str) -> str:
    """A dotted numeric version as semver: "9.0" -> "9.0.0", "580.159.04" -> "580.159.4".

    NVIDIA driver versions carry leading zeros, which semver forbids; numbers keep their
    value. Raises ValueError for anything but 1 to 3 dot-separated numbers.
    """
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"version {version!r} is not 1 to 3 dot-separated numbers")
    return ".".join(str(int(p)) for p in [*parts, "0", "0"][:3])


def gpu_name(index: int) -> str:
    return f"gpu-{index}"


def seat_name(index: int, seat: int) -> str:
    return f"gpu-{index}-seat-{seat}"


def gpu_attributes(gpu: GpuInfo) -> dict[str, dict[str, Any]]:
    """The attributes every device of `gpu` carries (names in the driver's domain)."""
    return {
        "uuid": {"string": gpu.uuid},
        "physicalGpu": {"string": gpu.uuid},
        "index": {"int": gpu.index},
        "productName": {"string": gpu.product_name},
        "architecture": {"string": gpu.architecture},
        "cudaComputeCapability": {"version": semver(gpu.cuda_compute_capability)},
        "driverVersion": {"version": semver(gpu.driver_version)},
        "fake": {"bool": gpu.fake},
    }


def seat_devices(gpus: Sequence[GpuInfo], seats_per_gpu: int = DEFAULT_SEATS_PER_GPU) -> list[Device]:
    """K seats per GPU, seat-major: every GPU's seat 0 first, then every seat 1, ..."""
    if seats_per_gpu < 1:
        raise ValueError(f"seats per GPU must be at least 1, not {seats_per_gpu}")
    ordered = sorted(gpus, key=lambda g: g.index)
    return [{"name": seat_name(g.index, k),
             "attributes": {**gpu_attributes(g), "seat": {"int": k}},
             "capacity": {"memory": {"value": str(g.memory_bytes)}}}
            for k in range(seats_per_gpu) for g in ordered]


def consumable_devices(gpus: Sequence[GpuInfo]) -> list[Device]:
    """One shareable device per GPU (KEP-5075); claims consume no memory unless they ask.
    Each is seat 0 of its GPU (its only seat), so the distinct-GPU constraints of `seats`
    mode (`matchAttribute` on `seat`, a `seat == 0` selector) hold in this mode too: a claim
    written for one mode is allocatable in the other (issue 12, item 10)."""
    devices = []
    for g in sorted(gpus, key=lambda g: g.index):
        reservable = g.memory_bytes - g.memory_bytes % MEMORY_STEP_BYTES  # max: a multiple of step
        devices.append({
            "name": gpu_name(g.index),
            "allowMultipleAllocations": True,
            "attributes": {**gpu_attributes(g), "seat": {"int": 0}},
            "capacity": {"memory": {
                "value": str(g.memory_bytes),
                "requestPolicy": {"default": "0", "validRange": {
                    "min": "0", "max": str(reservable), "step": str(MEMORY_STEP_BYTES)}},
            }},
        })
    return devices


def build_devices(gpus: Sequence[GpuInfo], mode: str = SEATS,
                  seats_per_gpu: int = DEFAULT_SEATS_PER_GPU) -> list[Device]:
    """The devices of `gpus` in sharing `mode` ("seats" or "consumable"), in publish order."""
    if mode == SEATS:
        return seat_devices(gpus, seats_per_gpu)
    if mode == CONSUMABLE:
        return consumable_devices(gpus)
    raise ValueError(f"sharing mode {mode!r}: expected one of {', '.join(SHARING_MODES)}")


def is_qualified_name(name: str) -> bool:
    """API QualifiedName: a C identifier (<= 32), optionally `<DNS subdomain <= 63>/` first."""
    domain, sep, ident = name.rpartition("/")
    if sep and not (len(domain) <= 63 and _DNS_SUBDOMAIN.match(domain)):
        return False
    return len(ident) <= 32 and bool(_C_IDENTIFIER.match(ident))


def check_device(device: Device) -> None:
    """Raise ValueError naming the first rule of the API server's validation `device` breaks.

    Covers what this module can get wrong: the name, attribute and capacity names, their
    number, attribute value types and lengths, semver versions.
    """
    name = device.get("name", "")
    if not (len(name) <= 63 and _DNS_LABEL.match(name)):
        raise ValueError(f"device name {name!r} is not a DNS label")
    attributes, capacity = device.get("attributes", {}), device.get("capacity", {})
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise ValueError(f"device {name}: {len(attributes) + len(capacity)} attributes and capacities, "
                         f"more than {MAX_ATTRIBUTES_AND_CAPACITIES}")
    for key in [*attributes, *capacity]:
        if not is_qualified_name(key):
            raise ValueError(f"device {name}: {key!r} is not a qualified name (C identifier of at most 32)")
    for key, value in attributes.items():
        set_types = [t for t in _ATTRIBUTE_TYPES if value.get(t) is not None]
        if len(set_types) != 1 or set(value) != set(set_types):
            raise ValueError(f"device {name}: attribute {key} must set exactly one of "
                             f"{', '.join(_ATTRIBUTE_TYPES)}: {value}")
        kind, v = set_types[0], value[set_types[0]]
        expected = {"int": int, "bool": bool, "string": str, "version": str}[kind]
        if not isinstance(v, expected) or (kind == "int" and isinstance(v, bool)):
            raise ValueError(f"device {name}: attribute {key} {kind} has the wrong type: {v!r}")
        if kind in ("string", "version") and len(v) > MAX_ATTRIBUTE_VALUE_LENGTH:
            raise ValueError(f"device {name}: attribute {key} is longer than {MAX_ATTRIBUTE_VALUE_LENGTH}")
        if kind == "version" and not _SEMVER.match(v):
            raise ValueError(f"device {name}: attribute {key} {v!r} is not a semver version")


def check_devices(devices: Sequence[Device]) -> None:
    """`check_device` for each, and no device name twice in the pool; raises ValueError."""
    seen: set[str] = set()
    for d in devices:
        check_device(d)
        if d["name"] in seen:
            raise ValueError(f"device name {d['name']} appears twice in the pool")
        seen.add(d["name"])


def slice_name(node: str, index: int, driver: str = DRIVER_NAME) -> str:
    """`<node>-<driver>-<index, 3 digits>`; a node name too long for the 253 characters of an
    object name is cut and completed with a hash of it."""
    suffix = f"-{driver}-{index:03d}"
    if len(node) + len(suffix) <= 253:
        return node + suffix
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    head = node[:253 - len(suffix) - len(digest) - 1].rstrip(".-")
    return f"{head}-{digest}{suffix}"


def owner_reference(node: str, node_uid: str) -> dict[str, Any]:
    """The Node as controlling owner: the slices are deleted with the Node object."""
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}


def build_slices(node: str, node_uid: str, devices: Sequence[Device], generation: int, *,
                 driver: str = DRIVER_NAME, max_devices: int = MAX_DEVICES_PER_SLICE) -> list[Slice]:
    """The node's pool as ResourceSlice bodies: `devices` in order, `max_devices` per slice,
    at least one slice (an empty pool is still a pool), one generation and slice count.

    Raises ValueError for a device the API server would reject, a duplicate device name,
    a generation below 1, or an empty node name or uid.
    """
    if not node or not node_uid:
        raise ValueError("node name and uid are required (the uid makes the owner reference)")
    if generation < 1:
        raise ValueError(f"generation must be at least 1, not {generation}")
    if not 1 <= max_devices <= MAX_DEVICES_PER_SLICE:
        raise ValueError(f"max devices per slice must be 1..{MAX_DEVICES_PER_SLICE}, not {max_devices}")
    check_devices(devices)
    chunks = [list(devices[i:i + max_devices]) for i in range(0, len(devices), max_devices)] or [[]]
    return [{
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": slice_name(node, i, driver), "ownerReferences": [owner_reference(node, node_uid)]},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
            "devices": copy.deepcopy(chunk),
        },
    } for i, chunk in enumerate(chunks)]
