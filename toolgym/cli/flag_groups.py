"""``toolgym train --help`` leads with the trainer: its own flags in groups, transformers' inherited ones last.

The flags come from the dataclass fields (``RunArguments``, ``AsyncGRPOConfig``); this table only
says under which heading each of the trainer's own fields is shown. Every field that
``AsyncGRPOConfig`` declares itself must be in exactly one group (``tests/toolgym/test_train_cli.py``
checks it, so a new field cannot be forgotten); every field it inherits from
``transformers.TrainingArguments`` is shown under the last heading.
"""

from __future__ import annotations

import argparse

GROUPS: dict[str, tuple[str, ...]] = {
    "model and data": (
        "model", "dataset", "reward_funcs", "model_init_kwargs", "dtype", "trust_remote_code", "router_aux_loss_coef",
        "output_dir", "max_steps", "num_train_epochs", "learning_rate", "lr_scheduler_type", "seed",
    ),
    "rollout and tools": (
        "tools", "num_generations", "max_completion_length", "mask_truncated_completions", "temperature", "top_p",
        "top_k", "min_p", "chat_template_kwargs", "max_tool_calling_iterations", "reward_timeout",
        "env_call_timeout",
    ),
    "loss": (
        "epsilon", "epsilon_high", "score_centering", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max", "num_sampler_logprobs", "tail_token_prob", "turn_baseline",
    ),
    "pipeline and sync": (
        "vllm_server_base_url", "vllm_server_timeout", "max_concurrent_rollouts", "max_staleness",
        "staleness_allowance", "weight_sync_steps", "weight_sync_pause", "rollout_worker_timeout",
        "stall_timeout",
    ),
    "training step": (
        "packing", "token_budget", "gradient_accumulation_steps", "grad_spike_clip", "bf16", "gradient_checkpointing",
        "compile_training_step", "compile_row_bucket", "compile_cache_dir",
    ),
    "evaluation": ("eval_temperature", "eval_num_generations", "eval_num_rows", "eval_group_by",
                   "eval_success_threshold"),
    "environment": ("environment", "env_token", "env_kwargs"),
    "launch": ("launch_vllm", "vllm_max_model_len", "launch_envserver"),
    "logging": (
        "logging_steps", "progress", "log_completions", "num_completions_to_print", "plots", "report_to",
        "ignore_data_skip", "remove_unused_columns",
    ),
}
INHERITED = "transformers TrainingArguments (inherited; most runs need none of these)"


def group_flags(parser: argparse.ArgumentParser) -> None:
    """Move ``parser``'s flags under the headings of :data:`GROUPS`, the rest under :data:`INHERITED`.

    argparse has no public way to regroup actions after they are added; the help formatter reads
    each group's ``_group_actions``, which is what this reassigns (the parsing is unchanged).
    """
    by_dest: dict[str, list[argparse.Action]] = {}  # a boolean field has two flags: --x and --no_x
    for action in parser._actions:
        if action.dest != "help":
            by_dest.setdefault(action.dest, []).append(action)
    new = [parser.add_argument_group(title) for title in GROUPS]
    for group, names in zip(new, GROUPS.values(), strict=True):
        for name in names:
            group._group_actions.extend(by_dest.pop(name, []))
    inherited = parser.add_argument_group(INHERITED)
    inherited._group_actions.extend(a for actions in by_dest.values() for a in actions)
    for group in parser._action_groups:
        if group not in new and group is not inherited:
            group._group_actions[:] = [a for a in group._group_actions if a.dest == "help"]
