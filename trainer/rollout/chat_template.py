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

Tool calls come in the format of the family whose template renders the conversation
(:func:`tool_call_format`): the Qwen/Hermes ``<tool_call>{json}</tool_call>`` blocks above, or
DeepSeek-V3's, where a turn's calls sit in one ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``
section, one ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{arguments}\\n```<｜tool▁call▁end｜>``
per call (newline-separated).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal, TypedDict

from transformers import PreTrainedTokenizerBase

from trainer.exceptions import ConfigError

__all__ = [
    "CHAT_TEMPLATE",
    "DEEPSEEK_V3",
    "HERMES",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "EMPTY_REASONING",
    "REASONING_OPENINGS",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ToolCall",
    "ToolCallFailure",
    "ToolCallFormat",
    "build_assistant_message",
    "check_prefix_preserving",
    "parse_tool_calls",
    "refuse_image_parts",
    "render_prompt_ids",
    "render_prompt_text",
    "synthetic_replies",
    "tool_call_format",
]

IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

# DeepSeek-V3's tool-call markers.
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"

ToolCallFormat = Literal["hermes", "deepseek_v3"]
HERMES: ToolCallFormat = "hermes"
DEEPSEEK_V3: ToolCallFormat = "deepseek_v3"


def tool_call_format(chat_template: object) -> ToolCallFormat:
    """The tool-call format of the family whose chat template is ``chat_template``.

    Args:
        chat_template: The template the conversation renders with (a training template or the
            tokenizer's own; anything but a string, e.g. ``None``, counts as the Qwen/Hermes default).

    Returns:
        :data:`DEEPSEEK_V3` when the template writes DeepSeek-V3 tool-call sections, else :data:`HERMES`.
    """
    return DEEPSEEK_V3 if isinstance(chat_template, str) and DS_CALLS_BEGIN in chat_template else HERMES

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
        name: The tool name when it could be read (Qwen format: a valid JSON object with a string
            ``name``; DeepSeek-V3: the name before the arguments), else ``None``.
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
_DS_BLOCK = re.compile(re.escape(DS_CALL_BEGIN) + "(.*?)" + re.escape(DS_CALL_END), re.DOTALL)
# Inside a DeepSeek-V3 call: TYPE<｜tool▁sep｜>NAME, a newline, the arguments in a ```json fence.
_DS_BODY = re.compile(r"\s*\w+" + re.escape(DS_SEP) + r"([^\n]*)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)


def _json_error(exc: json.JSONDecodeError) -> str:
    return f"invalid tool call JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"


def _with_arguments(name: str, arguments: Any, raw: str) -> ToolCall | ToolCallFailure:
    """A call to ``name`` when ``arguments`` is an object (or a JSON string holding one), else a failure."""
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        error = f"invalid tool call to {name!r}: arguments must be a JSON object"
        return ToolCallFailure(name=name, arguments=None, error=error, raw=raw)
    return ToolCall(name=name, arguments=arguments)


def _read_call(raw: str) -> ToolCall | ToolCallFailure:
    """Decode one ``<tool_call>`` block's JSON into a call, or explain why it is not one."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCallFailure(name=None, arguments=None, error=_json_error(exc), raw=raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        error = 'invalid tool call: expected {"name": <string>, "arguments": <object>}'
        return ToolCallFailure(name=None, arguments=None, error=error, raw=raw)
    return _with_arguments(obj["name"], obj.get("arguments", {}), raw)


def _read_deepseek_call(raw: str) -> ToolCall | ToolCallFailure:
    """Decode one DeepSeek-V3 call (between its begin and end markers), or explain why it is not one."""
    match = _DS_BODY.fullmatch(raw)
    if match is None or not match.group(1).strip():
        error = (f"invalid tool call: expected function{DS_SEP}<name>, a newline, then the arguments as a JSON "
                 "object in a ```json block")
        return ToolCallFailure(name=None, arguments=None, error=error, raw=raw)
    name = match.group(1).strip()
    try:
        arguments = json.loads(match.group(2))
    except json.JSONDecodeError as exc:
        return ToolCallFailure(name=name, arguments=None, error=_json_error(exc), raw=raw)
    return _with_arguments(name, arguments, raw)


def _split_calls(text: str, block: re.Pattern[str], start: str,
                 read: Callable[[str], ToolCall | ToolCallFailure]) -> tuple[str, list[ToolCall | ToolCallFailure]]:
    """Cut every ``block`` out of ``text`` and ``read`` it; an unclosed ``start`` is an unterminated call."""
    calls: list[ToolCall | ToolCallFailure] = []
    pieces: list[str] = []
    pos = 0
    for match in block.finditer(text):
        pieces.append(text[pos : match.start()])
        calls.append(read(match.group(1)))
        pos = match.end()
    tail = text[pos:]
    cut = tail.find(start)
    if cut >= 0:
        raw = tail[cut + len(start) :].strip()
        calls.append(ToolCallFailure(name=None, arguments=None, error="unterminated tool call", raw=raw))
        tail = tail[:cut]
    pieces.append(tail)
    return "".join(pieces), calls


def parse_tool_calls(text: str, fmt: ToolCallFormat = HERMES) -> tuple[str, list[ToolCall | ToolCallFailure]]:
    """Split generated text into its content and its tool calls, in emitted order.

    Every ``<tool_call>...</tool_call>`` block becomes one record: a :class:`ToolCall`
    (``{"name": str, "arguments": dict}``) when it holds a JSON object with a string ``name`` and
    an object ``arguments`` (missing means ``{}``; a JSON string holding an object is accepted), else
    a :class:`ToolCallFailure` (test with ``"error" in call``). A ``<tool_call>`` never closed (a
    completion cut by the length limit) is a failure too. Parsing never raises.

    With ``fmt=DEEPSEEK_V3`` every ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` is one record the
    same way (its JSON is the fenced block after the name); a call or a calls section never closed is
    a failure, and the section markers are removed from the content.

    Args:
        text: The decoded completion, without the end-of-turn token.
        fmt: The rendering template's tool-call format (:func:`tool_call_format`).

    Returns:
        ``(content, calls)``: the text with every block removed, stripped of surrounding
        whitespace, and the records.
    """
    if fmt == HERMES:
        content, calls = _split_calls(text, _BLOCK, TOOL_CALL_START, lambda raw: _read_call(raw.strip()))
        return content.strip(), calls
    content, calls = _split_calls(text, _DS_BLOCK, DS_CALL_BEGIN, _read_deepseek_call)
    if text.count(DS_CALLS_BEGIN) > text.count(DS_CALLS_END) and not (calls and "error" in calls[-1]):
        raw = text[text.rfind(DS_CALLS_BEGIN) + len(DS_CALLS_BEGIN) :].strip()
        calls.append(ToolCallFailure(name=None, arguments=None, error="unterminated tool call section", raw=raw))
    return content.replace(DS_CALLS_BEGIN, "").replace(DS_CALLS_END, "").strip(), calls


def _assistant_text(content: str, calls: list[ToolCall], fmt: ToolCallFormat = HERMES) -> str:
    """What a template of format ``fmt`` renders inside an assistant turn for this content and these calls."""
    if fmt == DEEPSEEK_V3:
        section = "\n".join(
            f"{DS_CALL_BEGIN}function{DS_SEP}{c['name']}\n```json\n{json.dumps(c['arguments'], ensure_ascii=False)}"
            f"\n```{DS_CALL_END}" for c in calls)
        return content + (DS_CALLS_BEGIN + section + DS_CALLS_END if calls else "")
    blocks = [
        f'{TOOL_CALL_START}\n{{"name": {json.dumps(c["name"], ensure_ascii=False)}, '
        f'"arguments": {json.dumps(c["arguments"], ensure_ascii=False)}}}\n{TOOL_CALL_END}'
        for c in calls
    ]
    return "\n".join([content, *blocks] if content else blocks)


