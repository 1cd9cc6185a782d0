#!/usr/bin/env python3
"""Controller at scale: N claims on M fake nodes; how soon a new allocation's group shows
in its claim's status.devices, and the controller's memory (needs $KUBECONFIG, admin).

Creates M fake Nodes (API objects only), one ResourceSlice of our driver per node (G fake
GPUs x 4 seats), then N claims, each with a pod bound to its node and the claim allocated
(status written as the scheduler would: allocation + reservedFor). Starts `timeslice
controller` (host process), waits until every claim shows its group, then allocates K new
claims one at a time and measures allocation -> `status.devices[].data.groupId` visible.

    python bench/controller_groups.py --claims 1000 --nodes 100 --out bench/results/controller-2core.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client, config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import emit

DRIVER = "gpu.timeslice.dev"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--claims", type=int, default=1000)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--gpus", type=int, default=3, help="fake GPUs per node (4 seats each)")
    p.add_argument("--new", type=int, default=50, help="new allocations measured one at a time")
    p.add_argument("--out")
    a = p.parse_args()
    config.load_kube_config()
    core, res = client.CoreV1Api(), client.ResourceV1Api()
    tag = uuid.uuid4().hex[:6]
    ns = f"bench-ctl-{tag}"
    nodes = [f"fake-{tag}-{i:03d}" for i in range(a.nodes)]
    seats = [f"gpu-{g}-seat-{s}" for s in range(4) for g in range(a.gpus)]
    core.create_namespace({"metadata": {"name": ns}})
    pool = ThreadPoolExecutor(16)
    controller = None
    try:
        def make_node(n: str) -> None:
            core.create_node({"metadata": {"name": n, "labels": {"timeslice.dev/bench": tag}}})
            res.create_resource_slice({"metadata": {"name": f"{n}-{DRIVER}"}, "spec": {
                "driver": DRIVER, "nodeName": n, "pool": {"name": n, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": d, "attributes": {
                    "physicalGpu": {"string": f"GPU-{n}-{d.split('-seat-')[0]}"}}} for d in seats]}})
        list(pool.map(make_node, nodes))

        def allocate(i: int) -> float:
            node, seat = nodes[i % a.nodes], seats[(i // a.nodes) % len(seats)]
            name = f"c{i}"
            res.create_namespaced_resource_claim(ns, {"metadata": {"name": name}, "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}})
            pod = core.create_namespaced_pod(ns, {
                "metadata": {"name": f"p{i}", "labels": {"timeslice.dev/job": f"j{i}"}},
                "spec": {"nodeName": node, "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                         "containers": [{"name": "c", "image": "none"}]}})
            t = time.monotonic()
            res.patch_namespaced_resource_claim_status(name, ns, {"status": {
                "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node,
                                                        "device": seat}]}},
                "reservedFor": [{"resource": "pods", "name": f"p{i}", "uid": pod.metadata.uid}]}})
            return t

        list(pool.map(allocate, range(a.claims)))
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-controller-{tag}.log", "ab")
        controller = subprocess.Popen([sys.executable, "-m", "timeslice.cli.main", "controller", "--listen",
                                       "127.0.0.1:0", "--default-backend", "none", "--log-level", "WARNING"],
                                      stdout=log, stderr=subprocess.STDOUT)

        def visible() -> set[str]:
            return {c.metadata.name for c in res.list_namespaced_resource_claim(ns).items
                    if any((d.data or {}).get("groupId") for d in (c.status.devices or []))}

        t0 = time.monotonic()
        while len(visible()) < a.claims:
            if time.monotonic() - t0 > 600:
                raise SystemExit("initial claims never all showed their group")
            time.sleep(1)
        initial = time.monotonic() - t0
        latencies = []
        for k in range(a.claims, a.claims + a.new):
            t = allocate(k)
            name = f"c{k}"
            while True:
                c = res.read_namespaced_resource_claim(name, ns)
                if any((d.data or {}).get("groupId") for d in (c.status.devices or [])):
                    latencies.append(time.monotonic() - t)
                    break
                time.sleep(0.02)
        result = {"benchmark": "controller_groups", "claims": a.claims, "nodes": a.nodes, "gpus_per_node": a.gpus,
                  "initial_all_visible_seconds": round(initial, 2), "new_allocations": a.new,
                  "visible_seconds_p50": round(pct(latencies, 50), 3),
                  "visible_seconds_p99": round(pct(latencies, 99), 3), "visible_seconds_max": round(max(latencies), 3),
                  "controller_rss_mib": round(rss_mib(controller.pid), 1),
                  "api_server": "local cluster (hack/local-cluster.sh)"}
        emit(result, a.out)
    finally:
        if controller is not None:
            controller.terminate()
            controller.wait()
        core.delete_namespace(ns)
        for n in nodes:
            for fn, arg in ((res.delete_resource_slice, f"{n}-{DRIVER}"), (core.delete_node, n)):
                try:
                    fn(arg)
                except client.ApiException:
                    pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
