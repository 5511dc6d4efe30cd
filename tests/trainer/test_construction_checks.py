"""What the trainer refuses at construction: each combination fails with a clear ConfigError."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, TrainingArguments

from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import ConfigError


class CounterEnv:
    """Never constructed: the refusals come first."""

    def reset(self, **kwargs: Any) -> str:
        """No prompt text."""
        return ""


def _config(tmp_path: Path, **overrides: Any) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                           gradient_checkpointing=False, max_steps=1, **overrides)


def _dataset(**columns: list[Any]) -> Dataset:
    n = len(next(iter(columns.values()))) if columns else 2
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)], **columns})


def _trainer(tiny_model_dir: Path, tmp_path: Path, **kwargs: Any) -> AsyncGRPOTrainer:
    kwargs.setdefault("reward_funcs", token_reward)
    kwargs.setdefault("train_dataset", _dataset())
    kwargs.setdefault("args", _config(tmp_path))
    return AsyncGRPOTrainer(model=str(tiny_model_dir), **kwargs)


def test_a_reward_model_id_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"reward_funcs\[1\] is the model id 'org/reward-model'.*callables"):
        _trainer(tiny_model_dir, tmp_path, reward_funcs=[token_reward, "org/reward-model"])


def test_a_pretrained_model_as_reward_function_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    reward_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\] is a Qwen3ForCausalLM: reward models are not"):
        _trainer(tiny_model_dir, tmp_path, reward_funcs=reward_model)


def test_liger_kernel_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="use_liger_kernel=True is not supported"):
        _trainer(tiny_model_dir, tmp_path, args=_config(tmp_path, use_liger_kernel=True))


@pytest.mark.parametrize("lora", [LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
                                  LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])])
def test_peft_on_lm_head_is_refused_before_the_first_step(tiny_model_dir: Path, tmp_path: Path,
                                                         lora: LoraConfig) -> None:
    with pytest.raises(ConfigError, match="lm_head"):
        _trainer(tiny_model_dir, tmp_path, peft_config=lora)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # PEFT's, on the tiny model
def test_a_model_already_wrapped_with_a_head_adapter_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="output head is a Linear, not a plain nn.Linear"):
        AsyncGRPOTrainer(model=model, reward_funcs=token_reward, train_dataset=_dataset(), args=_config(tmp_path))


def test_lora_on_all_linear_layers_is_accepted(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path, peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert hasattr(trainer.model, "peft_config")


def test_a_dict_environment_factory_needs_an_environment_column(tiny_model_dir: Path, tmp_path: Path) -> None:
    factories = {"counter": CounterEnv, "other": CounterEnv}
    with pytest.raises(ConfigError, match=r"'environment' column, but train_dataset has none \(columns: \['prompt'\]"):
        _trainer(tiny_model_dir, tmp_path, environment_factory=factories)
    with pytest.raises(ConfigError, match=r"names \['nowhere'\], which environment_factory does not have"):
        _trainer(tiny_model_dir, tmp_path, environment_factory=factories,
                 train_dataset=_dataset(environment=["counter", "nowhere"]))
    trainer = _trainer(tiny_model_dir, tmp_path, environment_factory=factories,
                       train_dataset=_dataset(environment=["counter", "other"]))
    assert trainer.environment_factory is factories


def test_a_list_of_rows_is_routed_like_a_dataset(tiny_model_dir: Path, tmp_path: Path) -> None:
    factories = {"counter": CounterEnv, "other": CounterEnv}
    rows = [{"prompt": [{"role": "user", "content": "q"}], "environment": name} for name in ("counter", "nowhere")]
    with pytest.raises(ConfigError, match=r"names \['nowhere'\], which environment_factory does not have"):
        _trainer(tiny_model_dir, tmp_path, environment_factory=factories, train_dataset=rows)


def test_a_dict_environment_factory_without_a_dataset_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    factories = {"counter": CounterEnv, "other": CounterEnv}
    with pytest.raises(ConfigError, match=r"environment_factory is a dict \(\['counter', 'other'\]\) and there is no "
                                          r"train_dataset: each rollout's environment is picked by a dataset row"):
        _trainer(tiny_model_dir, tmp_path, environment_factory=factories, train_dataset=None)
    trainer = _trainer(tiny_model_dir, tmp_path, environment_factory=CounterEnv, train_dataset=None)
    assert trainer.rollout_dataset is None  # one factory: the environment owns the data


def test_an_eval_dataset_is_checked_under_its_own_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"eval_dataset has no 'prompt' column"):
        _trainer(tiny_model_dir, tmp_path, eval_dataset=Dataset.from_dict({"question": ["q"]}))


def test_ignore_data_skip_must_stay_true(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ignore_data_skip must stay True"):
        _config(tmp_path, ignore_data_skip=False)
    assert _config(tmp_path).ignore_data_skip is True


def test_activation_checkpointing_is_on_by_default_under_the_installed_transformers_name(tmp_path: Path) -> None:
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    if "activation_checkpointing" in names:  # transformers >= 5.23
        assert config.activation_checkpointing is True and "activation_checkpointing_kwargs" in names
    assert config.gradient_checkpointing is True
