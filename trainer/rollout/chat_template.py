"""Chat-template helpers for multi-turn tool calling: render, parse, rebuild, check.

The rollout loop renders the whole conversation each turn (:func:`render_prompt_ids`), samples a
completion, splits it into text and tool calls (:func:`parse_tool_calls`), appends the assistant
message (:func:`build_assistant_message`) and one tool message per call, and renders again. Its
samples stay one sequence only when the template is *prefix-preserving*: the tokens of a turn's
prompt plus its completion must start the next turn's prompt (:func:`check_prefix_preserving`).
Known families whose stock template is not get a training template (:mod:`trainer.rollout.training_templates`);
the loop renders through :class:`trainer.rollout.prompt_render.ConversationRenderer`, which re-tokenizes
only what a turn added.

What a tool call looks like is the business of the model family (:mod:`trainer.families`): every
function here takes the family whose template renders the conversation (Qwen3's ``<tool_call>`` JSON
when none is given). :data:`CHAT_TEMPLATE` is the Qwen-style template shipped with the tiny model
(``trainer/families/templates/qwen3_kit.jinja``)::

    <|im_start|>system
    {system}\\n\\n# Tools ... <tools>\\n{tool schema JSON, one per line}\\n</tools> ...<|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}\\n<tool_call>\\n{"name": "increment", "arguments": {"step": 2}}\\n</tool_call><|im_end|>
    <|im_start|>user
    <tool_response>\\n{tool content}\\n</tool_response><|im_end|>
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.exceptions import ConfigError
from trainer.families import QWEN3, Family, ToolCall, ToolCallFailure, family_for, template_text

__all__ = [
    "CHAT_TEMPLATE",
    "EMPTY_REASONING",
    "REASONING_OPENINGS",
    "ToolCall",
    "ToolCallFailure",
    "build_assistant_message",
    "check_prefix_preserving",
    "completion_text",
    "parse_tool_calls",
    "reasoning_openings",
    "refuse_image_parts",
    "render_prompt_ids",
    "render_prompt_text",
    "rollout_family",
    "stop_token_ids",
    "synthetic_replies",
]

CHAT_TEMPLATE = template_text("qwen3_kit.jinja")


def rollout_family(chat_template: object) -> Family:
    """The family whose format the rollout reads and writes for a conversation rendered with ``chat_template``.

    Args:
        chat_template: The template the conversation renders with (a training template or the
            tokenizer's own; anything but a string, e.g. ``None``, counts as the Qwen3 / Hermes default).

    Returns:
        The family :func:`trainer.families.family_for` recognises, else Qwen3 (the trainer warned at start).
    """
    return family_for(chat_template, warn=False) or QWEN3


def parse_tool_calls(text: str, family: Family = QWEN3,
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall | ToolCallFailure]]:
    """Split generated text into its content and its tool calls, in emitted order (``family.parse``).

    Every call becomes one record: a :class:`ToolCall` (``{"name": str, "arguments": dict}``) when it
    reads, else a :class:`ToolCallFailure` (test with ``"error" in call``); a call never closed (a
    completion cut by the length limit) is a failure too. Parsing never raises.

    Args:
        text: The decoded completion, without the end-of-turn token.
        family: The rendering template's family (:func:`rollout_family`).
        tools: The tool schemas offered, which type arguments a format writes as text.

    Returns:
        ``(content, calls)``: the text without its calls, stripped of surrounding whitespace, and the records.
    """
    return family.parse(text, tools)


def build_assistant_message(text: str, family: Family = QWEN3,
                            tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Turn generated text into the assistant message that the template renders back to ``text``.

    When ``text`` is in the family's own layout (``family.format_calls`` of its content and calls,
    e.g. the content then each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
    for Qwen3), the message is structured: ``{"role": "assistant", "content": content, "tool_calls":
    [{"type": "function", "function": {"name": ..., "arguments": {...}}}, ...]}`` (no ``tool_calls``
    key when there is no call). Otherwise (a malformed or unterminated call, other spacing or key
    order, text after a call, a reasoning channel) the message is verbatim, ``{"role": "assistant",
    "content": text}``, so the next prompt still shows the model exactly what it wrote and keeps the
    token prefix. Either way, run the calls that :func:`parse_tool_calls` returns.

    Args:
        text: The decoded completion, without the end-of-turn token.
        family: The rendering template's family (:func:`rollout_family`).
        tools: The tool schemas offered.

    Returns:
        The message dict to append to the conversation.
    """
    content, calls = family.parse(text, tools)
    good = [c for c in calls if "error" not in c]
    if len(good) != len(calls) or family.format_calls(content, good) != text:  # type: ignore[arg-type]
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if good:
        message["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 | ({"id": c["id"]} if c.get("id") else {}) for c in good]
    return message


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, family: Family) -> list[int]:
    """The ids of the tokens that end a turn: the family's stop tokens the tokenizer has, and its EOS.

    GPT-OSS's turns end on ``<|call|>`` or ``<|return|>``, GLM's on the next role's token: sampling stops
    at each, and a turn ended by one is not cut short.
    """
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in family.stop_tokens if t in vocab]
    eos = tokenizer.eos_token_id
    return ids + ([eos] if isinstance(eos, int) and eos not in ids else [])


