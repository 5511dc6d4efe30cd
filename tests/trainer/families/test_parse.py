"""Every family's parser: calls written in its format read back, several per turn, typed arguments,
malformed and unterminated calls as one failure each, stray closing markers counted and never run."""

from __future__ import annotations

from typing import Any

import pytest

from trainer.families import (
    DEEPSEEK_V3,
    GLM4,
    GPT_OSS,
    KIMI_K2,
    LLAMA3,
    MISTRAL,
    QWEN3,
    QWEN3_5,
    Family,
    ToolCall,
    families,
    typed_value,
)
from trainer.families.mistral import call_id

TOOLS = [{"type": "function", "function": {"name": "increment", "parameters": {"type": "object", "properties": {
    "step": {"type": "integer"}, "note": {"type": "string"}, "fast": {"type": "boolean"},
    "ratio": {"type": "number"}, "tags": {"type": "array"}, "maybe": {"type": ["integer", "null"]}}}}}]
ONE = ToolCall(name="increment", arguments={"step": 2})
TWO = ToolCall(name="increment", arguments={"step": 3, "note": "two words", "fast": True, "ratio": 0.5,
                                            "tags": ["a", "b"]})
NAMES = ["qwen3", "qwen3_5", "llama3", "gpt_oss", "mistral", "glm4", "kimi_k2", "deepseek_v3"]


def _plain(calls: list[Any]) -> list[dict[str, Any]]:
    """Calls without the family's own ids."""
    return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


def test_every_family_named_in_the_issue_is_registered() -> None:
    assert [f.name for f in families()][: len(NAMES)] == NAMES


@pytest.mark.parametrize("family", families()[: len(NAMES)], ids=NAMES)
@pytest.mark.parametrize("content", ["", "Stepping now."])
def test_calls_in_the_family_format_read_back(family: Family, content: str) -> None:
    for calls in ([ONE], [ONE, TWO]):
        text = family.format_calls(content, calls)
        got_content, got = family.parse(text, TOOLS)
        # Llama's templates write a call turn without its text, GPT-OSS's as its reasoning (analysis).
        written = content if family not in (LLAMA3, GPT_OSS) else ""
        assert got_content == written and _plain(got) == _plain(calls), text
        assert family.malformed(text) == 0


@pytest.mark.parametrize("family", families()[: len(NAMES)], ids=NAMES)
def test_text_without_calls_is_content(family: Family) -> None:
    assert family.parse("The counter is 4.\n", TOOLS) == ("The counter is 4.", [])
    assert family.malformed("The counter is 4.") == 0


