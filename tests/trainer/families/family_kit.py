"""Helpers for the family tests: a tokenizer of any family built fast, and an episode played as the loop plays it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from toolgym.kit.tiny_model import kit_template
from trainer.families import Family, ToolCall
from trainer.records import TurnRecord
from trainer.rollout.chat_template import build_assistant_message, completion_text, render_prompt_ids

COUNTER_TOOLS = [{"type": "function", "function": {
    "name": "increment", "description": "Add to the counter.",
    "parameters": {"type": "object", "properties": {"step": {"type": "integer", "description": "How much to add."}},
                   "required": ["step"]}}}]


def family_tokenizer(tiny_model_dir: Path, family: Family, template: str | None = None) -> PreTrainedTokenizerBase:
    """The tiny tokenizer with ``family``'s tokens, stop tokens and template (the kit's, by default).

    What ``build_tiny_model(family=...)`` builds, without training a BPE vocabulary per family.
    """
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(list(family.special_tokens), special_tokens=True)
    tokenizer.add_tokens(list(family.tokens))
    tokenizer.eos_token = family.stop_tokens[0]
    tokenizer.pad_token = family.special_tokens[0]
    if family.bos_token:
        tokenizer.bos_token = family.bos_token
    tokenizer.chat_template = template if template is not None else kit_template(family)
    return tokenizer


def stop_ids(tokenizer: PreTrainedTokenizerBase, family: Family) -> list[int]:
    """The ids of the family's stop tokens."""
    return [int(tokenizer.convert_tokens_to_ids(t)) for t in family.stop_tokens]


def episode(family: Family, final: str = "The counter is 4.") -> list[str]:
    """Assistant texts of a counter episode in ``family``'s format, as one of its models writes them after
    its generation prompt: a reasoned call, some text and two calls, the final answer."""
    one, two = ToolCall(name="increment", arguments={"step": 2}), ToolCall(name="increment", arguments={"step": 1})
    start, end = family.reasoning or ("", "")
    think = f"Start with two.\n{end}\n\n" if start else ""  # the generation prompt opened the block
    if family.name != "qwen3_5" and start:
        think = f"{start}\nStart with two.\n{end}\n\n"
    texts = [think + family.format_calls("", [one]), family.format_calls("And again.", [two, two])]
    if family.name == "gpt_oss":
        texts[0] = "<|channel|>analysis<|message|>Start with two.<|end|><|start|>assistant" + texts[0]
        return [*texts, f"<|channel|>final<|message|>{final}"]
    if family.name == "qwen3_5":  # every turn closes the block its generation prompt opened
        return [texts[0], f"Once more.\n</think>\n\n{texts[1]}", f"Done.\n</think>\n\n{final}"]
    return [*texts, final]


def play(tokenizer: PreTrainedTokenizerBase, family: Family, texts: list[str], template: str | None = None,
         tools: list[dict[str, Any]] | None = None, **kw: Any) -> tuple[list[TurnRecord], list[dict[str, Any]]]:
    """Play an episode as the rollout loop does: render, 'sample' the next text (its ids, then the family's
    end token), decode as the loop decodes, build the assistant message, answer each call.

    Returns:
        The turns (prompt ids, output ids, log-probs) and the conversation.
    """
    tools = COUNTER_TOOLS if tools is None else tools
    ends = stop_ids(tokenizer, family)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Count."}, {"role": "user", "content": "To 4."}]
    turns = []
    for i, text in enumerate(texts):
        prompt = render_prompt_ids(tokenizer, messages, tools, template, **kw)
        _, calls = family.parse(text, tools)
        end = int(tokenizer.convert_tokens_to_ids(family.turn_end(bool(calls))))
        output = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [end]
        turns.append(TurnRecord(prompt_ids=prompt, output_ids=output, output_log_probs=[-0.5] * len(output),
                                finish_reason="stop"))
        decoded = completion_text(tokenizer, output, ends)
        assert decoded == text, (decoded, text)
        messages.append(build_assistant_message(decoded, family, tools))
        messages += [family.tool_message(call, str(2 * i + j)) for j, call in enumerate(calls)]
    return turns, messages
