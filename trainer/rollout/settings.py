"""``RolloutSettings``: everything the rollout worker knows of the run, fixed at start.

The trainer builds one from its config and what it read from the vLLM server
(:meth:`RolloutSettings.from_config`) and hands it to the worker process, which pickles it: the
config itself (a whole ``TrainingArguments``) stays in the trainer. The same record drives rollouts
outside training (:func:`trainer.rollout.evaluation.evaluate_policy`, the benchmarks), built from a
running server with :meth:`RolloutSettings.from_server`; a field not given takes the default its
:class:`~trainer.AsyncGRPOConfig` field declares.

A ``loop_cls`` subclass that needs settings of its own gets them as constructor arguments, from
:meth:`AsyncGRPOTrainer.rollout_loop_kwargs <trainer.AsyncGRPOTrainer.rollout_loop_kwargs>`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from trainer.config import AsyncGRPOConfig, server_urls
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.server_info import CandidatePath, ServerInfo
from trainer.vllm.servers import read_servers_info

__all__ = ["RolloutSettings", "declared_default"]


def declared_default(config_cls: type[Any], name: str) -> Any:
    """The default that field ``name`` of the config dataclass ``config_cls`` declares."""
    declared = {f.name: f for f in dataclasses.fields(config_cls)}[name]
    if declared.default_factory is not dataclasses.MISSING:
        return declared.default_factory()
    return declared.default


def _default(name: str) -> Any:
    return field(default=declared_default(AsyncGRPOConfig, name))


@dataclass(frozen=True)
class RolloutSettings:
    """What the rollout worker needs: the server, the sampling settings and the loop's limits.

    Fields named as an :class:`~trainer.AsyncGRPOConfig` field hold that field's value and default to
    its default (see its help for the meaning).

    Attributes:
        model_name: The model the trainer trains (its id or directory); harness agents name it.
        vllm_server_base_url: The vLLM server rollouts sample from, or several joined by commas
            (each rollout goes to one of them, :mod:`trainer.rollout.servers`).
        server: What the trainer read from the (first) server at start (name, ``max_model_len``, KV-cache size).
        servers: What it read from each server, in order (``()``: ``server`` for every one).
        chat_template: The template rollouts render with instead of the tokenizer's own (the training
            template chosen at start, :mod:`trainer.rollout.training_templates`); ``None``: the tokenizer's.
        candidates: How each sampled token's top-k/top-p candidate set is read from the server
            (:func:`trainer.vllm.server_info.candidate_path`); ``None``: not at all.
        lora_name: With adapter-only LoRA sync, the prefix of the adapters' names: each request asks
            for the adapter of the policy version its group started under; ``None``: the served model.
        vllm_server_timeout: Seconds for each request (and the readiness wait).
        seed: Seeds the per-request sampling seeds and the prompt order.
        num_generations: Rollouts per prompt (the group size).
        max_completion_length: Most tokens sampled per turn.
        temperature: Sampling temperature.
        top_p: Nucleus sampling mass.
        top_k: Top-k truncation (0: none).
        min_p: Minimum relative token probability (``None``: none).
        num_sampler_logprobs: Top log-probs asked for per sampled token.
        chat_template_kwargs: Extra keyword arguments of ``apply_chat_template``.
        max_tool_calling_iterations: Most tool-calling turns per rollout (``None``: no limit).
        max_concurrent_rollouts: Ceiling of rollouts in flight; also the tool thread pool's size.
        max_staleness: Policy versions a group may lag before the trainer drops it (an adapter that
            old is retired from the server).
        reward_timeout: Seconds one reward function may take on one group (``None``: no limit).
        env_call_timeout: Seconds one call of a local environment or tool may take (``None``: no limit).
        mask_truncated_completions: Leave rollouts cut at ``max_completion_length`` out of training.
        tail_token_prob: Train each rollout only up to its first token sampled at under this fraction of
            its position's most likely token's probability (:mod:`trainer.rollout.tail`; ``None``: every token).
        turn_baseline: Credit each turn against the group's rollouts that reached its state
            (:mod:`trainer.rollout.turn_baseline`).
    """

    model_name: str
    vllm_server_base_url: str
    server: ServerInfo
    servers: tuple[ServerInfo, ...] = ()
    chat_template: str | None = None
    candidates: CandidatePath | None = None
    lora_name: str | None = None
    vllm_server_timeout: float = _default("vllm_server_timeout")
    seed: int = _default("seed")
    num_generations: int = _default("num_generations")
    max_completion_length: int = _default("max_completion_length")
    temperature: float = _default("temperature")
    top_p: float = _default("top_p")
    top_k: int = _default("top_k")
    min_p: float | None = _default("min_p")
    num_sampler_logprobs: int = _default("num_sampler_logprobs")
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_tool_calling_iterations: int | None = _default("max_tool_calling_iterations")
    max_concurrent_rollouts: int = _default("max_concurrent_rollouts")
    max_staleness: int = _default("max_staleness")
    reward_timeout: float | None = _default("reward_timeout")
    env_call_timeout: float | None = _default("env_call_timeout")
    mask_truncated_completions: bool = _default("mask_truncated_completions")
    tail_token_prob: float | None = _default("tail_token_prob")
    turn_baseline: bool = _default("turn_baseline")

    @classmethod
    def from_config(cls, config: AsyncGRPOConfig, model_name: str, server: ServerInfo, *,
                    chat_template: str | None = None, candidates: CandidatePath | None = None,
                    lora_name: str | None = None, servers: Sequence[ServerInfo] = ()) -> RolloutSettings:
        """The worker's settings of a training run: every field named as a config field is copied from it.

        Args:
            config: The trainer's config.
            model_name: The trained model's id or directory.
            server: The (first) server's facts, read once at start.
            chat_template: The training template chosen at start, if any.
            candidates: The candidate-set path chosen at start.
            lora_name: The adapters' name prefix under adapter-only LoRA sync.
            servers: Every server's facts (kept with several servers).
        """
        # A JSON string from the command line is a dict by now (AsyncGRPOConfig.__post_init__).
        template_kwargs = dict(cast("dict[str, Any] | None", config.chat_template_kwargs) or {})
        copied = {name: getattr(config, name) for name in _CONFIG_FIELDS if name != "chat_template_kwargs"}
        return cls(model_name=model_name, server=server, servers=tuple(servers) if len(servers) > 1 else (),
                   chat_template=chat_template,
                   candidates=candidates, lora_name=lora_name, chat_template_kwargs=template_kwargs, **copied)

    @classmethod
    def from_server(cls, base_url: str, model_name: str, **fields: Any) -> RolloutSettings:
        """Settings for rollouts outside training: the server at ``base_url`` (or each of several joined by
        commas) is read once (:func:`~trainer.vllm.servers.read_servers_info`), ``fields`` set any other field.

        Raises:
            VLLMServerError: A server did not answer within ``vllm_server_timeout``.
            ConfigError: Several servers disagree on the model or ``max_model_len``.
        """
        timeout_s = float(fields.get("vllm_server_timeout", declared_default(AsyncGRPOConfig, "vllm_server_timeout")))
        urls = server_urls(base_url)
        infos = read_servers_info([VLLMAdminClient(url, timeout_s=timeout_s) for url in urls])
        return cls(model_name=model_name, vllm_server_base_url=",".join(urls), server=infos[0],
                   servers=tuple(infos) if len(infos) > 1 else (), **fields)


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(RolloutSettings)) & frozenset(
    f.name for f in dataclasses.fields(AsyncGRPOConfig))
"""The settings that are config fields of the same name and meaning."""