# Per family: a turn with one good call then one that cannot be read, the error, the name when readable.
MALFORMED: dict[str, tuple[str, str, str | None]] = {
    "qwen3": (QWEN3.format_calls("", [ONE]) + '\n<tool_call>\n{"name": "increment", "arguments": {"step": }\n'
              "</tool_call>", "invalid tool call JSON: Expecting value", None),
    "qwen3_5": (QWEN3_5.format_calls("", [ONE]) + "\n<tool_call>\n<parameter=step>\n2\n</parameter>\n</tool_call>",
                "expected <function=NAME>", None),
    "llama3": ('{"name": "increment", "parameters": {"step": 2}}; {"name": "increment", "parameters": [2]}',
               "arguments must be a JSON object", "increment"),
    "gpt_oss": (GPT_OSS.format_calls("", [ONE]) + "<|call|><|start|>assistant<|channel|>commentary "
                "to=functions.increment <|constrain|>json<|message|>{\"step\": 2,}", "invalid tool call JSON",
                "increment"),
    "mistral": (MISTRAL.format_calls("", [ONE]) + '[TOOL_CALLS]increment[ARGS]{"step": 2,,}', "invalid tool call JSON",
                "increment"),
    "glm4": (GLM4.format_calls("", [ONE]) + "\n<tool_call>increment\n<arg_key>step</arg_key>\n2\n</tool_call>",
             "expected <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>", "increment"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.increment:0<|tool_call_argument_begin|>"
                '{"step": 2}<|tool_call_end|><|tool_call_begin|>increment<|tool_call_argument_begin|>{"step": 2}'
                "<|tool_call_end|><|tool_calls_section_end|>", "expected functions.NAME:INDEX", None),
    "deepseek_v3": (DEEPSEEK_V3.format_calls("", [ONE]).replace(
        "<｜tool▁calls▁end｜>", "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>increment\n```json\n[2]\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "arguments must be a JSON object", "increment"),
}


@pytest.mark.parametrize("name", NAMES)
def test_a_malformed_call_is_one_failure_beside_the_good_one(name: str) -> None:
    family = next(f for f in families() if f.name == name)
    text, error, failed_name = MALFORMED[name]
    _, calls = family.parse(text, TOOLS)
    assert len(calls) == 2 and _plain(calls[:1]) == [dict(ONE)], calls
    assert error in calls[1]["error"] and calls[1]["name"] == failed_name and calls[1]["arguments"] is None


# Per family: a completion cut inside its second call (the length limit).
CUT = {
    "qwen3": QWEN3.format_calls("Go.", [ONE, TWO])[:-30],
    "qwen3_5": QWEN3_5.format_calls("Go.", [ONE, TWO])[:-30],
    "llama3": LLAMA3.format_calls("", [ONE, TWO])[:-10],
    "gpt_oss": GPT_OSS.format_calls("Go.", [ONE, TWO]).rsplit("<|message|>", 1)[0],
    "mistral": MISTRAL.format_calls("Go.", [ONE, TWO])[:-10],
    "glm4": GLM4.format_calls("Go.", [ONE, TWO])[:-30],
    "kimi_k2": KIMI_K2.format_calls("Go.", [ONE, TWO])[:-40],
    "deepseek_v3": DEEPSEEK_V3.format_calls("Go.", [ONE, TWO])[:-40],
}


@pytest.mark.parametrize("name", NAMES)
def test_an_unterminated_call_is_a_failure(name: str) -> None:
    family = next(f for f in families() if f.name == name)
    _, calls = family.parse(CUT[name], TOOLS)
    assert _plain(calls[:1]) == [dict(ONE)] and len(calls) >= 2, calls
    assert all("error" in c for c in calls[1:])


# Per family: call markup that closes nothing: a fragment, not a call.
STRAY = {
    "qwen3": '{"step": {"step": 4}}\n</tool_call>',
    "qwen3_5": "4\n</parameter>\n</function>\n</tool_call>",
    "llama3": None,  # no closing marker in the format
    "gpt_oss": '{"step": 4}<|call|>',
    "mistral": 'increment[ARGS]{"step": 4}',
    "glm4": "<arg_value>4</arg_value>\n</tool_call>",
    "kimi_k2": '{"step": 4}<|tool_call_end|><|tool_calls_section_end|>',
    "deepseek_v3": '{"step": 4}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}


@pytest.mark.parametrize("name", [n for n in NAMES if STRAY[n] is not None])
def test_a_stray_closing_marker_is_malformed_not_a_call(name: str) -> None:
    family = next(f for f in families() if f.name == name)
    text = "The counter is 4. " + str(STRAY[name])
    _, calls = family.parse(text, TOOLS)
    assert calls == [], "a fragment is never run"
    assert family.malformed(text) >= 1
    between = "<|call|><|start|>assistant" if name == "gpt_oss" else "\n"  # harmony: a call message ends the turn
    good = family.format_calls("", [ONE])
    assert family.malformed(good + between + str(STRAY[name])) >= 1, "after a good call too"


def test_the_xml_formats_type_arguments_by_the_schema() -> None:
    text = QWEN3_5.format_calls("", [TWO])
    assert "<parameter=fast>\ntrue\n</parameter>" in text and "<parameter=note>\ntwo words\n</parameter>" in text
    _, calls = QWEN3_5.parse(text, TOOLS)
    assert calls[0]["arguments"] == TWO["arguments"]
    _, untyped = QWEN3_5.parse(text)  # no schema: values stay text, as vLLM's parser keeps them
    assert untyped[0]["arguments"]["step"] == "3"
    _, calls = GLM4.parse(GLM4.format_calls("", [TWO]), TOOLS)
    assert calls[0]["arguments"] == TWO["arguments"]


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("3", {"type": "integer"}, 3), ("3.5", {"type": "number"}, 3.5), ("4.0", {"type": "number"}, 4),
    ("true", {"type": "boolean"}, True), ("null", {"type": ["integer", "null"]}, None),
    ("[1, 2]", {"type": "array"}, [1, 2]), ('{"a": 1}', {"type": "object"}, {"a": 1}),
    ("three", {"type": "integer"}, "three"), ("3", {"type": "string"}, "3"), ("3", None, "3"),
    ("2", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 2), ("b", {"enum": ["a", "b"]}, "b"),
    ("nan", {"type": "number"}, "nan"),
])
def test_typed_value(text: str, schema: Any, value: Any) -> None:
    assert typed_value(text, schema) == value and type(typed_value(text, schema)) is type(value)


def test_kimi_keeps_its_call_ids_and_answers_by_them() -> None:
    text = KIMI_K2.format_calls("", [ONE, TWO])
    _, calls = KIMI_K2.parse(text, TOOLS)
    assert [c.get("id") for c in calls] == ["functions.increment:0", "functions.increment:1"]
    message = KIMI_K2.tool_message(calls[1], "5")
    assert message == {"role": "tool", "name": "increment", "content": "5", "tool_call_id": "functions.increment:1"}
    assert KIMI_K2.format_calls("", calls) == text, "the ids are written back as read"


def test_deepseek_reads_v3_1_calls_too() -> None:
    text = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>increment<｜tool▁sep｜>{"step": 2}<｜tool▁call▁end｜>'
            '<｜tool▁call▁begin｜>increment<｜tool▁sep｜>{"step": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert DEEPSEEK_V3.parse(text) == ("", [ONE, ToolCall(name="increment", arguments={"step": 3})])


def test_mistral_reads_the_older_json_list_form() -> None:
    text = ' [TOOL_CALLS] [{"name": "increment", "arguments": {"step": 2}}, {"name": "increment", "arguments": {}}]'
    assert MISTRAL.parse(text) == ("", [ONE, ToolCall(name="increment", arguments={})])


def test_mistral_keeps_a_call_id_and_answers_every_call_with_one() -> None:
    # Mistral 7B v0.3's stock template raises on a tool result without its call's 9-character id.
    text = '[TOOL_CALLS] [{"name": "increment", "arguments": {"step": 2}, "id": "a1B2c3D4e"}]'
    (call,) = MISTRAL.parse(text)[1]
    assert call == {**ONE, "id": "a1B2c3D4e"}
    assert MISTRAL.tool_message(call, "2")["tool_call_id"] == "a1B2c3D4e"
    (bare,) = MISTRAL.parse('[TOOL_CALLS]increment[ARGS]{"step": 2}')[1]
    derived = MISTRAL.tool_message(bare, "2")["tool_call_id"]
    assert len(derived) == 9 and derived.isalnum() and derived == call_id(bare)
    assert call_id({"name": "increment", "arguments": {"step": 3}}) != derived


def test_llama_reads_arguments_and_calls_after_the_python_tag() -> None:
    assert LLAMA3.parse('{"name": "increment", "arguments": {"step": 2}}') == ("", [ONE])
    assert LLAMA3.parse('Let me step.<|python_tag|>{"name": "increment", "parameters": {"step": 2}}') == (
        "Let me step.", [ONE])
    _, calls = LLAMA3.parse('{"name": "increment", "parameters": {"step": 2}} and then some')
    assert calls[0] == ONE and "separate calls" in calls[1]["error"]


def test_harmony_splits_channels() -> None:
    text = ("<|channel|>analysis<|message|>Two steps.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.increment <|constrain|>json<|message|>{"step": 2}')
    assert GPT_OSS.parse(text) == ("", [ONE])
    assert GPT_OSS.split_reasoning(text) == ("Two steps.", "")
    final = "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert GPT_OSS.parse(final) == ("It is 4.", [])
    assert GPT_OSS.split_reasoning(final) == ("Done.", "It is 4.")
    assert GPT_OSS.turn_end(True) == "<|call|>" and GPT_OSS.turn_end(False) == "<|return|>"


@pytest.mark.parametrize(("text", "reasoning", "rest"), [
    ("<think>\nTwo steps.\n</think>\n\nDone.", "Two steps.", "Done."),
    ("Two steps.\n</think>\n\nDone.", "Two steps.", "Done."),  # the generation prompt opened the block
    ("Done.", None, "Done."),
    ("Done. <think>late</think> more", None, "Done. <think>late</think> more"),
])
def test_reasoning_splits_off_a_think_block(text: str, reasoning: str | None, rest: str) -> None:
    assert QWEN3_5.split_reasoning(text) == (reasoning, rest)
