"""``toolgym eval``: how good is this model on this environment? Numbers with error bars, per task, in files.

A served model (a running vLLM server, or a model directory, a run's ``checkpoint-N`` folder or a LoRA
adapter folder that it serves itself) runs ``--num_generations`` episodes of every row against an
environment (a bundled name, ``module:Class``, or an env server URL) and/or reward functions,
through the same rollout loop, tool-call parsing and scoring as training
(:mod:`trainer.rollout.eval_episodes`)::

    toolgym eval --model .cache/warm-counter-v2-seed0 --environment counter --num_rows 6 --output_dir eval/warm
    toolgym eval --vllm_server_base_url http://127.0.0.1:8000 --model M --environment ws://host:8001/IncrementEnv
    toolgym eval --model M --dataset rows.jsonl --reward_funcs trainer.rewards:accuracy_reward
    toolgym eval --compare eval/warm eval/trained

It prints a table (success rate and mean reward with 95 % intervals, pass@k, tool calls, failed and
malformed calls, turns, tokens; one row per task with ``--group_by COLUMN``) and writes
``results.jsonl`` (one line per episode) and ``summary.json`` to ``--output_dir``. ``--compare A B``
reads two such folders and prints B - A with its interval and a two-proportion test. Ctrl-C stops
the evaluation and writes the episodes that finished. Every flag comes from a field declaration
below (``toolgym eval --help``); the sampling flags are ``toolgym train``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from sdk.exceptions import ToolgymError
from sdk.loading import did_you_mean
from toolgym.cli.train import RunArguments
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError
from trainer.rollout.eval_results import (
    RESULTS_FILE,
    SUMMARY_FILE,
    EpisodeResult,
    EvalSummary,
    format_table,
    summarize,
    write_run,
)


def _declared(cls: type[Any], name: str, help: str | None = None, default: Any = dataclasses.MISSING) -> Any:
    """A field declared like ``cls``'s field ``name``: its default and help (one of them replaced)."""
    declared = {f.name: f for f in dataclasses.fields(cls)}[name]
    metadata = dict(declared.metadata) | ({"help": help} if help is not None else {})
    if default is not dataclasses.MISSING:
        return field(default=default, metadata=metadata)
    if declared.default_factory is not dataclasses.MISSING:
        return field(default_factory=declared.default_factory, metadata=metadata)
    return field(default=declared.default, metadata=metadata)


@dataclass
class EvalArguments:
    """What ``toolgym eval`` evaluates, on what, how many times, and where the results go."""

    model: str = field(default="", metadata={"help": (
        "The model: a model directory, a training run's checkpoint-N folder, or a LoRA adapter folder (served on "
        "its base model with --enable-lora). Served here on a vLLM server unless --vllm_server_base_url names a "
        "running one that serves it. Its tokenizer renders the prompts.")})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": (
        "A running vLLM server to evaluate (as its weights are now); default: start one on --model.")})
    vllm_max_model_len: int = _declared(AsyncGRPOConfig, "vllm_max_model_len", help=(
        "--max-model-len of the vLLM server started here on --model: the longest prompt + completion."))
    environment: str | None = _declared(RunArguments, "environment")
    env_token: str | None = _declared(RunArguments, "env_token")
    env_kwargs: str | None = _declared(RunArguments, "env_kwargs", help=(
        "Constructor arguments of a 'module:Class' --environment, a JSON object: '{\"high\": 100}' makes each "
        "instance GuessEnv(high=100). A remote environment's are set where it is served (toolgym serve --env_kwargs)."))
    dataset: str | None = field(default=None, metadata={"help": (
        "Evaluation rows: a .json/.jsonl file, or 'module:function' returning a datasets.Dataset. A row holds a "
        "conversational 'prompt' and/or the environment's reset() arguments. Without one, row i resets the "
        "environment with seed=i (the same episodes in every run).")})
    reward_funcs: list[str] = _declared(RunArguments, "reward_funcs")
    tools: list[str] = _declared(RunArguments, "tools")
    num_rows: int | None = field(default=None, metadata={"help": (
        "Rows to evaluate: the dataset's first N (default: all of them); without a dataset, N seeded episodes "
        "(default: 16).")})
    num_generations: int = field(default=8, metadata={"help": (
        "Episodes per row: the n of pass@k (k = 1..n).")})
    group_by: str | None = field(default=None, metadata={"help": (
        "A row column naming its task (e.g. 'target'): one table row and summary entry per value. "
        "Default: the environment column when rows are routed to several environments.")})
    success_threshold: float = field(default=1.0, metadata={"help": (
        "An episode succeeds when its summed reward is at least this (success rate, pass@k).")})
    output_dir: str | None = field(default=None, metadata={"help": (
        "Where results.jsonl and summary.json are written; default: eval-<model folder name>.")})
    compare: list[str] = field(default_factory=list, metadata={"help": (
        "Compare two finished runs instead of evaluating: --compare A B (their output folders). Prints B - A "
        "with its 95%% interval and a two-proportion test.")})
    temperature: float = _declared(AsyncGRPOConfig, "temperature", help="Sampling temperature (0: greedy).")
    top_p: float = _declared(AsyncGRPOConfig, "top_p")
    top_k: int = _declared(AsyncGRPOConfig, "top_k")
    min_p: float | None = _declared(AsyncGRPOConfig, "min_p")
    max_completion_length: int = _declared(AsyncGRPOConfig, "max_completion_length")
    max_tool_calling_iterations: int | None = _declared(AsyncGRPOConfig, "max_tool_calling_iterations")
    max_concurrent_rollouts: int = _declared(AsyncGRPOConfig, "max_concurrent_rollouts", default=64)
    reward_timeout: float | None = _declared(AsyncGRPOConfig, "reward_timeout")
    vllm_server_timeout: float = _declared(AsyncGRPOConfig, "vllm_server_timeout")
    seed: int = _declared(AsyncGRPOConfig, "seed", help="Seeds each episode's sampling (the same seed, the same "
                          "draws from the same model).")


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_completion_length", "max_tool_calling_iterations",
                   "max_concurrent_rollouts", "reward_timeout", "vllm_server_timeout", "seed")
