"""Async client for the vLLM sampler: token-id completions with log-probs, and the server's load.

Requests go to ``POST /v1/completions`` with the prompt as token ids, ``return_token_ids`` and
``return_tokens_as_token_ids`` (else top-logprob keys of different tokens that decode to the same
text collide), the top ``logprobs`` candidates and a fresh random ``seed`` per request (identical
seeds would make data-parallel engines decode identical samples; the seeds come from the client's
own generator, seeded by the caller, so a run is reproducible). Failed requests are retried
with exponential backoff; :attr:`SamplerClient.retry_count` feeds ``rollout/vllm_retry_count``.

Under top-k/top-p/min-p truncation each sampled token's candidate set comes back with the turn
(:attr:`TurnRecord.output_sampling_mask`), by the path :mod:`trainer.vllm.server_info` chose at
start: the server's sampling mask through ``/inference/v1/generate``, or the finite entries of the
top ``top_k`` processed log-probs of ``/v1/completions``.

What the server is (its model's name, ``max_model_len``, KV-cache size) is read once at start by
:func:`trainer.vllm.server_info.read_server_info` and handed to this client; it reads none of it.

Completions and control requests (``/health``, ``/metrics``) use two connection pools: the
completions' pool holds one connection per rollout slot, so a ``/metrics`` poll never takes a
rollout's connection or waits behind the completions (aiohttp would queue the request out of
sight of the concurrency cap).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from trainer.exceptions import ServerLostError, VLLMServerError
from trainer.records import TurnRecord
from trainer.vllm.prometheus import ServerLoad, parse_prometheus, server_load
from trainer.vllm.server_info import EXCLUDED_LOGPROB, GENERATE_ROUTE, CandidatePath, candidate_set

logger = logging.getLogger(__name__)
_CONTROL_CONNECTIONS = 4  # /health and /metrics: one at a time in practice
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
    candidates: CandidatePath | None = None
    """How each sampled token's candidate set is read (:func:`~trainer.vllm.server_info.candidate_path`);
    ``None`` or ``"full_vocab"``: not at all."""

    def top_logprobs_requested(self) -> int:
        """Top log-probs to ask for: ``logprobs``, or ``top_k`` when they also carry the candidate set."""
        return max(self.logprobs, self.top_k) if self.candidates == "processed_topk" else self.logprobs


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
        model: The name requests give the model (:attr:`ServerInfo.model
            <trainer.vllm.server_info.ServerInfo.model>`); ``None``: requests name none, and vLLM
            serves them its base model.
    """

    def __init__(
        self,
        base_url: str,
        max_connections: int = 512,
        timeout_s: float = 1800.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        seed: int | None = None,
        model: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.retry_count = 0
        self.model = model
        self._session: aiohttp.ClientSession | None = None
        self._control_session: aiohttp.ClientSession | None = None
        self._rng = random.Random(seed)
        self.on_failure: Callable[[str], bool] | None = None
        """Told each failed attempt (transport error or 5xx); returns whether the server is now out, which
        ends the request at once with :class:`~trainer.exceptions.ServerLostError` (several servers:
        :mod:`trainer.rollout.servers`)."""
        self.on_answer: Callable[[], None] | None = None
        """Told each answered request."""

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
        """The session of ``/health`` and ``/metrics`` (its own small pool)."""
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
            except (TimeoutError, aiohttp.ClientError) as e:
                last = repr(e)
            await asyncio.sleep(0.5)
        raise VLLMServerError(f"vLLM server at {self.base_url} not ready after {timeout_s:.0f} s ({last})")

    async def _metrics_text(self) -> str:
        async with self.control_session.get(f"{self.base_url}/metrics") as r:
            if r.status != 200:
                raise VLLMServerError(f"GET /metrics answered HTTP {r.status}")
            return await r.text()

    async def load(self) -> ServerLoad | None:
        """Current server load, or ``None`` when ``/metrics`` is unavailable."""
        try:
            return server_load(parse_prometheus(await self._metrics_text()))
        except (TimeoutError, aiohttp.ClientError, VLLMServerError):
            return None

    async def complete(self, prompt_ids: list[int], params: SamplingParams, seed: int | None = None,
                       model: str | None = None) -> TurnRecord:
        """Sample one completion of ``prompt_ids``; retried on transport errors and 5xx.

        ``model`` names a LoRA adapter loaded on the server; :attr:`model` when ``None``.
        """
        sampling: dict[str, Any] = {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "logprobs": params.top_logprobs_requested(),
            "seed": self._rng.getrandbits(31) if seed is None else seed,
            "skip_special_tokens": False,
        }
        if params.min_p is not None:
            sampling["min_p"] = params.min_p
        if params.stop_token_ids:
            sampling["stop_token_ids"] = params.stop_token_ids
        name = model or self.model
        named: dict[str, Any] = {"model": name} if name else {}
        body: dict[str, Any]
        if params.candidates == "sampling_mask":
            body = {**named, "token_ids": prompt_ids, "sampling_params": {**sampling, "detokenize": False}}
            return _generate_turn(prompt_ids, await self._post_with_retries(GENERATE_ROUTE, body), params.logprobs)
        body = {**named, "prompt": prompt_ids, "return_token_ids": True, "return_tokens_as_token_ids": True,
                **sampling}
        data = await self._post_with_retries("/v1/completions", body)
        candidates_k = params.top_k if params.candidates == "processed_topk" else 0
        return self._turn(prompt_ids, data, params.logprobs, candidates_k)

    async def _post_with_retries(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            reused_connection_closed = False
            try:
                async with self.session.post(f"{self.base_url}{path}", json=body) as r:
                    text = await r.text()
                    if r.status == 200:
                        payload: dict[str, Any] = await r.json(content_type=None)
                        if self.on_answer is not None:
                            self.on_answer()
                        return payload
                    if r.status < 500:
                        # A 4xx is the request's fault (too long a prompt, bad params): no retry.
                        raise VLLMServerError(f"POST {path} was refused with HTTP {r.status}", text)
                    problem = f"HTTP {r.status}: {text[:500]}"
            except (TimeoutError, aiohttp.ClientError) as e:
                problem = repr(e)
                reused_connection_closed = isinstance(e, aiohttp.ServerDisconnectedError)
            if self.on_failure is not None and self.on_failure(problem):
                raise ServerLostError(f"POST {path} to {self.base_url}: the server was taken out", problem)
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
    def _turn(prompt_ids: list[int], data: dict[str, Any], num_top: int, candidates_k: int = 0) -> TurnRecord:
        """The turn of a ``/v1/completions`` answer: the top ``num_top`` log-probs per token and, when
        ``candidates_k`` > 0, the candidate set read from the top ``candidates_k`` processed log-probs."""
        choice = data["choices"][0]
        lp = choice.get("logprobs") or {}
        top = lp.get("top_logprobs")
        ranked = ([sorted(((_token_id(k), float(v)) for k, v in (d or {}).items()), key=lambda kv: -kv[1])
                   for d in top] if top is not None else None)
        masks = None
        if candidates_k and ranked is not None:
            masks = [candidate_set(dict(r[:candidates_k])) for r in ranked]
        return _turn_record(prompt_ids, [int(t) for t in choice["token_ids"]], lp.get("token_logprobs") or [],
                            ranked, num_top, masks, choice.get("finish_reason"))


def _turn_record(prompt_ids: list[int], output_ids: list[int], token_logprobs: list[Any],
                 ranked: list[list[tuple[int, float]]] | None, num_top: int, masks: list[list[int]] | None,
                 finish_reason: str | None) -> TurnRecord:
    """A :class:`TurnRecord` from parsed log-probs (``ranked``: per token, (id, log-prob) best first)."""
    # vLLM lists the sampled token next to the top candidates; keep the top ``num_top`` that have mass
    # (a token outside the candidate set has none: vLLM writes -9999 for its processed log-prob).
    sampler_top = ([dict([kv for kv in r if kv[1] > EXCLUDED_LOGPROB][:num_top]) for r in ranked]
                   if ranked is not None else None)
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_log_probs=[float(x) if x is not None else 0.0 for x in token_logprobs],
        output_sampling_mask=masks,
        output_sampler_logprobs=sampler_top,
        finish_reason=finish_reason,
    )


def _generate_turn(prompt_ids: list[int], data: dict[str, Any], num_top: int) -> TurnRecord:
    """The turn of an ``/inference/v1/generate`` answer (token ids, log-prob lists, the sampling mask)."""
    choice = data["choices"][0]
    content = (choice.get("logprobs") or {}).get("content")
    ranked = ([sorted(((int(c["token_id"]), float(c["logprob"])) for c in entry.get("top_logprobs") or []),
                      key=lambda kv: -kv[1]) for entry in content] if content is not None else None)
    token_logprobs = [entry["logprob"] for entry in content] if content is not None else []
    mask = choice.get("sampling_mask")
    output_ids = [int(t) for t in choice.get("token_ids") or []]
    if mask is not None and len(mask) != len(output_ids):
        raise VLLMServerError(f"{GENERATE_ROUTE} returned {len(mask)} candidate sets for {len(output_ids)} tokens")
    return _turn_record(prompt_ids, output_ids, token_logprobs, ranked, num_top,
                        [[int(t) for t in m] for m in mask] if mask is not None else None, choice.get("finish_reason"))
