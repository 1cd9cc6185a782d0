#!/usr/bin/env bash
# helm at the version pinned in hack/versions.env (HELM_VERSION), built from source with
# `go install` through the Go module proxy on first use, like the local cluster's binaries
# (hack/README.md): no downloaded release binary. Then runs it with the arguments given.
#   hack/helm.sh lint manifests/helm/timeslice-dra
#   hack/helm.sh --path        # print the binary's path (building it if missing)
# $HELM overrides the binary (used as is). Cache: ${TIMESLICE_CACHE:-~/.cache/timeslice-dra}/helm-<version>/bin;
# Go's caches stay in their default places. Needs Go >= 1.24 (GOTOOLCHAIN=local: no toolchain download).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null  # KEY=VALUE lines
. "$here/versions.env"
version="${HELM_VERSION:?HELM_VERSION missing in hack/versions.env}"
home=~  # $HOME, or the passwd entry when HOME is unset (as Python's Path.home() in local_cluster.py)
bin="${TIMESLICE_CACHE:-$home/.cache/timeslice-dra}/helm-$version/bin"
helm="${HELM:-$bin/helm}"

reports_version() {
  [ -x "$1" ] && [ "$("$1" version --template '{{.Version}}' 2>/dev/null)" = "$version" ]
}

if [ -z "${HELM:-}" ] && ! reports_version "$helm"; then
  command -v go >/dev/null || { echo "hack/helm.sh: helm $version is not built and the go command is not in PATH" >&2; exit 1; }
  mkdir -p "$bin"
  # One build at a time (make lint and a test may both ask); the second finds the first's binary.
  exec 9>"$bin/.lock"
  flock 9
  if ! reports_version "$helm"; then
    echo "hack/helm.sh: building helm $version with go install (once; log: $bin/build.log)" >&2
    start=$(date +%s)
    # helm's own Makefile sets the version with this -X (internal/version.version); without it
    # `helm version` says only the minor version.
    if ! env GOTOOLCHAIN="${GOTOOLCHAIN:-local}" CGO_ENABLED=0 GOBIN="$bin" GOFLAGS=-mod=mod \
        go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$version" \
        "helm.sh/helm/v3/cmd/helm@$version" >"$bin/build.log" 2>&1; then
      tail -n 20 "$bin/build.log" >&2
      echo "hack/helm.sh: go install helm.sh/helm/v3/cmd/helm@$version failed (log: $bin/build.log)" >&2
      exit 1
    fi
    reports_version "$helm" || { echo "hack/helm.sh: the built $helm does not report $version" >&2; exit 1; }
    echo "hack/helm.sh: built helm $version in $(( $(date +%s) - start )) s" >&2
  fi
  exec 9>&-
fi
if [ "${1:-}" = "--path" ]; then
  echo "$helm"
  exit 0
fi
exec "$helm" "$@"