"""The fields that are :class:`~trainer.rollout.settings.RolloutSettings` fields of the same name."""
SEEDED_ROWS = 16


def build_parser() -> HfArgumentParser:
    """The ``toolgym eval`` parser, generated from :class:`EvalArguments` (help from each field's declaration)."""
    return HfArgumentParser(
        EvalArguments,  # type: ignore[arg-type]  # DataClassType is a NewType of Any in transformers
        prog="toolgym eval", allow_abbrev=False, exit_on_error=False,
        usage="toolgym eval --model M (--environment E | --dataset D --reward_funcs F) [--field value ...]\n"
              "       toolgym eval --compare RUN_A RUN_B",
        description="Evaluate a served model on an environment or a dataset through the training rollout loop.",
    )


def parse_args(argv: list[str]) -> EvalArguments:
    """``--field value`` flags -> :class:`EvalArguments`.

    Raises:
        ConfigError: An unknown flag (with close names), a bad value, or flags that cannot go together.
    """
    parser = build_parser()
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(str(exc)) from None
    if unknown:
        name = unknown[0].lstrip("-").replace("-", "_").partition("=")[0]
        known = [f.name for f in dataclasses.fields(EvalArguments)]
        raise ConfigError(f"unknown argument {unknown[0]!r}{did_you_mean(name, known)}")
    (args,) = parser.parse_dict(vars(namespace))
    _check(args)
    return args  # type: ignore[no-any-return]  # parse_dict returns the EvalArguments it built


def _check(args: EvalArguments) -> None:
    if args.compare:
        if len(args.compare) != 2:
            raise ConfigError(f"--compare takes two run folders (A B), got {len(args.compare)}: {args.compare}")
        return
    if not args.model and args.vllm_server_base_url is None:
        raise ConfigError("say what to evaluate: --model DIR (served here), or --vllm_server_base_url URL of a "
                          "running server (with --model naming what it serves, for the tokenizer)")
    if args.environment is None and args.dataset is None:
        raise ConfigError("say what to evaluate on: --environment (a bundled name, module:Class or an env server "
                          "URL) and/or --dataset with --reward_funcs")
    if args.environment is None and not args.reward_funcs:
        raise ConfigError("--dataset without --environment needs --reward_funcs: nothing would score the episodes")
    if args.num_generations < 1:
        raise ConfigError(f"--num_generations {args.num_generations}: give at least 1 episode per row")
    if args.num_rows is not None and args.num_rows < 1:
        raise ConfigError(f"--num_rows {args.num_rows}: give at least 1 row, or leave it out for every row")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature} must be >= 0 (0: greedy)")


def load_rows(args: EvalArguments) -> list[dict[str, Any]]:
    """The evaluation rows: the dataset's first ``num_rows``, or ``num_rows`` seeded environment episodes.

    Raises:
        ConfigError: The dataset cannot be read, is empty, or has no prompts while no environment writes them.
    """
    from toolgym.cli.train import _load_dataset as load_dataset

    if args.dataset is None:
        return [{"seed": i} for i in range(args.num_rows or SEEDED_ROWS)]
    try:
        dataset = load_dataset(args.dataset)
    except ToolgymError:
        raise  # a module:function that does not exist, with close names
    except Exception as exc:  # datasets' many reading errors, an empty file's among them
        raise ConfigError(f"--dataset {args.dataset} could not be read ({type(exc).__name__}: {exc}): give a .json/"
                          ".jsonl file of rows, or module:function returning a datasets.Dataset") from exc
    rows = [dict(row) for _, row in zip(range(args.num_rows or len(dataset)), dataset, strict=False)]
    if not rows:
        raise ConfigError(f"--dataset {args.dataset} holds no rows")
    if args.environment is None and not rows[0].get("prompt"):
        raise ConfigError(f"--dataset {args.dataset}: its rows have no 'prompt' (columns: {sorted(rows[0])}), and "
                          "without --environment nothing else writes one; add a conversational 'prompt' column "
                          "([{\"role\": \"user\", \"content\": ...}]) or pass --environment")
    return rows


