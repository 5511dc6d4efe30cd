"""TRL ``GRPOConfig`` fields this trainer deliberately does not have, each with why and what to use.

A TRL user reaches for these first; an ``unexpected keyword argument`` or argparse's ``unrecognized
arguments`` would leave them guessing. ``AsyncGRPOConfig(beta=0.04)`` and ``toolgym train --beta
0.04`` both raise :class:`~trainer.exceptions.ConfigError` with the text below (this table is the one
place it is written).
"""

from __future__ import annotations

from collections.abc import Iterable

from trainer.exceptions import ConfigError

__all__ = ["TRL_ONLY_FIELDS", "refuse_trl_fields"]

_SEPARATE_SERVER = ("generation always runs on a separate vLLM server: set launch_vllm=True for one started "
                    "and stopped with the run, or start one (toolgym vllm MODEL) and set vllm_server_base_url")
_CONTINUOUS = ("generation runs continuously beside training, not in batches per step: max_staleness and "
               "weight_sync_steps set how far it runs ahead, max_concurrent_rollouts how wide")
_ALWAYS_CORRECTED = ("the loss always corrects for the sampler with masked importance weights, bounded by "
                     "vllm_importance_sampling_clip_min / vllm_importance_sampling_clip_max (docs/loss.md)")
_NO_REFERENCE = "there is no reference model (the loss has no KL term, docs/loss.md)"

TRL_ONLY_FIELDS: dict[str, str] = {
    "beta": f"{_NO_REFERENCE}; drop it",
    "sync_ref_model": _NO_REFERENCE,
    "ref_model_mixup_alpha": _NO_REFERENCE,
    "ref_model_sync_steps": _NO_REFERENCE,
    "loss_type": ("there is one loss, score centering with masked importance sampling (score_centering=True, "
                  "the default) or the clipped surrogate (score_centering=False), normalised by the trained "
                  "tokens of each micro-batch (docs/loss.md)"),
    "scale_rewards": ("advantages are always (r - mean) / (std + 1e-4) over the group's scorable rollouts "
                      "(docs/loss.md); scale a reward inside its function"),
    "reward_weights": "rewards are summed; weight a reward inside its function (functools.partial works)",
    "num_iterations": ("every sample is trained once, as it arrives; max_staleness bounds how many policy "
                       "versions old it may be"),
    "importance_sampling_level": "importance weights are per token (docs/loss.md)",
    "delta": "there is no two-sided clipping: epsilon / epsilon_high bound the ratio (docs/loss.md)",
    "top_entropy_quantile": "every generated token of a sample is trained",
    "use_liger_loss": "the LM head and the loss run chunked, without materialising the logits (docs/loss.md)",
    "use_vllm": _SEPARATE_SERVER,
    "vllm_mode": _SEPARATE_SERVER,
    "vllm_server_host": "give the whole address in vllm_server_base_url, e.g. http://HOST:8000",
    "vllm_server_port": "give the whole address in vllm_server_base_url, e.g. http://HOST:8000",
    "vllm_gpu_memory_utilization": f"{_SEPARATE_SERVER}; pass --gpu-memory-utilization to that server",
    "vllm_tensor_parallel_size": f"{_SEPARATE_SERVER}; pass --tensor-parallel-size to that server",
    "vllm_enable_sleep_mode": _SEPARATE_SERVER,
    "vllm_model_impl": f"{_SEPARATE_SERVER}; pass --model-impl to that server",
    "vllm_guided_decoding_regex": "generation is free-form; constrain it through the chat template or rewards",
    "vllm_importance_sampling_correction": _ALWAYS_CORRECTED,
    "vllm_importance_sampling_mode": _ALWAYS_CORRECTED,
    "vllm_importance_sampling_cap": _ALWAYS_CORRECTED,
    "steps_per_generation": _CONTINUOUS,
    "generation_batch_size": _CONTINUOUS,
    "max_prompt_length": ("prompts are never cut: the server's --max-model-len bounds prompt plus completion, and "
                          "token_budget a packed row"),
    "generation_kwargs": "set temperature, top_p, top_k and min_p; other sampling options are not used",
    "repetition_penalty": "set temperature, top_p, top_k and min_p; other sampling options are not used",
    "use_transformers_paged": _SEPARATE_SERVER,
    "cache_implementation": _SEPARATE_SERVER,
    "ds3_gather_for_generation": f"{_SEPARATE_SERVER}; weights reach it through the weight sync",
    "shuffle_dataset": "prompts are always visited in a fresh seeded order per epoch (seed)",
    "disable_dropout": "dropout follows the model's config; set it there",
    "wandb_log_unique_prompts": "log_completions and report_to cover completion logging",
}


def refuse_trl_fields(names: Iterable[str]) -> None:
    """Raise :class:`ConfigError` for the first of ``names`` that is a TRL-only field (see the module docstring)."""
    for name in names:
        if name in TRL_ONLY_FIELDS:
            raise ConfigError(f"{name} is a TRL GRPOConfig field that this trainer does not have: "
                              f"{TRL_ONLY_FIELDS[name]}")
