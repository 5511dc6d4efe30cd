"""Model families: how each one writes tool calls, takes tool results and reasons, and its training template.

``families()`` lists them, ``family_named("qwen3_5")`` finds one by name, ``family_for(tokenizer)``
recognises the one of a chat template, and ``register_family(...)`` adds a format of your own
(``docs/multiturn.md``). A family parses an assistant turn into content and tool calls
(``family.parse(text, tools)``), writes calls back (``family.format_calls``), gives a call's result
message (``family.tool_message``) and splits reasoning off (``family.split_reasoning``).
"""

from trainer.families.base import (
    Family,
    ToolCall,
    ToolCallFailure,
    parse_arguments,
    schema_properties,
    template_text,
    typed_value,
)
from trainer.families.deepseek import DEEPSEEK_V3
from trainer.families.glm import GLM4
from trainer.families.gpt_oss import GPT_OSS
from trainer.families.kimi import KIMI_K2
from trainer.families.llama import LLAMA3
from trainer.families.mistral import MISTRAL
from trainer.families.qwen import QWEN3, QWEN3_5
from trainer.families.registry import families, family_for, family_named, register_family

__all__ = [
    "DEEPSEEK_V3",
    "GLM4",
    "GPT_OSS",
    "KIMI_K2",
    "LLAMA3",
    "MISTRAL",
    "QWEN3",
    "QWEN3_5",
    "Family",
    "ToolCall",
    "ToolCallFailure",
    "families",
    "family_for",
    "family_named",
    "parse_arguments",
    "register_family",
    "schema_properties",
    "template_text",
    "typed_value",
]
