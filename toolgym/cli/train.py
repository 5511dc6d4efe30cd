"""``toolgym train``: a training run from a YAML config and/or command-line flags.

Every ``AsyncGRPOConfig`` field is a flag (``--learning_rate 1e-5``) and a YAML key; the run's own
settings (:class:`RunArguments`) sit beside them::

    toolgym train --config run.yaml      (or: toolgym train run.yaml)
    toolgym train --model .cache/tiny-model --dataset prompts.jsonl --reward_funcs trainer.rewards:accuracy_reward \
        --launch_vllm --output_dir out --max_steps 50
    toolgym train --model M --environment environments.counter:IncrementEnv --launch_envserver --max_steps 50

Flags override the YAML file. An unknown field (in the file or on the command line) is refused with
the list of close names. The run is ``AsyncGRPOTrainer(...).train()``, as from Python: it can start
the vLLM server (``--launch_vllm``) and the env server (``--launch_envserver``) for the run and stops
them afterwards, else it uses running ones (``--vllm_server_base_url``, ``--environment ws://...``);
it shows a progress table (``--progress log``: transformers' log lines), reports to the ``report_to``
of your choice (``tensorboard`` and ``trackio`` work offline) and writes plots to
``<output_dir>/plots`` (``--plots false``: none).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from sdk.exceptions import ToolgymError
from sdk.loading import did_you_mean
from toolgym.cli.flag_groups import group_flags
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError
from trainer.trl_fields import refuse_trl_fields


@dataclass
class RunArguments:
    """What to train and on what: the part of a run that only the command line needs (Python passes these to
    ``AsyncGRPOTrainer`` itself); everything else, the launches included, is an ``AsyncGRPOConfig`` field."""

    model: str = field(default="", metadata={"help": "Model directory or id to train (and serve)."})
    dataset: str | None = field(
        default=None,
        metadata={"help": "Training prompts: a .json/.jsonl file of rows with a conversational 'prompt', or "
                  "'module:function' returning a datasets.Dataset. Omit when the environment owns the data."},
    )
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={"help": "Reward functions as 'module:function' (several after one flag, or the flag repeated).",
                  "action": "extend"})
    tools: list[str] = field(
        default_factory=list, metadata={"help": "Tool functions as 'module:function' (like reward_funcs).",
                                        "action": "extend"})
    environment: str | None = field(
        default=None,
        metadata={"help": "Environment: 'module:Class' (or a bundled name like 'counter'), or an env server URL "
                  "'ws://host:port/NAME' / 'http://host:port/NAME' (its token: --env_token)."},
    )
    env_token: str | None = field(
        default=None,
        metadata={"help": "Bearer token of the env server of a URL --environment; default: the TOOLGYM_TOKEN "
                  "environment variable."},
    )
    env_kwargs: str | None = field(
        default=None,
        metadata={"help": "Constructor arguments of a 'module:Class' --environment, a JSON object: "
                  "'{\"high\": 100}' makes each instance GuessEnv(high=100). With --launch_envserver they go to "
                  "the launched server; a remote environment's are set where it is served "
                  "(toolgym serve --env_kwargs)."},
    )


def build_parser() -> HfArgumentParser:
    """The ``toolgym train`` parser, generated from the fields of :class:`RunArguments` and ``AsyncGRPOConfig``.

    Each flag's help is its field's ``metadata["help"]`` (written once, where the field is declared).
    Flags take underscores (``--learning_rate``) and accept dashes (``--learning-rate``); a boolean
    flag alone means true (``--use_cpu``), or takes ``true``/``false``.
    """
    parser = HfArgumentParser(
        # DataClassType is NewType("DataClassType", Any) in transformers: no class passes as one without a cast.
        (RunArguments, AsyncGRPOConfig),  # type: ignore[arg-type]
        prog="toolgym train", allow_abbrev=False, exit_on_error=False,
        usage="toolgym train [--config CONFIG.yaml] [--field value ...]",
        description="Asynchronous GRPO training from a YAML file and/or flags (flags override the file).",
    )
    group_flags(parser)  # the trainer's own flags first, in groups; transformers' after them
    return parser


def _known_fields(parser: HfArgumentParser) -> list[str]:
    return sorted(f.name for cls in parser.dataclass_types for f in dataclasses.fields(cls) if f.init)


def parse_args(argv: list[str]) -> tuple[RunArguments, AsyncGRPOConfig]:
    """YAML file (``--config FILE`` or the first argument) + ``--field value`` flags -> (run args, config).

    Raises:
        ConfigError: a missing file, an unknown field (with close names), no model, or a config that
            ``AsyncGRPOConfig`` refuses.
    """
    parser = build_parser()
    known = _known_fields(parser)
    rest = list(argv)
    for flag in ("--config",):  # --config FILE is the first argument's other spelling
        if flag in rest[:-1]:
            at = rest.index(flag)
            rest = [rest[at + 1]] + rest[:at] + rest[at + 2:]
    if rest and not rest[0].startswith("-"):
        path = Path(rest.pop(0))
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping of field: value")
        refuse_trl_fields(loaded)
        for key in loaded:
            if key not in known:
                raise ConfigError(f"unknown field {key!r} in {path}{did_you_mean(key, known)}")
        # String defaults go through each flag's type like a command-line value; lists/bools as they are.
        parser.set_defaults(**{k: str(v) if isinstance(v, float) else v for k, v in loaded.items()})
    try:
        namespace, unknown = parser.parse_known_args(rest)
    except argparse.ArgumentError as exc:
        raise ConfigError(str(exc)) from None
    if unknown:
        name = unknown[0].lstrip("-").replace("-", "_").partition("=")[0]
        refuse_trl_fields([name])
        raise ConfigError(f"unknown argument {unknown[0]!r}{did_you_mean(name, known)}")
    values = vars(namespace)
    if not values.get("model"):
        raise ConfigError("model is required (--model DIR)")
    if values.get("output_dir") is None:
        values["output_dir"] = f"{Path(values['model']).name}-AsyncGRPO"
    run, config = parser.parse_dict(values)
    return run, config


def _load_dataset(spec: str | None) -> Any:
    if spec is None:
        return None
    from datasets import Dataset

    from sdk import load_target

    if spec.endswith((".json", ".jsonl")):
        return Dataset.from_json(spec)
    return load_target(spec)()


def _environment_factory(run: RunArguments) -> Any:
    """The run's ``environment_factory``; a bad ``--env_kwargs`` fails here, before anything starts.

    A local class bound to ``--env_kwargs`` is a ``functools.partial`` of it, which ``--launch_envserver``
    hosts with those arguments (:mod:`trainer.launch.for_run`).
    """
    from sdk import load_target, remote_factory
    from sdk.loading import parse_env_kwargs, with_arguments

    spec = run.environment
    if spec is None:
        return None
    kwargs = parse_env_kwargs(run.env_kwargs) if run.env_kwargs is not None else {}
    if spec.startswith(("ws://", "wss://", "http://", "https://")):
        if kwargs:
            raise ConfigError("--env_kwargs cannot reach a remote environment: its constructor runs on the env "
                              "server; pass them there (toolgym serve ... --env_kwargs '{\"NAME\": {...}}')")
        base, _, name = spec.rpartition("/")
        return remote_factory(base, name, token=run.env_token)
    return with_arguments(load_target(spec), kwargs)  # checked against the class's signature now


def main(argv: list[str]) -> int:
    """Run ``toolgym train``; returns the exit status (2 for a bad config).

    The trainer does the rest as it does from Python: it starts (and stops) the servers of
    ``--launch_vllm`` / ``--launch_envserver`` and shows the progress table and plots (``--progress``,
    ``--plots``).
    """
    try:
        run, config = parse_args(argv)
    except (ConfigError, ValueError) as exc:
        print(f"toolgym train: {exc}", file=sys.stderr)
        return 2
    from sdk import load_target
    from trainer.async_grpo_trainer import AsyncGRPOTrainer

    try:  # a bad --env_kwargs, --environment or launch fails here, before a server is started
        trainer = AsyncGRPOTrainer(
            model=run.model, args=config, train_dataset=_load_dataset(run.dataset),
            reward_funcs=[load_target(r) for r in run.reward_funcs], tools=[load_target(t) for t in run.tools],
            environment_factory=_environment_factory(run))
    except (ConfigError, ToolgymError) as exc:
        print(f"toolgym train: {exc}", file=sys.stderr)
        return 2
    trainer.train()
    return 0
