#!/usr/bin/env python3
"""NodePrepareResources for a batch of claims against the real API server, as the kubelet
calls it, and the plugin's memory (needs a cluster in $KUBECONFIG, e.g. the local one).

Starts `timeslice kubelet-plugin` (fake GPUs, sockets in a temp dir, not registered with
the kubelet), creates N ResourceClaims allocated to N distinct seats of this node (status
written as the scheduler would), then calls NodePrepareResources with all N on the DRA
socket (v1) and times it; then NodeUnprepareResources; reads the plugin's VmRSS.

    python bench/prepare.py --claims 32 --out bench/results/prepare-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2 as pb  # noqa: E402
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2_grpc as pb_grpc  # noqa: E402

from bench.machine import emit  # noqa: E402

KUBECTL = os.environ.get("KUBECTL", "kubectl")


def kubectl(*args: str, input: str | None = None) -> str:
    return subprocess.run([KUBECTL, *args], input=input, capture_output=True, text=True, check=True).stdout


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--claims", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="prepare/unprepare rounds (fresh claims each)")
    p.add_argument("--node", default=os.environ.get("TIMESLICE_NODE_NAME", "127.0.0.1"))
    p.add_argument("--out")
    a = p.parse_args()
    gpus = (a.claims + 3) // 4
    tmp = Path(tempfile.mkdtemp(prefix="ts-bench-prepare-"))
    plugin = subprocess.Popen(
        [sys.executable, "-m", "timeslice.cli.main", "kubelet-plugin", "--node-name", a.node, "--fake-gpus",
         f"{gpus}xH200", "--state-dir", str(tmp / "state"), "--cdi-dir", str(tmp / "cdi"), "--plugin-data-dir",
         str(tmp / "plugin"), "--registry-dir", str(tmp / "registry"), "--agent-listen", "127.0.0.1:0",
         "--log-level", "WARNING"])
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    times, rss = [], []
    try:
        channel = grpc.insecure_channel(f"unix://{tmp / 'plugin' / 'dra.sock'}")
        stub = pb_grpc.DRAPluginStub(channel)
        grpc.channel_ready_future(channel).result(timeout=60)
        devices = [f"gpu-{i}-seat-{k}" for k in range(4) for i in range(gpus)][:a.claims]
        for rnd in range(a.rounds):
            refs = []
            for i, dev in enumerate(devices):
                name = f"c{rnd}-{i}"
                obj = json.loads(kubectl("create", "-n", ns, "-o", "json", "-f", "-", input=json.dumps({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                        "deviceClassName": "gpu.timeslice.dev"}}]}}})))
                kubectl("patch", "-n", ns, "resourceclaim", name, "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"allocation": {"devices": {"results": [{
                            "request": "gpu", "driver": "gpu.timeslice.dev", "pool": a.node, "device": dev}]}}}}))
                refs.append(pb.Claim(namespace=ns, uid=obj["metadata"]["uid"], name=name))
            t0 = time.perf_counter()
            resp = stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=refs), timeout=45)
            times.append(time.perf_counter() - t0)
            errors = [r.error for r in resp.claims.values() if r.error]
            assert not errors and len(resp.claims) == a.claims, errors[:3]
            stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=refs), timeout=45)
            rss.append(rss_kib(plugin.pid))
        channel.close()
    finally:
        plugin.terminate()
        plugin.wait()
        kubectl("delete", "namespace", ns, "--wait=false")
    result = {"benchmark": "prepare", "claims_per_batch": a.claims, "rounds": a.rounds,
              "prepare_seconds": [round(t, 4) for t in times], "prepare_seconds_max": round(max(times), 4),
              "plugin_rss_mib_max": round(max(rss) / 1024, 1), "api_server": "local cluster (hack/local-cluster.sh)"}
    emit(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
