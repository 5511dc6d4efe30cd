"""Training chat templates: prefix-preserving stand-ins for the stock templates of known model families.

The multi-turn loop re-renders the whole conversation every turn. A stock template that rewrites
history (Qwen3's drops or re-spaces the reasoning of earlier assistant turns, and drops the empty
reasoning block that its ``enable_thinking=False`` generation prompt adds; DeepSeek-V3's cuts earlier
assistant turns up to their last ``</think>``) makes each turn's prompt disagree with the tokens held
so far, so every turn forks a new training sequence (correct, but each fork re-forwards the
conversation). A model family (:mod:`trainer.families`) may ship its own *training template*
(``trainer/families/templates/*_training.jinja``): it renders the generation prompt and the last
assistant turn as the stock template does, and earlier assistant turns exactly as the model produced them.

:func:`rollout_chat_template` picks the template the rollout loop renders with. The family is
recognised from the stock template's markers (:func:`trainer.families.family_for`), and its training
template is used only when the stock template behaves as the family's: both render the same text on
every conversation where they should agree (first prompts with and without tools and system prompt,
a final assistant turn with and without reasoning, tool results after an assistant turn with
``reasoning_content``), and the training template is prefix-preserving with the run's tools and
``chat_template_kwargs``. The tokenizer itself is left unchanged, so checkpoints keep the stock
template for inference.
"""

from __future__ import annotations

import logging
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trainer.families import Family, ToolCall, family_for
from trainer.rollout.chat_template import check_prefix_preserving

__all__ = ["renders_like_stock", "rollout_chat_template"]

logger = logging.getLogger(__name__)

# A stock template that cannot render a conversation at all (Llama 3.1's refuses two calls in a turn).
_RENDER_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError)

_Probe = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]


def _agreement_probes(family: Family, tools: list[dict[str, Any]] | None) -> list[_Probe]:
    """Conversations that a family's stock and training templates render identically.

    Returns:
        ``(messages, tools, add_generation_prompt)`` triples.
    """
    name = tools[0]["function"]["name"] if tools else "lookup"
    _, parsed = family.parse(family.format_calls("", [ToolCall(name=name, arguments={"step": 2})] * 2))
    calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             | ({"id": c["id"]} if c.get("id") else {}) for c in parsed if "error" not in c]
    calls = calls if family.parallel_calls else calls[:1]
    parsed = parsed if family.parallel_calls else parsed[:1]
    system = {"role": "system", "content": "You are a helpful assistant."}
    user = {"role": "user", "content": "Please do it."}
    start, end = family.reasoning or ("", "")
    thought = {"role": "assistant", "content": f"{start}\nTwo steps.\n{end}\n\nDone: 4." if start else "Done: 4."}
    reasoned_call = {"role": "assistant", "content": "Calling.", "reasoning_content": "One call.", "tool_calls": calls}
    reasoned_bare_call = {"role": "assistant", "content": "", "reasoning_content": "Call.", "tool_calls": calls[:1]}
    results = [family.tool_message(c, r) for c, r in zip(parsed, ("2", "4"), strict=False)]
    probes: list[_Probe] = []
    for schemas in [tools, None] if tools else [None]:
        probes += [
            ([user], schemas, True),
            ([system, user], schemas, True),
            ([system, user, thought], schemas, False),
            ([user, {"role": "assistant", "content": "Done: 4."}], schemas, False),
            ([system, user, reasoned_call, *results], schemas, True),
            ([user, reasoned_bare_call, results[0]], schemas, True),
        ]
    return probes


def renders_like_stock(family: Family, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None,
                       **kw: Any) -> str | None:
    """The training template of ``family`` that may stand in for ``tokenizer``'s stock template, if one may.

    Args:
        family: The family :func:`trainer.families.family_for` recognised in the stock template.
        tokenizer: The tokenizer with its stock template.
        tools: The tool schemas the run renders.
        **kw: The run's ``chat_template_kwargs``.

    Returns:
        The first of ``family.training_template_texts()`` that renders the same text as the stock
        template on every agreement probe and is prefix-preserving, else ``None``.
    """
    for text in family.training_template_texts():
        if _agrees(family, tokenizer, text, tools, **kw) and check_prefix_preserving(tokenizer, tools, text, **kw):
            return text
    return None


def _agrees(family: Family, tokenizer: PreTrainedTokenizerBase, ours_text: str, tools: list[dict[str, Any]] | None,
            **kw: Any) -> bool:
    """Whether ``ours_text`` and the stock template render every agreement probe alike."""
    try:
        for messages, schemas, generation in _agreement_probes(family, tools):
            # transformers types ``tools`` as an invariant list of dict-or-callable: a list of dicts is fine.
            ours = tokenizer.apply_chat_template(messages, tools=schemas,  # type: ignore[arg-type]
                                                 chat_template=ours_text, add_generation_prompt=generation,
                                                 tokenize=False, **kw)
            theirs = tokenizer.apply_chat_template(messages, tools=schemas,  # type: ignore[arg-type]
                                                   add_generation_prompt=generation, tokenize=False, **kw)
            if ours != theirs:
                return False
    except _RENDER_ERRORS:  # the stock template cannot render a probe: not this family's
        return False
    return True


def _keeps_prefixes(tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None, **kw: Any) -> bool:
    try:
        return check_prefix_preserving(tokenizer, tools, **kw)
    except _RENDER_ERRORS:  # it cannot render the synthetic tool conversation: not prefix-preserving either
        return False


def rollout_chat_template(
    tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None, **chat_template_kwargs: Any,
) -> str | None:
    """The chat template the multi-turn rollout loop should render with, checked at start.

    Args:
        tokenizer: The run's tokenizer with its stock chat template.
        tools: JSON schemas of the tools the run shows the model (``None``: checked without tools).
        **chat_template_kwargs: The run's ``chat_template_kwargs`` (e.g. ``enable_thinking=False``).

    Returns:
        ``None`` to keep the tokenizer's own template (it is prefix-preserving, or it is not and no
        shipped training template fits it: a warning says so, and turns will fork), else the text of
        the training template that replaces it in the rollout loop (an info line says which).
    """
    family = family_for(tokenizer)
    if _keeps_prefixes(tokenizer, tools, **chat_template_kwargs):
        return None
    chosen = renders_like_stock(family, tokenizer, tools, **chat_template_kwargs) if family is not None else None
    if family is not None and chosen is not None:
        logger.info(
            "the chat template (%s family) is not prefix-preserving across tool-calling turns: rollouts "
            "render with toolgym's %s training template instead (trainer/families/templates/%s; same generation "
            "prompt, earlier turns kept as generated). The tokenizer and its checkpoints keep the stock "
            "template.", family.title, family.name, family.training_template)
        return chosen
    fit = (f"of the {family.name} family but differs from the template toolgym ships for it" if family is not None
           else "of no model family toolgym knows")
    logger.warning(
        "the chat template is not prefix-preserving across tool-calling turns (re-rendering a conversation "
        "changes the tokens of earlier turns, e.g. it drops their reasoning) and is %s. Training stays correct, "
        "but every such turn forks a new training sequence that re-forwards the conversation (see "
        "rollout/fork_frac). To avoid it, pass a processing_class whose chat_template renders earlier turns "
        "unchanged.", fit)
    return None