def build_assistant_message(text: str, fmt: ToolCallFormat = HERMES) -> dict[str, Any]:
    """Turn generated text into the assistant message that the template renders back to ``text``.

    When ``text`` is in the template's own layout (content, then each call as
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` separated by newlines), the
    message is structured: ``{"role": "assistant", "content": content, "tool_calls": [{"type":
    "function", "function": {"name": ..., "arguments": {...}}}, ...]}`` (no ``tool_calls`` key when
    there is no call). Otherwise (a malformed or unterminated call, other spacing or key order, text
    after a call) the message is verbatim, ``{"role": "assistant", "content": text}``, so the next
    prompt still shows the model exactly what it wrote and keeps the token prefix. Either way, run
    the calls that :func:`parse_tool_calls` returns.

    With ``fmt=DEEPSEEK_V3`` the layout is DeepSeek-V3's: the content, then one calls section with
    each call as ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``.

    Args:
        text: The decoded completion, without the end-of-turn token.
        fmt: The rendering template's tool-call format (:func:`tool_call_format`).

    Returns:
        The message dict to append to the conversation.
    """
    content, calls = parse_tool_calls(text, fmt)
    good = [c for c in calls if "error" not in c]
    if len(good) != len(calls) or _assistant_text(content, good, fmt) != text:  # type: ignore[arg-type]
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


def synthetic_replies(tools: list[dict[str, Any]] | None, opening: str,
                      fmt: ToolCallFormat = HERMES) -> list[tuple[str, list[str]]]:
    """The assistant texts of a synthetic tool conversation (as a model emits them) and their tool results.

    Args:
        tools: Tool schemas; the first one's name is called (a made-up ``lookup`` without tools).
        opening: What each assistant text starts with (one of :data:`REASONING_OPENINGS`).
        fmt: The tool-call format the calls are written in.

    Returns:
        ``(assistant text, tool results)`` per turn: one call, then some text and two calls.
    """
    name = tools[0]["function"]["name"] if tools else "lookup"
    call = ToolCall(name=name, arguments={"step": 2})
    return [(opening + _assistant_text("", [call], fmt), ["2"]),
            (opening + _assistant_text("Two more.", [call, call], fmt), ["4", "6"])]


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
    does. The calls are written in the checked template's format (:func:`tool_call_format`).

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
    fmt = tool_call_format(chat_template or tokenizer.chat_template)
    for opening in REASONING_OPENINGS:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Please do it in two calls."},
        ]
        previous = render_prompt_ids(tokenizer, messages, tools, chat_template, **kw)
        for text, results in synthetic_replies(tools, opening, fmt):
            completion = tokenizer(text, add_special_tokens=False)["input_ids"]
            expected = previous + list(completion) + [tokenizer.eos_token_id]
            messages += [build_assistant_message(text, fmt), *({"role": "tool", "content": r} for r in results)]
            previous = render_prompt_ids(tokenizer, messages, tools, chat_template, **kw)
            if previous[: len(expected)] != expected:
                return False
    return True
