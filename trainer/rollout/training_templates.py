"""Training chat templates: prefix-preserving stand-ins for the stock templates of known model families.

The multi-turn loop re-renders the whole conversation every turn. A stock template that rewrites
history (Qwen3's drops or re-spaces the reasoning of earlier assistant turns, and drops the empty
reasoning block that its ``enable_thinking=False`` generation prompt adds; DeepSeek-V3's cuts earlier
assistant turns up to their last ``</think>``) makes each turn's prompt
disagree with the tokens held so far, so every turn forks a new training sequence (SPEC §7: correct,
but each fork re-forwards the conversation). For the families below toolgym ships its own *training
template* (``trainer/rollout/templates/*.jinja``): it renders the generation prompt and the last assistant
turn as the stock template does, and earlier assistant turns exactly as the model produced them.

:func:`rollout_chat_template` picks the template the rollout loop renders with. A family is
recognised by what its stock template does, not by a model name: the stock template must carry the
family's markers and render the same text as the training template on every conversation where the
two should agree (first prompts with and without tools and system prompt, a final assistant turn
with and without reasoning, tool results after an assistant turn with ``reasoning_content``), and
the training template must be prefix-preserving with the run's tools and ``chat_template_kwargs``.
The tokenizer itself is left unchanged, so checkpoints keep the stock template for inference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trainer.rollout.chat_template import check_prefix_preserving

__all__ = ["TRAINING_TEMPLATES", "TrainingTemplate", "rollout_chat_template"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingTemplate:
    """A shipped training template.

    Attributes:
        family: Human name of the model family (for messages).
        filename: The template file in ``trainer/rollout/templates``.
        markers: Text that every stock template of the family contains (a cheap first filter).
    """

    family: str
    filename: str
    markers: tuple[str, ...]

    @property
    def text(self) -> str:
        """The template's Jinja source."""
        return _read_template(self.filename)

    def matches(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None, **kw: Any) -> bool:
        """Whether ``tokenizer``'s stock template is this family's, so that the swap is safe.

        Args:
            tokenizer: The tokenizer with its stock template.
            tools: The tool schemas the run renders.
            **kw: The run's ``chat_template_kwargs``.
        """
        stock = tokenizer.chat_template
        if not isinstance(stock, str) or not all(marker in stock for marker in self.markers):
            return False
        try:
            for messages, schemas, generation in _agreement_probes(tools):
                # transformers types ``tools`` as an invariant list of dict-or-callable: a list of dicts is fine.
                ours = tokenizer.apply_chat_template(messages, tools=schemas,  # type: ignore[arg-type]
                                                     chat_template=self.text,
                                                     add_generation_prompt=generation, tokenize=False, **kw)
                theirs = tokenizer.apply_chat_template(messages, tools=schemas,  # type: ignore[arg-type]
                                                       add_generation_prompt=generation, tokenize=False, **kw)
                if ours != theirs:
                    return False
        except (TemplateError, TypeError, ValueError):  # the stock template cannot render a probe: not this family
            return False
        return check_prefix_preserving(tokenizer, tools, chat_template=self.text, **kw)


@cache
def _read_template(filename: str) -> str:
    return resources.files("trainer.rollout").joinpath("templates", filename).read_text(encoding="utf-8")


TRAINING_TEMPLATES: tuple[TrainingTemplate, ...] = (
    TrainingTemplate("Qwen3", "qwen3_training.jinja", ("<|im_start|>", "<think>", "</think>", "<tool_call>")),
    TrainingTemplate("DeepSeek-V3", "deepseek_v3_training.jinja", (
        "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>")),
)


_Probe = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]


def _agreement_probes(tools: list[dict[str, Any]] | None) -> list[_Probe]:
    """Conversations that a family's stock and training templates render identically.

    Returns:
        ``(messages, tools, add_generation_prompt)`` triples.
    """
    name = tools[0]["function"]["name"] if tools else "lookup"
    call = {"type": "function", "function": {"name": name, "arguments": {"step": 2}}}
    system = {"role": "system", "content": "You are a helpful assistant."}
    user = {"role": "user", "content": "Please do it."}
    thought = {"role": "assistant", "content": "<think>\nTwo steps.\n</think>\n\nDone: 4."}
    reasoned_call = {"role": "assistant", "content": "Calling.", "reasoning_content": "One call.",
                     "tool_calls": [call, call]}
    reasoned_bare_call = {"role": "assistant", "content": "", "reasoning_content": "Call.", "tool_calls": [call]}
    results = [{"role": "tool", "content": "2"}, {"role": "tool", "content": "4"}]
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
    if check_prefix_preserving(tokenizer, tools, **chat_template_kwargs):
        return None
    for template in TRAINING_TEMPLATES:
        if template.matches(tokenizer, tools, **chat_template_kwargs):
            logger.info(
                "the chat template (%s family) is not prefix-preserving across tool-calling turns: rollouts "
                "render with toolgym's %s training template instead (trainer/rollout/templates/%s; same generation "
                "prompt, earlier turns kept as generated). The tokenizer and its checkpoints keep the stock "
                "template.", template.family, template.family, template.filename)
            return template.text
    logger.warning(
        "the chat template is not prefix-preserving across tool-calling turns (re-rendering a conversation "
        "changes the tokens of earlier turns, e.g. it drops their reasoning) and is not one of the families "
        "toolgym ships a training template for (%s). Training stays correct, but every such turn forks a new "
        "training sequence that re-forwards the conversation (see rollout/fork_frac). To avoid it, pass a "
        "processing_class whose chat_template renders earlier turns unchanged.",
        ", ".join(t.family for t in TRAINING_TEMPLATES))
    return None
