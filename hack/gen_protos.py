#!/usr/bin/env python3
"""Regenerate the committed gRPC stubs from `proto/`.

Usage: `python hack/gen_protos.py` writes the stubs; `--check` exits 1 when the
committed stubs differ from what the pinned `grpcio-tools` (see pyproject's
`dev` extra) generates. The proto path mirrors the Python import path, so the
`.proto` under `proto/timeslice/v1/` becomes `timeslice.v1` (folder `client/v1/`)
and `proto/timeslice/driver/agentapi/v1/` becomes `timeslice.driver.agentapi.v1`
(folder `driver/agentapi/v1/`). The kubelet-facing APIs live under
`proto/timeslice/driver/kubeletapi/` -> `timeslice.driver.kubeletapi.*`; their proto
`package` statements are the upstream ones (the file path decides only the Python import).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
# proto folder (relative to proto/) -> package folder in the repository
TARGETS = {
    "timeslice/v1": ROOT / "client" / "v1",
    "timeslice/driver/agentapi/v1": ROOT / "driver" / "agentapi" / "v1",
    # kubelet-facing APIs, ours to serve; the proto `package` is the upstream one
    "timeslice/driver/kubeletapi/dra_v1": ROOT / "driver" / "kubeletapi" / "dra_v1",
    "timeslice/driver/kubeletapi/dra_v1beta1": ROOT / "driver" / "kubeletapi" / "dra_v1beta1",
    "timeslice/driver/kubeletapi/registration": ROOT / "driver" / "kubeletapi" / "registration",
    "timeslice/driver/kubeletapi/health_v1alpha1": ROOT / "driver" / "kubeletapi" / "health_v1alpha1",
}


def generate(out: Path) -> None:
    grpc_include = Path(protoc.__file__).parent / "_proto"
    for rel in TARGETS:
        protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / rel).glob("*.proto"))
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{grpc_include}", f"--python_out={out}",
                f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {rel}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for rel, dest in TARGETS.items():
            for src in sorted((Path(tmp) / rel).iterdir()):
                target = dest / src.name
                if opts.check:
                    if not target.exists() or not filecmp.cmp(src, target, shallow=False):
                        stale.append(str(target.relative_to(ROOT)))
                else:
                    dest.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, target)
    if stale:
        print("stale generated stubs (run hack/gen_protos.py):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
