#!/usr/bin/env bash
# Local single-node Kubernetes for timeslice-dra e2e tests (see hack/README.md).
#   hack/local-cluster.sh up [--wheels DIR] | down | env | status | build | images
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
command -v "$py" >/dev/null 2>&1 || py=/usr/bin/python3
exec "$py" "$here/local_cluster.py" "$@"
