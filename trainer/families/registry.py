"""The family registry: every known family, looked up by name or recognised from a chat template."""

from __future__ import annotations

import difflib
import logging
from typing import Any

from trainer.exceptions import ConfigError
from trainer.families.base import Family
from trainer.families.deepseek import DEEPSEEK_V3
from trainer.families.glm import GLM4
from trainer.families.gpt_oss import GPT_OSS
from trainer.families.kimi import KIMI_K2
from trainer.families.llama import LLAMA3
from trainer.families.mistral import MISTRAL
from trainer.families.qwen import QWEN3, QWEN3_5

__all__ = ["families", "family_for", "family_named", "register_family"]

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, Family] = {f.name: f for f in (QWEN3, QWEN3_5, LLAMA3, GPT_OSS, MISTRAL, GLM4, KIMI_K2,
                                                    DEEPSEEK_V3)}


def families() -> tuple[Family, ...]:
    """Every registered family: the shipped ones in a fixed order, then the user's in registration order."""
    return tuple(_REGISTRY.values())


def family_named(name: str) -> Family:
    """The family registered as ``name``.

    Raises:
        ConfigError: No family has that name (the message lists the names and suggests the closest).
    """
    family = _REGISTRY.get(name)
    if family is not None:
        return family
    close = difflib.get_close_matches(name, _REGISTRY, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"no model family named {name!r}.{hint} Known families: {', '.join(_REGISTRY)}; "
                      "add your own with trainer.families.register_family")


def register_family(family: Family, replace: bool = False) -> Family:
    """Add ``family`` to the registry, so that :func:`family_for` recognises its templates.

    Register it in the process that builds the trainer and, for the rollout worker to know it too, at
    import time of a module the worker imports (the module of your ``loop_cls`` or reward function).

    Args:
        family: An instance of a :class:`~trainer.families.Family` subclass.
        replace: Replace a family already registered under that name (else that is an error).

    Returns:
        ``family``.

    Raises:
        ConfigError: ``family`` is not a :class:`Family`, or its name is taken and ``replace`` is false.
    """
    if not isinstance(family, Family):
        raise ConfigError(f"register_family takes a trainer.families.Family instance, got {type(family).__name__}")
    if family.name in _REGISTRY and not replace and _REGISTRY[family.name] is not family:
        raise ConfigError(f"a model family named {family.name!r} is registered already: pick another name, or pass "
                          "replace=True to replace it")
    _REGISTRY[family.name] = family
    return family


def family_for(tokenizer_or_template: Any, warn: bool = True) -> Family | None:
    """The family whose markers a chat template carries (the family with the most markers present wins).

    Args:
        tokenizer_or_template: A tokenizer (its ``chat_template`` is read) or a template's text.
        warn: Log a warning that names :func:`register_family` and the known families when none matches.

    Returns:
        The family, or ``None`` for a template of no known family (the trainer then reads tool calls
        in the Qwen3 / Hermes format, as before families existed).
    """
    template = getattr(tokenizer_or_template, "chat_template", tokenizer_or_template)
    if isinstance(template, str):
        matches = [f for f in reversed(_REGISTRY.values()) if all(m in template for m in f.markers)]
        if matches:
            return max(matches, key=lambda f: len(f.markers))
    if warn:
        logger.warning(
            "the chat template is of no known model family (%s): tool calls are read in the Qwen3 / Hermes format "
            "(<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>). For another format, describe it with "
            "trainer.families.register_family(...) (docs/multiturn.md).", ", ".join(_REGISTRY))
    return None
