"""What the vLLM server is and can do, read once at start (:func:`read_server_info`), and the
choices the trainer makes from it.

:func:`read_server_info` waits for the server (up to ``vllm_server_timeout``, saying every few
seconds what it waits for), then reads it once: one ``GET /v1/models``, one ``GET /server_info``
(dev mode), one ``GET /metrics``. The :class:`ServerInfo` it returns goes to whoever needs it:

* the served model's name (requests name it; a server may list LoRA adapters too),
  ``max_model_len`` and the KV-cache size: the rollout worker's turn limit and concurrency cap;
* the serving dtype: a mismatch with the trainer's ``dtype`` is warned about (:func:`dtype_mismatch`);
* how the server can give each sampled token's top-k/top-p candidate set (:func:`candidate_path`):

  - ``"sampling_mask"``: vLLM's own path, ``--return-sampling-mask --enable-scale-out`` (vLLM >=
    0.28 with Model Runner V2): the token-in-token-out route ``/inference/v1/generate`` returns the set;
  - ``"processed_topk"``: our path on any vLLM started with ``--logprobs-mode processed_logprobs``: the
    top ``top_k`` processed log-probs of a position are finite exactly on its candidate set (vLLM
    writes ``-9999`` for the others), so asking for ``top_k`` of them returns the set whenever
    ``top_k <= --max-logprobs`` (checked here, naming the flag to raise);
  - ``"full_vocab"``: neither: log-probs are normalised over the whole vocabulary, with a warning
    that the importance ratios are biased;
  - ``None``: no truncation (``top_k=0``, ``top_p=1``, no ``min_p``): nothing to ask for;

* its LoRA limits (adapter-only sync, :mod:`trainer.sync.lora_sync`) and the weight-transfer backend
  it runs (``--weight-transfer-config``), which picks the trainer's side of it (:mod:`trainer.sync.backends`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from trainer.exceptions import ConfigError, VLLMServerError
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.prometheus import kv_cache_tokens, parse_prometheus

logger = logging.getLogger(__name__)

CandidatePath = Literal["sampling_mask", "processed_topk", "full_vocab"]
GENERATE_ROUTE = "/inference/v1/generate"
EXCLUDED_LOGPROB = -9999.0
"""What vLLM writes for the log-prob of a token outside the candidate set (JSON has no ``-inf``)."""
FIRST_WAIT_LOG_S = 2.0
"""Seconds without an answer before :func:`read_server_info` says what it is waiting for."""
WAIT_LOG_EVERY_S = 15.0
"""Then it says so again this often."""
_ATTEMPT_S = 10.0  # one attempt's timeout while waiting: a silent address must not stall the log


@dataclass(frozen=True)
class LoRALimits:
    """The server's limits on LoRA adapters (``--enable-lora``).

    Attributes:
        max_loras: ``--max-loras``: adapters served at once.
        max_lora_rank: ``--max-lora-rank``: the largest rank served.
        runtime_loading: Whether adapters can be loaded at run time (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``).
    """

    max_loras: int
    max_lora_rank: int
    runtime_loading: bool


@dataclass(frozen=True)
class ServerInfo:
    """What the trainer needs to know about the server (``None``: the server did not say).

    Attributes:
        model: The served model's name (what a request's ``"model"`` names).
        max_model_len: Longest prompt + completion the server serves.
        dtype: The serving dtype, e.g. ``"float32"`` (``--dtype``).
        kv_cache_tokens: KV-cache capacity in tokens (from ``/metrics``): the rollout worker's first
            concurrency cap.
        logprobs_mode: ``--logprobs-mode`` (``"processed_logprobs"`` is what the importance ratio needs).
        max_logprobs: ``--max-logprobs``: the most top log-probs a request may ask for.
        return_sampling_mask: ``--return-sampling-mask``.
        scale_out: Whether ``/inference/v1/generate`` is enabled (``--enable-scale-out``).
        lora: The LoRA limits; ``None`` without ``--enable-lora``.
        weight_transfer_backend: The backend of ``--weight-transfer-config`` (e.g. ``"toolgym_shm"``,
            ``"nccl"``); ``None`` without one (or outside dev mode, where ``/server_info`` is missing).
    """

    model: str
    max_model_len: int
    dtype: str | None = None
    kv_cache_tokens: int | None = None
    logprobs_mode: str | None = None
    max_logprobs: int | None = None
    return_sampling_mask: bool = False
    scale_out: bool = False
    lora: LoRALimits | None = None
    weight_transfer_backend: str | None = None


def served_model_entry(models: dict[str, Any], configured: Any = None) -> dict[str, Any]:
    """The entry of ``/v1/models`` that is the base model (not a LoRA adapter the server also lists);
    ``configured``: the served name(s) when known."""
    entries: list[dict[str, Any]] = list(models.get("data") or [])
    if not entries:
        raise VLLMServerError("GET /v1/models listed no model")
    names = configured if isinstance(configured, list) else [configured] if configured else []
    for entry in entries:
        if entry.get("id") in names:
            return entry
    # An adapter has the base model as its parent; the base model has none.
    return next((e for e in entries if not e.get("parent")), entries[0])


def read_server_info(admin: VLLMAdminClient, wait_s: float | None = None) -> ServerInfo:
    """Wait for the server, then read :class:`ServerInfo` from it: one ``GET`` each of ``/v1/models``,
    ``/server_info`` and ``/metrics``.

    ``/server_info`` exists in dev mode (``VLLM_SERVER_DEV_MODE=1``, which weight sync needs anyway);
    without it the server's flags are unknown and count as off.

    Args:
        admin: The server's control client.
        wait_s: How long to wait for the server to answer (``vllm_server_timeout``); the client's
            timeout when ``None``. Past a few seconds the wait is logged, naming the URL.

    Raises:
        VLLMServerError: The server did not answer within ``wait_s``.
    """
    models = _wait_for_models(admin, admin.timeout_s if wait_s is None else wait_s)
    try:
        raw = admin.request("GET", "/server_info?config_format=json")
        vllm_config, env = raw["vllm_config"], raw.get("vllm_env") or {}
    except (VLLMServerError, KeyError, TypeError) as exc:
        logger.info("the vLLM server at %s has no /server_info (%s): not in dev mode (VLLM_SERVER_DEV_MODE=1), "
                    "so its flags count as off", admin.base_url, getattr(exc, "message", exc))
        vllm_config, env = {}, {}
    config = vllm_config.get("model_config") or {}
    entry = served_model_entry(models, config.get("served_model_name"))
    max_model_len = entry.get("max_model_len") or config.get("max_model_len")
    if max_model_len is None:
        raise VLLMServerError(f"the vLLM server at {admin.base_url} did not say its max_model_len (GET /v1/models)")
    dtype = config.get("dtype")
    return ServerInfo(
        model=str(entry["id"]),
        max_model_len=int(max_model_len),
        dtype=str(dtype).removeprefix("torch.") if dtype else None,
        kv_cache_tokens=_kv_cache_tokens(admin),
        logprobs_mode=config.get("logprobs_mode"),
        max_logprobs=int(config["max_logprobs"]) if config.get("max_logprobs") is not None else None,
        return_sampling_mask=bool(config.get("return_sampling_mask")),
        scale_out=_scale_out_enabled(admin) if config.get("return_sampling_mask") else False,
        lora=_lora_limits(vllm_config.get("lora_config"), env),
        weight_transfer_backend=(vllm_config.get("weight_transfer_config") or {}).get("backend"),
    )


def _wait_for_models(admin: VLLMAdminClient, wait_s: float) -> dict[str, Any]:
    """``GET /v1/models`` once the server answers it; :class:`VLLMServerError` after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    next_log = time.monotonic() + FIRST_WAIT_LOG_S
    while True:
        try:
            models: dict[str, Any] = admin.request(
                "GET", "/v1/models", timeout_s=max(min(_ATTEMPT_S, deadline - time.monotonic()), 0.1))
            return models
        except VLLMServerError as exc:
            now = time.monotonic()
            if now >= deadline:
                raise VLLMServerError(f"{exc.message} (waited {wait_s:g} s: vllm_server_timeout); check "
                                      "vllm_server_base_url and that the server is up", exc.detail) from None
            if now >= next_log:
                logger.warning("waiting for the vLLM server at %s to answer GET /v1/models (%s); %.0f s left of "
                               "vllm_server_timeout", admin.base_url, exc.message, deadline - now)
                next_log = now + WAIT_LOG_EVERY_S
            time.sleep(min(1.0, deadline - now))