def _about(args: EvalArguments, rows: int, served: str) -> dict[str, Any]:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in ("compare",
                                                                                               "env_token")}
    return values | {"rows": rows, "served_model": served, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def compare(args: EvalArguments) -> int:
    """``--compare A B``: print B - A; returns the exit status."""
    from trainer.rollout.eval_results import compare_runs, format_comparison

    a, b = args.compare
    print(format_comparison(compare_runs(a, b), Path(a).name or a, Path(b).name or b))
    return 0


def evaluate(args: EvalArguments) -> tuple[EvalSummary, bool]:
    """Serve (if asked), run the episodes, print the table and write the files.

    Returns:
        The summary, and whether Ctrl-C stopped the evaluation (the summary then covers the episodes
        that finished).
    """
    import environments  # noqa: F401  # registers the bundled names (--environment counter)
    from toolgym.cli.eval_serving import served_model
    from toolgym.cli.train import _environment_factory as environment_factory
    from trainer.rollout.evaluation import evaluate as run_evaluation
    from trainer.rollout.settings import RolloutSettings

    output_dir = Path(args.output_dir or f"eval-{Path(args.model.rstrip('/')).name or 'model'}")
    rows = load_rows(args)
    with contextlib.ExitStack() as stack:
        run = RunArguments(model=args.model, environment=args.environment, env_token=args.env_token,
                           env_kwargs=args.env_kwargs)
        factory = environment_factory(run)  # a bad --environment fails before a server starts
        reward_funcs, tools = _load_functions(args.reward_funcs), _load_functions(args.tools)
        served = stack.enter_context(served_model(args, output_dir))
        settings = RolloutSettings.from_server(served.base_url, served.tokenizer, lora_name=served.lora_name,
                                               **{name: getattr(args, name) for name in SAMPLING_FIELDS})
        if not served.tokenizer:  # a running server, no --model: the tokenizer of the model it serves
            settings = dataclasses.replace(settings, model_name=settings.server.model)
        progress = stack.enter_context(_Progress(len(rows) * args.num_generations))
        try:
            run_evaluation(settings, rows, args.num_generations, environment_factory=factory,
                           reward_funcs=reward_funcs, tools=tools, group_by=args.group_by,
                           success_threshold=args.success_threshold,
                           on_episode=progress.advance)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
    about = _about(args, len(rows), served.name) | {"interrupted": interrupted}
    summary = report(progress.finished, output_dir, about)
    if interrupted:
        print("interrupted: the files hold the episodes that finished")
    return summary, interrupted


def report(episodes: list[EpisodeResult], output_dir: Path, about: dict[str, Any]) -> EvalSummary:
    """Write ``results.jsonl`` and ``summary.json`` to ``output_dir``, print the table and the commonest
    errors of failed episodes: ``toolgym eval``'s output (the demo's evaluations print it too)."""
    summary = summarize(episodes)
    write_run(output_dir, episodes, summary, about)
    print(format_table(summary))
    errors: dict[str, int] = {}
    for e in episodes:
        if e.error is not None:
            errors[e.error] = errors.get(e.error, 0) + 1
    for message, count in sorted(errors.items(), key=lambda item: -item[1])[:3]:
        print(f"failed episodes ({count}): {message}", file=sys.stderr)
    print(f"{len(episodes)} episodes -> {output_dir / RESULTS_FILE}, {output_dir / SUMMARY_FILE}")
    return summary


def _load_functions(specs: list[str]) -> list[Any]:
    from sdk import load_target

    return [load_target(spec) for spec in specs]


class _Progress:
    """A progress bar on stderr (episodes done, the success rate so far); keeps the finished episodes."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self.task = self.bar.add_task("episodes", total=total)
        self.finished: list[EpisodeResult] = []
        self.successes = 0

    def __enter__(self) -> _Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def advance(self, episode: EpisodeResult) -> None:
        """Count one finished episode."""
        self.finished.append(episode)
        self.successes += episode.success
        self.bar.update(self.task, advance=1, description=f"success {self.successes / len(self.finished):.1%}")


def main(argv: list[str]) -> int:
    """Run ``toolgym eval``; returns the exit status: 2 for bad flags or input, 1 for a run that failed
    (or whose every episode failed), 130 after Ctrl-C."""
    try:
        args = parse_args(argv)
        if args.compare:
            return compare(args)
        summary, interrupted = evaluate(args)
        if interrupted:
            return 130
        return 1 if summary.episodes and summary.failed_episodes == summary.episodes else 0
    except (ToolgymError, ValueError, KeyError) as exc:  # a KeyError: a row routed to no environment
        print(f"toolgym eval: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2 if isinstance(exc, (ValueError, KeyError)) else 1
    except KeyboardInterrupt:  # before the episodes started (while a server started): nothing to write
        print("toolgym eval: interrupted", file=sys.stderr)
        return 130