def completion_text(tokenizer: PreTrainedTokenizerBase, output_ids: list[int], end_ids: list[int]) -> str:
    """A completion's text as its family's parser reads it: the ending stop token cut, markers kept.

    Special tokens are decoded too (GPT-OSS's and Kimi K2's markers are special tokens), so that an
    earlier turn rendered from this text holds every token the model generated.

    Args:
        tokenizer: The run's tokenizer.
        output_ids: The turn's generated ids.
        end_ids: The ids that end a turn (a last one is cut).
    """
    ids = output_ids[:-1] if output_ids and output_ids[-1] in end_ids else output_ids
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    **chat_template_kwargs: Any,
) -> list[int]:
    """Token ids of the whole conversation followed by the generation prompt.

    Args:
        tokenizer: A tokenizer with a chat template.
        messages: The conversation so far (system/user/assistant/tool message dicts).
        tools: JSON schemas of the tools, rendered into the system prompt; ``None`` for none.
        chat_template: A template to render with instead of the tokenizer's own (e.g. a training
            template from :mod:`trainer.rollout.training_templates`); ``None`` for the tokenizer's.
        **chat_template_kwargs: Extra template variables (e.g. ``enable_thinking=False``).

    Returns:
        The prompt token ids (the template's own special tokens included; nothing added).
    """
    return list(tokenizer(render_prompt_text(tokenizer, messages, tools, chat_template, **chat_template_kwargs),
                          add_special_tokens=False)["input_ids"])


def render_prompt_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    **chat_template_kwargs: Any,
) -> str:
    """The text that :func:`render_prompt_ids` tokenizes (same arguments); image parts are refused."""
    refuse_image_parts(messages)
    return tokenizer.apply_chat_template(  # type: ignore[return-value]  # tokenize=False: a str
        messages,
        tools=tools,  # type: ignore[arg-type]  # typed as an invariant list of dict-or-callable
        chat_template=chat_template, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)


_IMAGE_PART_TYPES = frozenset({"image", "image_url", "input_image", "video", "video_url"})


def refuse_image_parts(messages: list[dict[str, Any]]) -> None:
    """Raise :class:`~trainer.exceptions.ConfigError` when a message holds an image (or video) part.

    Vision-language models train on text only for now; an image part would otherwise be dropped or
    mis-rendered by the chat template and the server would see a prompt the trainer never trains on.
    """
    for i, message in enumerate(messages):
        parts = message.get("content") if isinstance(message, dict) else None
        for part in parts if isinstance(parts, list) else []:
            if isinstance(part, dict) and (
                part.get("type") in _IMAGE_PART_TYPES or {"image", "image_url"} & part.keys()
            ):
                raise ConfigError(
                    f"message {i} ({message.get('role')!r}) has an image part ({part.get('type')!r}): images are not "
                    "supported yet; vision-language models train on text only, so give prompts as text"
                )


# What a Qwen3-style template opens an assistant turn with when thinking is off.
EMPTY_REASONING = "<think>\n\n</think>\n\n"

# How the synthetic assistant turns open: plain text, a reasoning block, an empty reasoning block
# (what a reasoning model emits; templates that drop or re-space earlier reasoning fail on these).
REASONING_OPENINGS = ("", "<think>\nThe counter needs two steps.\n</think>\n\n", EMPTY_REASONING)


def reasoning_openings(family: Family) -> tuple[str, ...]:
    """:data:`REASONING_OPENINGS` in ``family``'s reasoning markers (plain text only for a family without any)."""
    if family.reasoning is None:
        return ("",)
    start, end = family.reasoning
    return tuple(o.replace("<think>", start).replace("</think>", end) for o in REASONING_OPENINGS)


def _left_open(prompt: str, family: Family) -> bool:
    """Whether the generation prompt opens a reasoning block (Qwen3.5's ``<think>\\n``) that the model must close."""
    if family.reasoning is None:
        return False
    start, end = family.reasoning
    return prompt.rfind(start) > prompt.rfind(end)


