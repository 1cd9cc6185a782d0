"""`AppEngine`: an inference engine that frees and re-takes its own GPU memory (backend `app`).

Owned by the driver package; the claim's `TimeSliceConfig.app`, the orchestrator's
`GroupSpec.apps` / `MemberSpec.app`, and the node agent's `app` backend all use this one
model. Wire form (in a `TimeSliceConfig`):

    backend: app
    app:
      engine: vllm                  # vllm | sglang
      url: http://127.0.0.1:8000    # the engine's HTTP server, loopback only
      level: 1                      # vLLM sleep level: 1 (weights to host memory) or 2 (discarded)
      timeoutSeconds: 120           # bound on one sleep or wake call, seconds

The engine APIs (read in the upstream sources):
- vLLM, `vllm/entrypoints/serve/sleep/api_router.py` (vllm-project/vllm; earlier in
  `vllm/entrypoints/openai/api_server.py`), served only with `VLLM_SERVER_DEV_MODE=1` and
  `--enable-sleep-mode`: `POST /sleep?level=N` (empty 200 once the engine slept),
  `POST /wake_up` (optional `?tags=`; none wakes everything), `GET /is_sleeping`
  (`{"is_sleeping": bool}`).
- SGLang, `python/sglang/srt/entrypoints/http_server.py` (sgl-project/sglang), with
  `--enable-memory-saver`: `POST /release_memory_occupation` and
  `POST /resume_memory_occupation`, JSON body `ReleaseMemoryOccupationReqInput` /
  `ResumeMemoryOccupationReqInput` (`{"tags": [...]}` optional; `{}` moves everything);
  200 on success, 400 with `{"error": {"message": ...}}` on failure.

Only loopback URLs are accepted (`check_url`): the node agent makes these calls, and a
claim must not make it call any other host. Nor can the engine: the agent follows no
redirect, reads a bounded share of each reply and quotes a short printable excerpt of it
(`kubelet_plugin/agent/backends/app.py`).
"""

from __future__ import annotations

import ipaddress
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

ENGINE_VLLM = "vllm"
ENGINE_SGLANG = "sglang"
# Bound on one engine call (sleep, wake), seconds: vLLM level 1 copies the weights to host
# memory, tens of GB at a few GB/s.
DEFAULT_APP_TIMEOUT_SECONDS = 120.0


def check_url(url: str) -> str:
    """`url` when it is `http://<loopback host>[:port][/]`; raises ValueError saying why not.
    Loopback hosts: `localhost`, 127.0.0.0/8, ::1."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a bad port
    except ValueError as err:
        raise ValueError(f"url {url!r} is not a URL: {err}") from None
    if parts.scheme != "http":
        raise ValueError(f"url {url!r}: scheme must be http (the engine listens on loopback), got {parts.scheme!r}")
    host = parts.hostname or ""
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"url {url!r}: host {host!r} is not loopback; the node agent calls the engine only "
                             "on 127.0.0.1, ::1 or localhost (the engine must listen there)")
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"url {url!r}: give scheme, host and port only (no path, query or credentials)")
    if port == 0:
        raise ValueError(f"url {url!r}: port 0 is not a port")
    return url


class AppEngine(BaseModel):
    """The engine of one job: `engine` (vllm | sglang), `url` (loopback only), `level`
    (vLLM sleep level 1 or 2; SGLang ignores it) and `timeoutSeconds` (one call's bound).
    Raises pydantic.ValidationError (a ValueError) naming the bad field."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    engine: Literal["vllm", "sglang"]
    url: str
    level: Literal[1, 2] = 1
    timeoutSeconds: float = Field(default=DEFAULT_APP_TIMEOUT_SECONDS, gt=0, le=3600)

    @field_validator("url")
    @classmethod
    def _loopback(cls, v: str) -> str:
        return check_url(v).rstrip("/")

    def describe(self) -> str:
        return f"{self.engine} at {self.url}" + (f" level {self.level}" if self.engine == ENGINE_VLLM else "")
