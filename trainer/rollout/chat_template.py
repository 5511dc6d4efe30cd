"""Chat-template helpers for multi-turn tool calling: render, parse, rebuild, check.

The rollout loop renders the whole conversation each turn (:func:`render_prompt_ids`), samples a
completion, splits it into text and tool calls (:func:`parse_tool_calls`), appends the assistant
message (:func:`build_assistant_message`) and one tool message per call, and renders again. Its
samples stay one sequence only when the template is *prefix-preserving*: the tokens of a turn's
prompt plus its completion must start the next turn's prompt (:func:`check_prefix_preserving`).
Known families whose stock template is not get a training template (:mod:`trainer.rollout.training_templates`);
the loop renders through :class:`trainer.rollout.prompt_render.ConversationRenderer`, which re-tokenizes
only what a turn added.

:data:`CHAT_TEMPLATE` is the Qwen-style template shipped with the tiny model (the same text layout as
Qwen2.5/Qwen3 without reasoning blocks)::

    <|im_start|>system
    {system}\\n\\n# Tools ... <tools>\\n{tool schema JSON, one per line}\\n</tools> ...<|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}\\n<tool_call>\\n{"name": "increment", "arguments": {"step": 2}}\\n</tool_call><|im_end|>
    <|im_start|>user
    <tool_response>\\n{tool content}\\n</tool_response><|im_end|>

Consecutive tool messages share one ``user`` turn. Assistant turns (content and ``<|im_end|>``) are
wrapped in ``{% generation %}`` so ``return_assistant_tokens_mask=True`` marks the trained tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypedDict

from transformers import PreTrainedTokenizerBase

from trainer.exceptions import ConfigError

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "EMPTY_REASONING",
    "REASONING_OPENINGS",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ToolCall",
    "ToolCallFailure",
    "build_assistant_message",
    "check_prefix_preserving",
    "parse_tool_calls",
    "refuse_image_parts",
    "render_prompt_ids",
    "render_prompt_text",
    "synthetic_replies",
]

IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is none -%}{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{{- content | tojson -}}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set system = text(messages[0].content) -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = none -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system -%}{{- system + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif system is not none -%}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' + text(message.content) + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set content = text(message.content) -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- content -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if call.function is defined -%}{%- set call = call.function -%}{%- endif -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}"
    "{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- raise_exception('unsupported message role ' + message.role | string + ' (system only first)') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class ToolCall(TypedDict):
    """A well-formed tool call, as emitted: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


class ToolCallFailure(TypedDict):
    """A ``<tool_call>`` block that could not be read; report ``error`` to the model as the tool
    message and count a tool failure, instead of calling anything.

    Attributes:
        name: The tool name when it could be read (valid JSON object with a string ``name``), else ``None``.
        arguments: Always ``None``, so that ``tool(**call["arguments"])`` on a failure fails loudly.
        error: A one-line explanation meant for the model, e.g. ``"invalid tool call JSON: Expecting
            ',' delimiter (line 1, column 30)"``.
        raw: The text between the tags (the rest of the text for an unterminated block).
    """

    name: str | None
    arguments: None
    error: str
    raw: str