def _unopened(prompt: str, opening: str) -> str:
    """``opening`` without what the generation prompt already wrote of it (Qwen3.5's prompt opens ``<think>\\n``)."""
    for size in range(len(opening), 0, -1):
        if prompt.endswith(opening[:size]):
            return opening[size:]
    return opening


def synthetic_replies(tools: list[dict[str, Any]] | None, opening: str,
                      family: Family = QWEN3) -> list[tuple[str, list[str]]]:
    """The assistant texts of a synthetic tool conversation (as a model emits them) and their tool results.

    Args:
        tools: Tool schemas; the first one's name is called (a made-up ``lookup`` without tools).
        opening: What each assistant text starts with (one of :data:`REASONING_OPENINGS`).
        family: The family whose format the calls are written in.

    Returns:
        ``(assistant text, tool results)`` per turn: one call, then some text and two calls.
    """
    name = tools[0]["function"]["name"] if tools else "lookup"
    call = ToolCall(name=name, arguments={"step": 2})
    return [(opening + family.format_calls("", [call]), ["2"]),
            (opening + family.format_calls("Two more.", [call, call]), ["4", "6"])]


def _end_id(tokenizer: PreTrainedTokenizerBase, family: Family) -> int:
    """The id of the token that ends a turn with calls: the family's, else (not in the vocabulary) the EOS."""
    token = family.turn_end(True)
    found = tokenizer.convert_tokens_to_ids(token) if token in tokenizer.get_vocab() else None
    return found if isinstance(found, int) else tokenizer.eos_token_id  # type: ignore[no-any-return]


def _merges(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str, ids: list[int]) -> bool:
    """Whether tokenizing ``prompt + completion`` at once gives other ids than each apart (a merge across the
    boundary, e.g. a completion opening with ``\\n`` after a prompt ending ``<think>\\n``)."""
    return list(tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]) != ids


def check_prefix_preserving(
    tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None, **kw: Any,
) -> bool:
    """Whether the tokenizer's template keeps the token prefix across tool-calling turns.

    Plays the rollout loop on a synthetic conversation (system, user, then an assistant turn with one
    tool call and one with two, each followed by its tool messages), once for each of
    :data:`REASONING_OPENINGS` in the family's reasoning markers (an opening that leaves a reasoning
    block the generation prompt opened unclosed is skipped: no model of the family writes that, and so is
    one whose text the tokenizer merges with the prompt's end, which no template can keep apart): each
    turn's prompt ids followed by the ids of the assistant text (as tokenized, without what the
    generation prompt already opened, plus the family's end-of-turn token: what a model emitting it
    produces) must start the next turn's
    prompt ids, with the assistant message built from the text by :func:`build_assistant_message`, as
    the loop does. The calls are written in the checked template's family format (:func:`rollout_family`).

    Args:
        tokenizer: The tokenizer whose chat template is checked.
        tools: Tool schemas to render in the system prompt (the first one's name is called);
            ``None`` renders without tools and calls a made-up ``lookup`` tool.
        chat_template: Check this template instead of the tokenizer's own.
        **kw: Extra chat-template variables, as the rollout loop would pass them.

    Returns:
        ``True`` when every turn extends the previous one token by token.

    Raises:
        Whatever ``apply_chat_template`` raises for a template that cannot render a tool
        conversation at all (no template, ``TemplateError``): the rollout loop could not run either.
    """
    family = rollout_family(chat_template or tokenizer.chat_template)
    end = _end_id(tokenizer, family)
    for opening in reasoning_openings(family):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Please do it in two calls."},
        ]
        previous = render_prompt_ids(tokenizer, messages, tools, chat_template, **kw)
        prompt_text = render_prompt_text(tokenizer, messages, tools, chat_template, **kw)
        if family.reasoning and _left_open(prompt_text, family) and family.reasoning[1] not in _unopened(
                prompt_text, opening):
            continue
        for full_text, results in synthetic_replies(tools, opening, family):
            text = _unopened(prompt_text, opening) + full_text[len(opening):]
            completion = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if _merges(tokenizer, prompt_text, text, previous + completion):
                break  # the tokenizer joins the prompt's end and the completion: such turns fork whatever the template
            expected = previous + completion + [end]
            _, calls = family.parse(text, tools)
            messages += [build_assistant_message(text, family, tools),
                         *(family.tool_message(call, result) for call, result in zip(calls, results, strict=True))]
            previous = render_prompt_ids(tokenizer, messages, tools, chat_template, **kw)
            prompt_text = render_prompt_text(tokenizer, messages, tools, chat_template, **kw)
            if previous[: len(expected)] != expected:
                return False
    return True
