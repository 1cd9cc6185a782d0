"""The committed gRPC stubs are what hack/gen_protos.py generates from proto/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_regenerating_the_stubs_gives_no_diff() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "hack" / "gen_protos.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
