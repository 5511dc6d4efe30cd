"""Loading the policy: causal LMs and vision-language checkpoints, trained text-only.

A model id or directory whose config is a vision-language one (it has a ``vision_config``: Qwen3.5,
Qwen3-VL, ...) loads with ``AutoModelForImageTextToText``; anything else with ``AutoModelForCausalLM``.
Of a vision-language model only the language model trains: :func:`freeze_outside_language_model`
sets ``requires_grad=False`` on the vision tower and the multimodal projector (so the optimizer holds
no state for them), and the weight sync leaves them out (``trainer.sync.gather.PolicyWeights``'s
``skip``), so the server keeps the values it loaded. The sync sends the checkpoint's names
(``trainer.sync.gather.checkpoint_tensors``), which is what vLLM's loader for the architecture maps
(``model.language_model.*`` -> its language model, ``model.visual.*`` -> its vision tower, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from trainer.exceptions import ConfigError

__all__ = [
    "check_model_path",
    "freeze_outside_language_model",
    "is_vision_language",
    "language_model_parameter_names",
    "load_model",
]


def is_vision_language(config: object) -> bool:
    """Whether ``config`` describes a vision-language model (it carries a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def check_model_path(model_id: str) -> None:
    """Refuse a model that names a local directory which does not exist, saying so (see :func:`load_model`)."""
    path = Path(model_id).expanduser()
    looks_local = path.is_absolute() or model_id.startswith((".", "~")) or model_id.count("/") > 1
    if looks_local and not path.exists():
        raise ConfigError(f"model {model_id!r} is not a directory on this machine (it reads as a local path, "
                          "not a hub id like 'Qwen/Qwen3-0.6B'): check the path")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"model {model_id!r} is a file; give the directory that holds its config.json")


def load_model(model_id: str, *, trust_remote_code: bool = False, **init_kwargs: object) -> PreTrainedModel:
    """Load ``model_id`` with the Auto class its config needs (see the module docstring).

    Args:
        model_id: A hub id or a local directory.
        trust_remote_code: Passed to ``from_pretrained``.
        **init_kwargs: ``model_init_kwargs`` (dtype, revision, ...), passed to ``from_pretrained``.

    Raises:
        ConfigError: ``model_id`` reads as a local path (absolute, ``./``, ``~``, or more than one ``/``)
            and no such directory exists (transformers would call it a malformed hub id).
    """
    check_model_path(model_id)
    config = AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code,
                                        revision=init_kwargs.get("revision"))
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    return auto.from_pretrained(model_id, trust_remote_code=trust_remote_code, **init_kwargs)


def language_model_parameter_names(model: Any) -> set[str]:
    """Names of the parameters of ``model``'s language model: its decoder and its output head."""
    parts = [model.get_decoder(), model.get_output_embeddings()]
    own = {id(p) for part in parts if part is not None for p in part.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in own}


def freeze_outside_language_model(model: nn.Module) -> set[str]:
    """Freeze every parameter outside the language model of a vision-language ``model``.

    Returns:
        The frozen parameters' names (empty for a text-only model, which is left as it is).
    """
    if not is_vision_language(model.config):
        return set()
    keep = language_model_parameter_names(model)
    frozen = {name for name, _ in model.named_parameters() if name not in keep}
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return frozen
