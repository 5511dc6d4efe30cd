"""``toolgym tiny-model``: build (and warm-start) the tiny local model of any model family.

::

    toolgym tiny-model OUT [--seed N] [--arch {qwen3,qwen3_5,qwen3_5_vl,qwen3_next}] [--family NAME]
                           [--warm-start {counter,arithmetic,all}]

``--family`` takes a registered family's name (``qwen3`` by default; ``qwen3_5``, ``llama3``,
``gpt_oss``, ``mistral``, ``glm4``, ``kimi_k2``, ``deepseek_v3``): the tokenizer gets that family's
chat template, markers and stop tokens (:mod:`toolgym.kit.tiny_model`), so the warm start teaches the
family's own call format and every family can be trained here.
"""

from __future__ import annotations

import argparse
import sys

from toolgym.kit.tiny_model import ARCHITECTURES, build_tiny_model
from toolgym.kit.warm_start import TASKS, WarmStartConfig, warm_start
from trainer.families import families, family_named

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Build (and warm-start) the tiny model; prints its directory and returns the exit status."""
    parser = argparse.ArgumentParser(prog="toolgym tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation (and warm-start) seed")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen3",
                        help="qwen3 (default) or a Gated DeltaNet hybrid: qwen3_5, qwen3_5_vl, qwen3_next")
    parser.add_argument("--family", choices=[f.name for f in families()], default="qwen3",
                        help="the model family whose chat template, call format and stop tokens the model gets")
    parser.add_argument(
        "--warm_start", "--warm-start",
        choices=(*TASKS, "all"),
        help="then fine-tune on synthetic transcripts of this task (see toolgym.kit.warm_start)",
    )
    args = parser.parse_args(argv)
    out = build_tiny_model(args.out, seed=args.seed, arch=args.arch, family=family_named(args.family))
    if args.warm_start:
        result = warm_start(out, WarmStartConfig(task=args.warm_start, seed=args.seed))
        print(
            f"warm start ({args.warm_start}): {len(result.losses)} steps in {result.seconds:.0f} s, "
            f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}",
            file=sys.stderr,
        )
    print(out)
    return 0
