"""Each family's parser reads the same calls as vLLM's parser of that format, on the same texts.

vLLM's parsers (``vllm/tool_parsers/``, imported one module at a time) run here on the tiny tokenizer
with the family's markers added. Where a call is malformed they answer differently by design: vLLM
returns the text as content (or drops the call), the family reports one failure per bad call, which
the rollout loop sends back to the model as an error (``trainer/families/base.py`` says why
toolgym keeps its own parsers). GPT-OSS is not compared: vLLM's ``openai`` parser reads harmony token
ids through ``openai_harmony``, not text.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from trainer.families import Family, ToolCall, families, family_named

TOOLS = [{"type": "function", "function": {"name": "increment", "description": "Add to the counter.",
                                           "parameters": {"type": "object", "properties": {
                                               "step": {"type": "integer"}, "note": {"type": "string"},
                                               "fast": {"type": "boolean"}}, "required": ["step"]}}}]
ONE = ToolCall(name="increment", arguments={"step": 2})
TWO = ToolCall(name="increment", arguments={"step": 3, "note": "two words", "fast": False})
PARSERS = {  # vLLM's parser name -> (module under vllm.tool_parsers, class)
    "hermes": ("hermes_tool_parser", "Hermes2ProToolParser"),
    "qwen3_xml": ("qwen3_engine_tool_parser", "Qwen3EngineToolParser"),
    "llama3_json": ("llama_tool_parser", "Llama3JsonToolParser"),
    "mistral": ("mistral_tool_parser", "MistralToolParser"),
    "glm45": ("glm47_moe_tool_parser", "Glm47MoeModelToolParser"),
    "kimi_k2": ("kimi_k2_tool_parser", "KimiK2ToolParser"),
    "deepseek_v3": ("deepseekv3_tool_parser", "DeepSeekV3ToolParser"),
    "deepseek_v31": ("deepseekv31_tool_parser", "DeepSeekV31ToolParser"),
    "mistral_pre_v11": ("mistral_tool_parser", "MistralToolParser"),  # a tokenizer without [ARGS]
}
COMPARED = [f for f in families() if f.vllm_parser is not None]

# Texts as the families' own models write them, beyond the canonical layout of format_calls.
NATIVE: dict[str, list[tuple[str, str | None]]] = {  # family -> (text, vLLM parser if not the family's)
    "qwen3": [('<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>\n<tool_call>\n'
               '{"name": "increment", "arguments": {"step": 3, "note": "two words", "fast": false}}\n'
               "</tool_call>", None)],
    "qwen3_5": [("<tool_call>\n<function=increment>\n<parameter=step>2</parameter>\n</function>\n</tool_call>", None),
                ("<tool_call>\n<function=increment>\n<parameter=step>\n3\n</parameter>\n<parameter=note>\ntwo words\n"
                 "</parameter>\n<parameter=fast>\nfalse\n</parameter>\n</function>\n</tool_call>", None)],
    "llama3": [('{"name": "increment", "arguments": {"step": 2}}', None),
               ('<|python_tag|>{"name": "increment", "parameters": {"step": 2}}', None)],
    "mistral": [('[TOOL_CALLS][{"name": "increment", "arguments": {"step": 2}}, {"name": "increment", "arguments": '
                 '{"step": 3, "note": "two words", "fast": false}}]', "mistral_pre_v11")],
    "glm4": [("<tool_call>increment<arg_key>step</arg_key><arg_value>2</arg_value></tool_call>", None)],
    "kimi_k2": [("<|tool_calls_section_begin|> <|tool_call_begin|> functions.increment:7 <|tool_call_argument_begin|>"
                 ' {"step": 2} <|tool_call_end|> <|tool_calls_section_end|>', None)],
    "deepseek_v3": [('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>increment<｜tool▁sep｜>{"step": 2}<｜tool▁call▁end｜>'
                     "<｜tool▁calls▁end｜>", "deepseek_v31")],
}


@pytest.fixture(scope="module")
def vllm_calls(tiny_model_dir: Path) -> Any:
    """``(family, text, parser name) -> [(name, arguments)]`` through vLLM's parser, one import per parser."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "Count."}], tools=TOOLS)
    parsers: dict[tuple[str, str], Any] = {}

    def run(family: Family, text: str, parser: str) -> list[tuple[str, dict[str, Any]]]:
        if (family.name, parser) not in parsers:
            tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
            tokenizer.add_tokens([t for t in family.special_tokens if parser != "mistral_pre_v11" or t != "[ARGS]"],
                                 special_tokens=True)
            tokenizer.add_tokens([t for t in family.tokens if parser != "mistral_pre_v11" or t != "[ARGS]"])
            module, cls = PARSERS[parser]
            parsers[family.name, parser] = getattr(importlib.import_module(f"vllm.tool_parsers.{module}"), cls)(
                tokenizer, tools=request.tools)
        found = parsers[family.name, parser].extract_tool_calls(text, request)
        return [(c.function.name, _json(c.function.arguments)) for c in found.tool_calls]

    return run


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # passed on unread


def _ours(family: Family, text: str) -> list[tuple[str, dict[str, Any]]]:
    _, calls = family.parse(text, TOOLS)
    assert all("error" not in c for c in calls), calls
    return [(c["name"], c["arguments"]) for c in calls]  # type: ignore[misc]


@pytest.mark.parametrize("family", COMPARED, ids=[f.name for f in COMPARED])
def test_the_family_reads_what_vllm_reads(family: Family, vllm_calls: Any) -> None:
    assert family.vllm_parser is not None
    texts = [(family.format_calls(content, calls), None) for content in ("", "Stepping now.")
             for calls in ([ONE], [ONE, TWO])] + NATIVE[family.name]
    for text, parser in texts:
        ours = _ours(family, text)
        assert ours and ours == vllm_calls(family, text, parser or family.vllm_parser), text


@pytest.mark.parametrize("family", COMPARED, ids=[f.name for f in COMPARED])
def test_a_malformed_call_is_a_failure_where_vllm_has_none(family: Family, vllm_calls: Any) -> None:
    # vLLM drops the bad call, returns the turn as content, or passes it on with arguments it did not
    # read (a list, raw text, {}): a tool would run or the model would hear nothing. Ours: one failure.
    from tests.trainer.families.test_parse import MALFORMED

    text, _, _ = MALFORMED[family.name]
    _, calls = family.parse(text, TOOLS)
    assert "error" not in calls[0] and sum("error" in c for c in calls) == 1
    assert family.vllm_parser is not None
    theirs = vllm_calls(family, text, family.vllm_parser)
    assert theirs[:1] in ([], [("increment", {"step": 2})]), "the good call reads the same where vLLM reads any"


def test_gpt_oss_is_not_compared() -> None:
    assert family_named("gpt_oss").vllm_parser is None
