#!/usr/bin/env bash
# Run the e2e suite on a local single-node cluster: up (building what is not cached),
# pytest e2e/, and down even on failure. Needs root (kubelet, containerd).
#   hack/e2e.sh [pytest args]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${root}/.venv/bin/python"
[ -x "$py" ] || py=python3
logs="${TIMESLICE_LOG_DIR:-/var/log/timeslice-dra}"
# shellcheck disable=SC2154  # rc is assigned inside the trap
trap 'rc=$?; [ $rc -ne 0 ] && tail -n 40 "$logs"/*.log 2>/dev/null | tail -n 200; hack/local-cluster.sh down; exit $rc' EXIT
start=$(date +%s)
hack/local-cluster.sh up --wheels "${TIMESLICE_PY_WHEELS:-dist}"
echo "local cluster up in $(( $(date +%s) - start )) s"
eval "$(hack/local-cluster.sh env)"
"$py" -m pytest -q -p no:cacheprovider e2e "$@"
