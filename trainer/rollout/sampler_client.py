"""Async client for the vLLM sampler: token-id completions with log-probs, load and limits.

Requests go to ``POST /v1/completions`` with the prompt as token ids, ``return_token_ids`` and
``return_tokens_as_token_ids`` (else top-logprob keys of different tokens that decode to the same
text collide), the top ``logprobs`` candidates and a fresh random ``seed`` per request (identical
seeds would make data-parallel engines decode identical samples; the seeds come from the client's
own generator, seeded by the caller, so a run is reproducible). Failed requests are retried
with exponential backoff; :attr:`SamplerClient.retry_count` feeds ``rollout/vllm_retry_count``.

Completions and control requests (``/health``, ``/v1/models``, ``/metrics``) use two connection
pools: the completions' pool holds one connection per rollout slot, so a ``/metrics`` poll never
takes a rollout's connection or waits behind the completions (aiohttp would queue the request
out of sight of the concurrency cap).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from trainer.exceptions import VLLMServerError
from trainer.records import TurnRecord

_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$")
_PROM_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
logger = logging.getLogger(__name__)
_CONTROL_CONNECTIONS = 4  # /health, /v1/models and /metrics: one at a time in practice
# An idle pooled connection is dropped after this long, well inside vLLM's (uvicorn's) 5 s keep-alive:
# a connection the server already closed, reused before a CPU-starved client loop has seen the close,
# fails its request, which then waits out a retry backoff while holding a rollout slot.
_KEEPALIVE_S = 2.0


@dataclass
class SamplingParams:
    """Per-request sampling settings (from the trainer config)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    logprobs: int = 8
    stop_token_ids: list[int] | None = None


@dataclass
class ServerLoad:
    """The server's load as read from ``/metrics`` (summed/maxed over engines)."""

    kv_cache_usage: float
    running: float
    waiting: float
    preemptions: float


@dataclass
class ServerLimits:
    """Sizes discovered from the server."""

    model: str
    max_model_len: int
    kv_cache_tokens: int | None


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Parse Prometheus text exposition into ``(name, labels, value)`` samples."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line.strip())
        if m:
            labels = dict(_PROM_LABEL.findall(m.group(2) or ""))
            samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def server_load(samples: list[tuple[str, dict[str, str], float]]) -> ServerLoad:
    """Reduce parsed ``/metrics`` samples to a :class:`ServerLoad` (max KV use, summed counts)."""
    def values(name: str) -> list[float]:
        return [v for n, _, v in samples if n == name]

    kv = values("vllm:kv_cache_usage_perc")
    return ServerLoad(
        kv_cache_usage=max(kv) if kv else 0.0,
        running=sum(values("vllm:num_requests_running")),
        waiting=sum(values("vllm:num_requests_waiting")),
        preemptions=sum(values("vllm:num_preemptions_total")),
    )


def kv_cache_tokens(samples: list[tuple[str, dict[str, str], float]]) -> int | None:
    """KV-cache capacity in tokens from ``vllm:cache_config_info`` (blocks x block size)."""
    for name, labels, _ in samples:
        if name == "vllm:cache_config_info":
            blocks = labels.get("num_gpu_blocks") or labels.get("num_cpu_blocks")
            if blocks and blocks != "None" and labels.get("block_size"):
                return int(blocks) * int(labels["block_size"])
    return None


def _token_id(key: str) -> int:
    # With return_tokens_as_token_ids the keys read "token_id:123".
    return int(key.rsplit(":", 1)[1])