def _kv_cache_tokens(admin: VLLMAdminClient) -> int | None:
    try:
        return kv_cache_tokens(parse_prometheus(str(admin.request("GET", "/metrics"))))
    except VLLMServerError as exc:
        logger.info("GET /metrics failed (%s): the rollout concurrency cap will not adapt to the KV cache",
                    exc.message)
        return None


def _lora_limits(lora: dict[str, Any] | None, env: dict[str, Any]) -> LoRALimits | None:
    if not lora:
        return None
    runtime = str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() in ("true", "1")
    return LoRALimits(int(lora["max_loras"]), int(lora["max_lora_rank"]), runtime_loading=runtime)


def _scale_out_enabled(admin: VLLMAdminClient) -> bool:
    """Probe the token-in-token-out route: 403 when disabled, 404 on a vLLM without it."""
    try:
        admin.request("POST", GENERATE_ROUTE, {})
    except VLLMServerError as exc:
        return not any(f"HTTP {code}" in exc.message for code in (403, 404, 405))
    return True


def truncates(top_k: int, top_p: float, min_p: float | None) -> bool:
    """Whether sampling draws from a restricted candidate set (top-k, top-p or min-p)."""
    return top_k > 0 or top_p < 1 or (min_p or 0) > 0


def candidate_path(info: ServerInfo, top_k: int, top_p: float, min_p: float | None) -> CandidatePath | None:
    """How the worker gets each sampled token's candidate set from this server (module docstring).

    Raises:
        ConfigError: ``top_k`` exceeds the server's ``--max-logprobs`` on a server that has only our
            path: the flag to restart it with is named.
    """
    if not truncates(top_k, top_p, min_p):
        return None
    if info.return_sampling_mask and info.scale_out:
        return "sampling_mask"
    if info.logprobs_mode == "processed_logprobs":
        if info.max_logprobs is not None and 0 <= info.max_logprobs < top_k:
            raise ConfigError(
                f"top_k={top_k} exceeds the server's --max-logprobs={info.max_logprobs}: the trainer reads each "
                f"token's candidate set from the top top_k processed log-probs. Restart vllm serve with "
                f"--max-logprobs {top_k} (or, on vLLM >= 0.28 with Model Runner V2, --return-sampling-mask "
                "--enable-scale-out), or lower top_k")
        return "processed_topk"
    logger.warning(
        "top_k=%s / top_p=%s / min_p=%s: this server cannot return each token's candidate set (it runs neither "
        "--return-sampling-mask --enable-scale-out nor --logprobs-mode processed_logprobs), so log-probs are "
        "normalised over the full vocabulary and the importance ratios are biased", top_k, top_p, min_p)
    return "full_vocab"


