"""``toolgym tiny-model``: build (and warm-start) the tiny local model of any model family.

::

    toolgym tiny-model OUT [--seed N] [--arch {qwen3,qwen3_5,qwen3_5_vl,qwen3_next}] [--family NAME]
                           [--warm_start {counter,arithmetic,all}]

What it builds is said once, in :data:`DESCRIPTION` (its ``--help``); the model is
:mod:`toolgym.kit.tiny_model`'s, the warm start :mod:`toolgym.kit.warm_start`'s, and ``--warm_start counter``
is :func:`toolgym.kit.counter_experiment.build_warm_counter_model`, the one builder of the demo's model.
"""

from __future__ import annotations

import argparse
import sys

from toolgym.kit.tiny_model import ARCHITECTURES, build_tiny_model
from toolgym.kit.warm_start import TASKS, WarmStartConfig, warm_start
from trainer.families import families, family_named

__all__ = ["main"]

DESCRIPTION = """\
Build, offline, the tiny model: a Qwen3-shaped model of about 1M parameters (4 layers, hidden 128) with a
2,048-token byte-level tokenizer and the chat template, call format and stop tokens of a model family; a few
seconds. With --warm_start counter it is then fine-tuned on counter transcripts (one increment call per turn)
exactly as `make demo` builds it (same seed, steps and task): the demo's model, which the README and docs use
as .cache/warm-counter-v2-seed0; about two minutes of one CPU core."""
EPILOG = "The demo's model, without the demo:  toolgym tiny-model .cache/warm-counter-v2-seed0 --warm_start counter"


def main(argv: list[str]) -> int:
    """Build (and warm-start) the tiny model; prints its directory and returns the exit status."""
    parser = argparse.ArgumentParser(prog="toolgym tiny-model", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation (and warm-start) seed")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen3",
                        help="qwen3 (default) or a Gated DeltaNet hybrid: qwen3_5, qwen3_5_vl, qwen3_next")
    parser.add_argument("--family", choices=[f.name for f in families()], default="qwen3",
                        help="the model family whose chat template, call format and stop tokens the model gets")
    parser.add_argument(
        "--warm_start", "--warm-start",
        choices=(*TASKS, "all"),
        help="then fine-tune on synthetic transcripts of this task (see toolgym.kit.warm_start); counter: the "
             "demo's model (about two minutes), arithmetic or all: about three",
    )
    args = parser.parse_args(argv)
    if args.warm_start == "counter":  # the one builder of the demo's model
        from toolgym.kit.counter_experiment import build_warm_counter_model

        print(build_warm_counter_model(args.out, seed=args.seed, family=args.family, arch=args.arch))
        return 0
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