class SamplerClient:
    """HTTP sessions to the vLLM server: one for completions, sized to the rollout concurrency, one for control.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        max_connections: Connection-pool size of the completions (the concurrency ceiling,
            ``max_concurrent_rollouts``: the adaptive cap never exceeds it).
        timeout_s: Per-request timeout (``vllm_server_timeout``); a timed-out request is retried.
        max_retries: Retries per request before giving up with :class:`VLLMServerError`.
        backoff_s: First retry delay; doubles each retry (with jitter).
        seed: Seeds the generator of the per-request sampling seeds and of the retry jitter;
            ``None``: unseeded (not reproducible).
    """

    def __init__(
        self,
        base_url: str,
        max_connections: int = 512,
        timeout_s: float = 1800.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        seed: int | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.retry_count = 0
        self.model: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._control_session: aiohttp.ClientSession | None = None
        self._rng = random.Random(seed)

    async def __aenter__(self) -> SamplerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The completions' HTTP session (created on first use, inside the running loop)."""
        if self._session is None or self._session.closed:
            self._session = self._new_session(self.max_connections)
        return self._session

    @property
    def control_session(self) -> aiohttp.ClientSession:
        """The session of ``/health``, ``/v1/models`` and ``/metrics`` (its own small pool)."""
        if self._control_session is None or self._control_session.closed:
            self._control_session = self._new_session(_CONTROL_CONNECTIONS)
        return self._control_session

    def _new_session(self, connections: int) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )

    async def close(self) -> None:
        """Close the HTTP sessions."""
        for session in (self._session, self._control_session):
            if session is not None:
                await session.close()
        self._session = self._control_session = None

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; :class:`VLLMServerError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                health = f"{self.base_url}/health"
                async with self.control_session.get(health, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = repr(e)
            await asyncio.sleep(0.5)
        raise VLLMServerError(f"vLLM server at {self.base_url} not ready after {timeout_s:.0f} s ({last})")

    async def limits(self) -> ServerLimits:
        """The served model name, ``max_model_len`` and KV-cache capacity in tokens."""
        first = await self._first_model()
        samples = parse_prometheus(await self._metrics_text())
        return ServerLimits(model=first["id"], max_model_len=int(first["max_model_len"]),
                            kv_cache_tokens=kv_cache_tokens(samples))

    async def model_name(self) -> str:
        """The served (base) model's name, fetched from ``/v1/models`` once and kept in :attr:`model`."""
        if self.model is None:
            await self._first_model()
        assert self.model is not None
        return self.model

    async def _first_model(self) -> dict[str, Any]:
        async with self.control_session.get(f"{self.base_url}/v1/models") as r:
            models = await r.json()
        first: dict[str, Any] = models["data"][0]
        self.model = first["id"]
        return first

    async def _metrics_text(self) -> str:
        async with self.control_session.get(f"{self.base_url}/metrics") as r:
            if r.status != 200:
                raise VLLMServerError(f"GET /metrics answered HTTP {r.status}")
            return await r.text()

    async def load(self) -> ServerLoad | None:
        """Current server load, or ``None`` when ``/metrics`` is unavailable."""
        try:
            return server_load(parse_prometheus(await self._metrics_text()))
        except (aiohttp.ClientError, asyncio.TimeoutError, VLLMServerError):
            return None

    async def complete(self, prompt_ids: list[int], params: SamplingParams, seed: int | None = None,
                       model: str | None = None) -> TurnRecord:
        """Sample one completion of ``prompt_ids``; retried on transport errors and 5xx.

        ``model`` names a LoRA adapter loaded on the server; the base model when ``None`` (its name
        is fetched on the first request unless :meth:`model_name` or :meth:`limits` ran before).
        """
        body: dict[str, Any] = {
            "model": model or await self.model_name(),
            "prompt": prompt_ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "logprobs": params.logprobs,
            "seed": self._rng.getrandbits(31) if seed is None else seed,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.min_p is not None:
            body["min_p"] = params.min_p
        if params.stop_token_ids:
            body["stop_token_ids"] = params.stop_token_ids
        data = await self._post_with_retries("/v1/completions", body)
        return self._turn(prompt_ids, data, params.logprobs)

    async def _post_with_retries(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            reused_connection_closed = False
            try:
                async with self.session.post(f"{self.base_url}{path}", json=body) as r:
                    text = await r.text()
                    if r.status == 200:
                        return await r.json(content_type=None)
                    if r.status < 500:
                        # A 4xx is the request's fault (too long a prompt, bad params): no retry.
                        raise VLLMServerError(f"POST {path} was refused with HTTP {r.status}", text)
                    problem = f"HTTP {r.status}: {text[:500]}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                problem = repr(e)
                reused_connection_closed = isinstance(e, aiohttp.ServerDisconnectedError)
            if attempt == self.max_retries:
                raise VLLMServerError(
                    f"POST {path} to {self.base_url} failed after {self.max_retries} retries", problem
                )
            self.retry_count += 1
            logger.warning("POST %s failed (%s); retry %d of %d", path, problem, attempt + 1, self.max_retries)
            if reused_connection_closed and attempt == 0:
                # Most often a pooled keep-alive connection the server closed just as it was reused:
                # a fresh connection succeeds at once, so the first such retry does not back off.
                continue
            await asyncio.sleep(delay * (0.5 + self._rng.random()))
            delay *= 2
        raise AssertionError("unreachable")

    @staticmethod
    def _turn(prompt_ids: list[int], data: dict[str, Any], top_k: int) -> TurnRecord:
        choice = data["choices"][0]
        output_ids = [int(t) for t in choice["token_ids"]]
        lp = choice.get("logprobs") or {}
        token_logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
        top = lp.get("top_logprobs")
        # vLLM lists the sampled token next to the top candidates; keep the top ``top_k`` only.
        sampler_top = (
            [dict(sorted(((_token_id(k), float(v)) for k, v in (d or {}).items()),
                         key=lambda kv: -kv[1])[:top_k]) for d in top]
            if top is not None else None
        )
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=output_ids,
            output_log_probs=token_logprobs,
            output_sampler_logprobs=sampler_top,
            finish_reason=choice.get("finish_reason"),
        )