def turn_fits(prompt_len: int, max_tokens: int, max_model_len: int, truncating: bool) -> bool:
    """Whether a turn of ``prompt_len`` prompt tokens can be sampled without :func:`check_turn_length` refusing."""
    room = max_model_len - prompt_len
    return room >= max_tokens or (truncating and room > 0)


def check_turn_length(prompt_len: int, max_tokens: int, max_model_len: int, truncating: bool) -> int:
    """The ``max_tokens`` a turn may ask for, or :class:`VLLMServerError` when the turn cannot be sampled.

    Without truncation a prompt plus ``max_completion_length`` over ``max_model_len`` stops the run
    (nothing is silently shrunk: vLLM 0.32's ``/v1/completions`` would clamp
    ``max_tokens`` without a word, so the trainer refuses in the server's terms). With top-k/top-p the
    turn is cut at ``max_model_len``, and only a prompt already that long is refused.
    """
    room = max_model_len - prompt_len
    if turn_fits(prompt_len, max_tokens, max_model_len, truncating):
        return min(room, max_tokens)
    if room <= 0:
        raise VLLMServerError(
            f"this model's maximum context length is {max_model_len} tokens (the server's --max-model-len) and the "
            f"turn's prompt already has {prompt_len}: raise --max-model-len, or shorten the prompt / the conversation "
            "(max_tool_calling_iterations)")
    raise VLLMServerError(
        f"this model's maximum context length is {max_model_len} tokens (the server's --max-model-len), but the "
        f"turn asks for {prompt_len + max_tokens} ({prompt_len} in the prompt, max_completion_length={max_tokens}"
        f" in the completion): raise --max-model-len to at least {prompt_len + max_tokens}, or lower "
        "max_completion_length")


def dtype_mismatch(info: ServerInfo, trainer_dtype: str) -> str | None:
    """The warning to give when the trainer's ``dtype`` and the server's ``--dtype`` differ, else ``None``."""
    if info.dtype is None or trainer_dtype == "auto" or info.dtype == trainer_dtype:
        return None
    return (f"the trainer loads the model in dtype={trainer_dtype} but the vLLM server serves it in "
            f"--dtype {info.dtype}: the train/inference mismatch shows in sampling/importance_sampling_ratio/* "
            f"and sampling/sampling_logp_difference/*; serve with --dtype {trainer_dtype} to close it")


def candidate_set(top: dict[int, float]) -> list[int]:
    """The token ids of a position's processed top log-probs that have probability mass (not excluded)."""
    return [t for t, lp in top.items() if math.isfinite(lp) and lp > EXCLUDED_LOGPROB]