_BLOCK = re.compile(re.escape(TOOL_CALL_START) + "(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def _read_call(raw: str) -> ToolCall | ToolCallFailure:
    """Decode one block's JSON into a call, or explain why it is not one."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        error = f"invalid tool call JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        return ToolCallFailure(name=None, arguments=None, error=error, raw=raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        error = 'invalid tool call: expected {"name": <string>, "arguments": <object>}'
        return ToolCallFailure(name=None, arguments=None, error=error, raw=raw)
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        error = f"invalid tool call to {obj['name']!r}: arguments must be a JSON object"
        return ToolCallFailure(name=obj["name"], arguments=None, error=error, raw=raw)
    return ToolCall(name=obj["name"], arguments=arguments)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall | ToolCallFailure]]:
    """Split generated text into its content and its tool calls, in emitted order.

    Every ``<tool_call>...</tool_call>`` block becomes one record: a :class:`ToolCall`
    (``{"name": str, "arguments": dict}``) when it holds a JSON object with a string ``name`` and
    an object ``arguments`` (missing means ``{}``; a JSON string holding an object is accepted), else
    a :class:`ToolCallFailure` (test with ``"error" in call``). A ``<tool_call>`` never closed (a
    completion cut by the length limit) is a failure too. Parsing never raises.

    Args:
        text: The decoded completion, without the end-of-turn token.

    Returns:
        ``(content, calls)``: the text with every block removed, stripped of surrounding
        whitespace, and the records.
    """
    calls: list[ToolCall | ToolCallFailure] = []
    pieces: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        pieces.append(text[pos : match.start()])
        calls.append(_read_call(match.group(1).strip()))
        pos = match.end()
    tail = text[pos:]
    start = tail.find(TOOL_CALL_START)
    if start >= 0:
        raw = tail[start + len(TOOL_CALL_START) :].strip()
        calls.append(ToolCallFailure(name=None, arguments=None, error="unterminated tool call", raw=raw))
        tail = tail[:start]
    pieces.append(tail)
    return "".join(pieces).strip(), calls


def _assistant_text(content: str, calls: list[ToolCall]) -> str:
    """What :data:`CHAT_TEMPLATE` renders inside an assistant turn for this content and these calls."""
    blocks = [
        f'{TOOL_CALL_START}\n{{"name": {json.dumps(c["name"], ensure_ascii=False)}, '
        f'"arguments": {json.dumps(c["arguments"], ensure_ascii=False)}}}\n{TOOL_CALL_END}'
        for c in calls
    ]
    return "\n".join([content, *blocks] if content else blocks)


def build_assistant_message(text: str) -> dict[str, Any]:
    """Turn generated text into the assistant message that the template renders back to ``text``.

    When ``text`` is in the template's own layout (content, then each call as
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` separated by newlines), the
    message is structured: ``{"role": "assistant", "content": content, "tool_calls": [{"type":
    "function", "function": {"name": ..., "arguments": {...}}}, ...]}`` (no ``tool_calls`` key when
    there is no call). Otherwise (a malformed or unterminated call, other spacing or key order, text
    after a call) the message is verbatim, ``{"role": "assistant", "content": text}``, so the next
    prompt still shows the model exactly what it wrote and keeps the token prefix. Either way, run
    the calls that :func:`parse_tool_calls` returns.

    Args:
        text: The decoded completion, without the end-of-turn token.

    Returns:
        The message dict to append to the conversation.
    """
    content, calls = parse_tool_calls(text)
    good = [c for c in calls if "error" not in c]
    if len(good) != len(calls) or _assistant_text(content, good) != text:  # type: ignore[arg-type]
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if good:
        message["tool_calls"] = [{"type": "function", "function": dict(c)} for c in good]
    return message


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


def synthetic_replies(tools: list[dict[str, Any]] | None, opening: str) -> list[tuple[str, list[str]]]:
    """The assistant texts of a synthetic tool conversation (as a model emits them) and their tool results.

    Args:
        tools: Tool schemas; the first one's name is called (a made-up ``lookup`` without tools).
        opening: What each assistant text starts with (one of :data:`REASONING_OPENINGS`).

    Returns:
        ``(assistant text, tool results)`` per turn: one call, then some text and two calls.
    """
    name = tools[0]["function"]["name"] if tools else "lookup"
    call = _assistant_text("", [ToolCall(name=name, arguments={"step": 2})])
    return [(opening + call, ["2"]), (opening + "Two more.\n" + call + "\n" + call, ["4", "6"])]


def check_prefix_preserving(
    tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None, **kw: Any,
) -> bool:
    """Whether the tokenizer's template keeps the token prefix across tool-calling turns.

    Plays the rollout loop on a synthetic conversation (system, user, then an assistant turn with one
    tool call and one with two, each followed by its tool messages), once for each of
    :data:`REASONING_OPENINGS`: each turn's prompt ids followed by the ids of the assistant text (as
    tokenized, plus EOS: what a model emitting it produces) must start the next turn's prompt ids,
    with the assistant message built from the text by :func:`build_assistant_message`, as the loop
    does.

    Args:
        tokenizer: The tokenizer whose chat template is checked; its EOS ends a completion.
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
    for opening in REASONING_OPENINGS:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Please do it in two calls."},
        ]
        previous = render_prompt_ids(tokenizer, messages, tools, chat_template, **kw)
        for text, results in synthetic_replies(tools, opening):
            completion = tokenizer(text, add_special_tokens=False)["input_ids"]
            expected = previous + list(completion) + [tokenizer.eos_token_id]
            messages += [build_assistant_message(text), *({"role": "tool", "content": r} for r in results)]
            previous = render_prompt_ids(tokenizer, messages, tools, chat_template, **kw)
            if previous[: len(expected)] != expected:
                return False
    return True
