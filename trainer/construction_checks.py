"""What the trainer refuses at construction, each a clear error naming what to do instead.

:func:`check_construction` runs in ``AsyncGRPOTrainer.__init__`` before anything is loaded or spawned, so a
combination the trainer cannot run fails at once with what to do instead, not at the first step or in the
rollout worker. Refused here: a reward model (a model id or a ``PreTrainedModel``) as a reward function,
``use_liger_kernel=True``, a PEFT config whose adapters target ``lm_head`` (the chunked LM head needs a
plain ``nn.Linear``), a dict ``environment_factory`` with no dataset, or over one whose ``environment``
column is missing or names an environment the dict does not have, and a launch that cannot work
(:func:`trainer.launch.for_run.check_launches`: several processes, a factory an env server cannot
import). :func:`check_dataset` refuses a dataset the worker could not generate from (empty, no
prompts, a malformed prompt) and :func:`check_picklable` what cannot reach the spawned rollout worker.
``remove_unused_columns`` and ``ignore_data_skip`` are refused by :class:`~trainer.config.AsyncGRPOConfig`
itself.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

from torch import nn

from trainer.exceptions import ConfigError
from trainer.launch.for_run import check_launches
from trainer.rollout.chat_template import refuse_image_parts
from trainer.rollout.prompt_order import check_prompt, first_row_columns, is_stream

__all__ = ["check_construction", "check_dataset", "check_output_head", "check_picklable"]

HEAD_NAMES = ("lm_head",)
MAX_ROUTING_ROWS_CHECKED = 100_000  # a bigger map-style dataset's routing is checked row by row at rollout
MAX_PROMPTS_CHECKED = 100_000  # a bigger dataset's later rows are checked where the worker reads them


def _check_reward_funcs(reward_funcs: Any) -> None:
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs] if reward_funcs is not None else []
    for i, func in enumerate(funcs):
        if isinstance(func, str) or isinstance(func, nn.Module):
            what = f"the model id {func!r}" if isinstance(func, str) else f"a {type(func).__name__}"
            raise ConfigError(
                f"reward_funcs[{i}] is {what}: reward models are not supported, reward functions must be Python "
                "callables. Wrap the model in a module-level function (or a callable class instance) that scores "
                "the completions and returns a list of floats")
        if not callable(func):
            raise ConfigError(f"reward_funcs[{i}] ({func!r:.80}) is not callable: give a function returning a "
                              "list of floats, one per completion")


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value] if isinstance(value, Iterable) else []


def _check_peft_config(peft_config: Any) -> None:
    if peft_config is None:
        return
    targets = _names(getattr(peft_config, "target_modules", None))
    saved = _names(getattr(peft_config, "modules_to_save", None))
    hit = [t for t in targets + saved if t != "all-linear" and any(h in t for h in HEAD_NAMES)]
    if hit:
        raise ConfigError(
            f"peft_config targets the LM head ({hit}): PEFT adapters on lm_head are not supported (the loss runs "
            "the head as a plain nn.Linear, chunk by chunk). Leave lm_head out of target_modules / modules_to_save "
            "('all-linear' already does)")


def check_output_head(model: nn.Module) -> None:
    """Refuse a model whose output head is wrapped (a PEFT adapter on ``lm_head``, however it got there)."""
    base: Any = model
    while hasattr(base, "get_base_model") and base is not base.get_base_model():
        base = base.get_base_model()
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is not None and not isinstance(head, nn.Linear):
        raise ConfigError(
            f"the model's output head is a {type(head).__name__}, not a plain nn.Linear: PEFT adapters on lm_head "
            "are not supported (the loss runs the head chunk by chunk); leave lm_head out of the adapter")


def _check_routing(environment_factory: Any, train_dataset: Any) -> None:
    if not isinstance(environment_factory, dict):
        return
    names = sorted(environment_factory)
    if train_dataset is None:
        raise ConfigError(
            f"environment_factory is a dict ({names}) and there is no train_dataset: each rollout's environment is "
            "picked by a dataset row's 'environment' column. Give a train_dataset with that column (and any "
            "columns the environments' reset() reads), or pass a single factory")
    columns = first_row_columns(train_dataset)
    if "environment" not in columns:
        raise ConfigError(
            f"environment_factory is a dict ({names}), so each dataset row picks its environment in an "
            f"'environment' column, but train_dataset has none (columns: {columns}); add one, or pass a single "
            "factory")
    if hasattr(train_dataset, "__len__") and len(train_dataset) <= MAX_ROUTING_ROWS_CHECKED:
        named = (train_dataset["environment"] if hasattr(train_dataset, "column_names")  # a datasets.Dataset
                 else [row.get("environment") for row in train_dataset])  # a list of row dicts
        unknown = sorted({str(v) for v in named} - set(environment_factory))
        if unknown:
            raise ConfigError(f"train_dataset's 'environment' column names {unknown}, which environment_factory "
                              f"does not have (it has {names})")


def check_construction(*, reward_funcs: Any, args: Any, train_dataset: Any, peft_config: Any,
                       environment_factory: Any) -> None:
    """Raise :class:`~trainer.exceptions.ConfigError` for a combination the trainer refuses (module docstring)."""
    _check_reward_funcs(reward_funcs)
    if getattr(args, "use_liger_kernel", False):
        raise ConfigError("use_liger_kernel=True is not supported: the loss computes its log-probs through its own "
                          "chunked LM head; set use_liger_kernel=False")
    _check_peft_config(peft_config)
    _check_routing(environment_factory, train_dataset)
    check_launches(args, environment_factory)  # launch_vllm / launch_envserver: one process, an importable class


def check_picklable(**objects: Any) -> None:
    """Refuse, naming it, an object that cannot reach the rollout worker (a spawned process): a lambda, a closure."""
    for name, obj in objects.items():
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else [(None, obj)]
        for key, item in items:
            if item is None:
                continue
            try:
                pickle.dumps(item)
            except Exception as exc:
                where = name if key is None else f"{name}[{key!r}]"
                raise TypeError(
                    f"{where} ({item!r}) cannot be pickled, and it must reach the rollout worker, a spawned "
                    f"process: use a module-level function, functools.partial or a callable class instance, "
                    f"not a lambda or closure ({type(exc).__name__}: {exc})") from exc


def check_dataset(dataset: Any, has_env: bool, name: str = "train_dataset") -> None:
    """Refuse, before anything starts, a dataset the worker could not generate from.

    Every prompt of a map-style dataset is checked (up to ``MAX_PROMPTS_CHECKED``), so a bad row fails
    here naming itself rather than in the worker mid-run; a stream's first row is checked here and
    every row where the worker reads it.
    """
    if dataset is None:
        return
    streaming = is_stream(dataset)
    if not streaming and len(dataset) == 0:
        raise ConfigError(f"{name} is empty: give it at least one row")
    if streaming and next(iter(dataset), None) is None:
        raise ConfigError(f"{name} (a stream) yielded no row: give it at least one")
    columns = first_row_columns(dataset)
    if "prompt" not in columns:
        if not has_env:
            raise ConfigError(f"{name} has no 'prompt' column (columns: {columns}); give conversational "
                              "prompts, or an environment_factory whose reset() returns the prompt")
        return
    if streaming:
        prompts: Iterable[Any] = [next(iter(dataset))["prompt"]]
    elif hasattr(dataset, "column_names"):  # a datasets.Dataset: read the one column, not whole rows
        prompts = dataset.select(range(min(len(dataset), MAX_PROMPTS_CHECKED)))["prompt"]
    else:
        prompts = (dataset[i]["prompt"] for i in range(min(len(dataset), MAX_PROMPTS_CHECKED)))
    for index, prompt in enumerate(prompts):
        check_prompt(prompt, f"{name} row {index}")
        refuse_image_parts(prompt)  # every prompt again where the worker renders it
