"""Blocking client for the vLLM server's control routes (dev mode): pause, resume, caches, weight transfer.

The trainer's process uses it (the rollout worker's async client is :mod:`trainer.vllm.client`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from trainer.exceptions import VLLMServerError, WeightSyncError


class VLLMAdminClient:
    """Blocking client for the vLLM server's control routes (dev mode).

    It also satisfies vLLM's ``VLLMWeightSyncClient`` protocol (the four weight-update methods),
    so vLLM's trainer-side engines can drive the server through it.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        timeout_s: Timeout of each call, in seconds (``vllm_server_timeout``).
    """

    def __init__(self, base_url: str, timeout_s: float = 1800.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def request(
        self, method: str, path: str, body: Any = None, *, error: type[VLLMServerError] = VLLMServerError,
        timeout_s: float | None = None,
    ) -> Any:
        """Call ``path``; returns the decoded JSON (or text) body, raises ``error`` on failure.
        ``timeout_s`` bounds this call instead of the client's timeout."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}{path}", data=data, method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise error(f"{method} {path} failed with HTTP {e.code}", e.read().decode(errors="replace")) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise error(f"{method} {path} could not reach the vLLM server at {self.base_url}: {e}") from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """Stop scheduling new tokens; ``keep`` preserves running requests' state, and
        ``clear_cache`` resets the KV cache (which preempts every running request)."""
        self.request("POST", f"/pause?mode={mode}&clear_cache={str(clear_cache).lower()}")

    def resume(self) -> None:
        """Resume generation after :meth:`pause`."""
        self.request("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (their KV was computed with the old weights)."""
        self.request("POST", "/reset_prefix_cache")

    # --- vLLM's VLLMWeightSyncClient protocol -------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``/init_weight_transfer_engine`` with backend-specific ``init_info``."""
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info}, error=WeightSyncError)

    def start_weight_update(self) -> None:
        """``/start_weight_update``."""
        self.request("POST", "/start_weight_update", error=WeightSyncError)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``/update_weights`` with one chunk's backend-specific ``update_info``."""
        self.request("POST", "/update_weights", {"update_info": update_info}, error=WeightSyncError)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``/finish_weight_update``, recording ``weight_version`` on the server."""
        body = {"weight_version": weight_version} if weight_version is not None else None
        self.request("POST", "/finish_weight_update", body, error=WeightSyncError)
