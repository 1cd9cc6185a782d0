#!/usr/bin/env bash
# Create a kind cluster with NVIDIA GPUs and install timeslice-dra on it.
#   hack/kind-up.sh [image]     (default image: ghcr.io/timeslice-dra/timeslice:0.1.0)
# Needs: docker, kind >= 0.27, kubectl >= 1.34, the NVIDIA Container Toolkit configured
# with `nvidia-ctk runtime configure --runtime=docker --cdi.enabled` and
# `accept-nvidia-visible-devices-as-volume-mounts = true`. Not run in CI (no Docker there).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
image="${1:-ghcr.io/timeslice-dra/timeslice:0.1.0}"
for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "kind-up: $tool is not installed" >&2; exit 1; }
done
if ! kind get clusters 2>/dev/null | grep -qx timeslice; then
  kind create cluster --config "$root/hack/kind/cluster.yaml"
fi
docker build -t "$image" "$root"
kind load docker-image "$image" --name timeslice
kubectl apply -k "$root/manifests/base"
kubectl -n timeslice-system rollout status daemonset/timeslice-kubelet-plugin --timeout=180s
kubectl -n timeslice-system rollout status deployment/timeslice-controller --timeout=180s
echo "timeslice-dra is installed; run the example with: kubectl apply -k $root/manifests/examples/two-jobs-one-gpu"
