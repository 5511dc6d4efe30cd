"""The ``toolgym`` command line: one console script, one subcommand per job.

Each subcommand lives in the package that owns it and is imported only when chosen, so
``toolgym serve`` never imports torch and ``toolgym --help`` answers instantly::

    toolgym tiny-model OUT [--family NAME]     build the tiny local model (toolgym.cli.tiny_model)
    toolgym vllm MODEL [--port P] [-- FLAGS]   start a vLLM server with the trainer's flags
    toolgym serve MODULE:Class [...]           host environments on the env server
    toolgym train [--config C.yaml] [--field v] run asynchronous GRPO training
    toolgym eval --model M --environment E     evaluate: success with intervals, pass@k, results files
    toolgym init NAME                          a new environment project (test, serve, train)
    toolgym demo                               the main job: build, serve, train, report
"""

from __future__ import annotations

import importlib
import signal
import sys
from types import FrameType

# subcommand -> (module, function taking argv, one-line help)
_SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "tiny-model": ("toolgym.cli.tiny_model", "main", "build the tiny local model and tokenizer of a family"),
    "vllm": ("toolgym.cli.vllm", "main", "start a vLLM server with the flags the trainer needs"),
    "serve": ("envserver.cli", "main", "host environment classes on the env server"),
    "train": ("toolgym.cli.train", "main", "run asynchronous GRPO training from a config"),
    "eval": ("toolgym.cli.eval", "main", "evaluate a model on an environment or dataset: intervals, pass@k, files"),
    "demo": ("toolgym.cli.demo", "main", "the main job: tiny model, vLLM, env server, training"),
    "init": ("toolgym.cli.init", "main", "create a new environment project: test, serve, train"),
}


# Commands that start child servers: SIGTERM must unwind their ``with`` blocks so the servers stop.
# ``serve`` is left alone: uvicorn handles SIGTERM itself (graceful drain).
_UNWIND_ON_SIGTERM = {"tiny-model", "vllm", "train", "eval", "demo"}


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit(143)`` so ``finally`` and ``with`` blocks run (child servers stop)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _usage() -> str:
    lines = ["usage: toolgym <command> [args...]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, _, help_) in _SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``toolgym <command> ...`` to the owning module; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in _SUBCOMMANDS:
        print(f"toolgym: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = _SUBCOMMANDS[name]
    if name in _UNWIND_ON_SIGTERM:
        exit_on_sigterm()
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
