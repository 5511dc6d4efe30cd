"""The counter experiment: the tiny model warm-started on counter transcripts, trained with
``AsyncGRPOTrainer`` against the counter environment, and measured before and after.

``toolgym demo`` (:mod:`toolgym.cli.demo`), the end-to-end tests (``tests/e2e``) and the benchmarks
(``bench/e2e``) all run this one experiment through these building blocks: :func:`warm_model`,
:func:`counter_config`, :func:`evaluate_counter` (or ``toolgym eval`` with :func:`counter_eval_argv`),
:func:`serve_policy`, :func:`counter_trainer`, :func:`learning_run`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import AsyncGRPOConfig
from trainer.rollout.evaluation import PolicyEval, evaluate_policy
from trainer.rollout.settings import RolloutSettings

TARGETS = (1, 2, 3, 4, 5, 6)
EVAL_EPISODES_PER_TARGET = 96
EVAL_SETTINGS = {"max_completion_length": 48, "max_tool_calling_iterations": 8, "max_concurrent_rollouts": 32}
"""The evaluations' rollout settings (the training run's lengths), in :func:`evaluate_counter` and
:func:`counter_eval_argv` alike."""
WARM_START_STEPS = 400
DONE_MARKER = ".warm-start-done"
"""Written into a warm-started model's folder once it is complete: :func:`warm_model` reuses such a folder."""


def _digit_weight(family: str) -> float:
    """The warm start's ``digit_weight`` for ``family``'s call layout.

    Qwen3's JSON call lets the tiny model copy the target through an induction head; other layouts need
    the digits' loss raised to learn reading the target at all (:class:`toolgym.kit.warm_start.WarmStartConfig`).
    Qwen3 keeps 1, so the demo's model, and every figure measured with it, stays as it was.
    """
    return 1.0 if family == "qwen3" else 10.0


def build_warm_counter_model(model_dir: str | Path, seed: int = 0, steps: int = WARM_START_STEPS,
                             family: str = "qwen3", arch: str = "qwen3") -> Path:
    """Build the tiny model in ``model_dir`` and warm-start it on counter transcripts: the demo's model.

    What ``make demo`` (through :func:`warm_model`) and ``toolgym tiny-model DIR --warm_start counter``
    both build: same seed, steps and task give the same weights on one machine.

    Args:
        model_dir: Where the model goes (created; its files replaced).
        seed: Seeds the model's initialisation, the transcripts and the fine-tune.
        steps: Optimizer steps of the warm start (400 take about two minutes of CPU time, more when
            the fine-tune restarts from a fresh initialisation: see ``WarmStartConfig.restart_check_step``).
        family: The model family whose chat template and call format the model learns (:mod:`trainer.families`).
        arch: The tiny model's architecture (:data:`toolgym.kit.tiny_model.ARCHITECTURES`).
    """
    from toolgym.kit.tiny_model import build_tiny_model
    from toolgym.kit.warm_start import WarmStartConfig, warm_start
    from trainer.families import family_named

    t0 = time.monotonic()
    model_dir = build_tiny_model(model_dir, seed=seed, arch=arch, family=family_named(family))
    result = warm_start(model_dir, WarmStartConfig(task="counter", seed=seed, steps_per_task=steps,
                                                   digit_weight=_digit_weight(family)))
    (model_dir / DONE_MARKER).write_text("ok\n")
    print(f"built and warm-started the tiny model in {time.monotonic() - t0:.0f} s -> {model_dir} "
          f"({result.attempts} initialisation(s); probability of stepping to the target: "
          f"{result.target_step_prob:.2f})")
    return model_dir


def warm_model(cache: Path, seed: int, steps: int = WARM_START_STEPS, family: str = "qwen3") -> Path:
    """The tiny model warm-started on counter transcripts (:func:`build_warm_counter_model`), built once and
    reused from ``cache``.

    Args:
        cache: Folder holding the built models (one sub-folder per seed, length and family).
        seed: Seeds the model's initialisation, the transcripts and the fine-tune.
        steps: Optimizer steps of the warm start.
        family: The model family whose chat template and call format the model learns.
    """
    suffix = ("" if steps == WARM_START_STEPS else f"-steps{steps}") + (
        "" if family == "qwen3" else f"-{family}-digits{_digit_weight(family):g}")
    model_dir = cache / f"warm-counter-v2-seed{seed}{suffix}"  # v2: the one-call policy of toolgym.kit.warm_start
    if not (model_dir / DONE_MARKER).exists():
        build_warm_counter_model(model_dir, seed, steps, family)
    return model_dir


def counter_dataset(copies: int = 16) -> Any:
    """Training rows: every target of :data:`TARGETS`, ``copies`` times (a ``datasets.Dataset``)."""
    from datasets import Dataset

    return Dataset.from_dict({"target": [t for t in TARGETS for _ in range(copies)]})


def counter_config(output_dir: str | Path, base_url: str, steps: int, seed: int = 0,
                   **overrides: Any) -> AsyncGRPOConfig:
    """The demo's training configuration for the counter task; ``overrides`` replace any field.

    Args:
        output_dir: The run folder (logs, plots; no checkpoints).
        base_url: The vLLM server.
        steps: Optimizer steps (``max_steps``).
        seed: The trainer's seed (prompt order, initialisation of anything random).
        **overrides: Other ``AsyncGRPOConfig`` fields (``max_staleness``, ``report_to``, ...).

    The learning rate, 3e-4, decays linearly to 0. Before the trainer trained rollouts only up to
    their first tail token (``tail_token_prob``) and credited each turn against the rollouts that
    reached its state (``turn_baseline``), 3e-4 collapsed runs (a derailed rollout's gradient
    steered whole steps; the final turn's fragments were reinforced by the first call's reward),
    and 2e-4 still collapsed trainer seed 3; with both, 3e-4 learns faster and holds
    (``bench/e2e/README.md``).
    """
    fields: dict[str, Any] = dict(
        output_dir=str(output_dir), vllm_server_base_url=base_url, max_steps=steps,
        num_generations=8, max_completion_length=48, max_tool_calling_iterations=8, mask_truncated_completions=True,
        learning_rate=3e-4, lr_scheduler_type="linear",
        gradient_accumulation_steps=4, use_cpu=True, gradient_checkpointing=False, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=seed, max_staleness=2)
    fields.update(overrides)
    return AsyncGRPOConfig(**fields)


def counter_eval_rows() -> Any:
    """The evaluation rows: one per target of :data:`TARGETS` (a ``datasets.Dataset``; ``toolgym eval --dataset
    toolgym.kit.counter_experiment:counter_eval_rows``)."""
    from datasets import Dataset

    return Dataset.from_dict({"target": list(TARGETS)})


def evaluate_counter(base_url: str, model_dir: str | Path, environment_factory: Any,
                     episodes_per_target: int = EVAL_EPISODES_PER_TARGET) -> PolicyEval:
    """Success on fresh counter episodes (every target of :data:`TARGETS`) of the served policy; its
    ``run`` has every episode and the per-target summary."""
    settings = RolloutSettings.from_server(base_url, str(model_dir), **EVAL_SETTINGS)
    return evaluate_policy(settings, environment_factory, [dict(row) for row in counter_eval_rows()],
                           samples_per_row=episodes_per_target, concurrency=EVAL_SETTINGS["max_concurrent_rollouts"],
                           group_by="target")


def counter_eval_argv(base_url: str, model_dir: str | Path, environment: str, output_dir: str | Path,
                      episodes_per_target: int = EVAL_EPISODES_PER_TARGET) -> list[str]:
    """The ``toolgym eval`` flags of :func:`evaluate_counter`'s evaluation, its files written to ``output_dir``.

    Args:
        base_url: The vLLM server serving the policy.
        model_dir: The served model (its tokenizer).
        environment: The counter environment: ``counter``, or its env server URL (``http://host:port/IncrementEnv``).
        output_dir: Where ``results.jsonl`` and ``summary.json`` go.
        episodes_per_target: Episodes per target.
    """
    settings = [f"--{name}={value}" for name, value in EVAL_SETTINGS.items()]
    return ["--vllm_server_base_url", base_url, "--model", str(model_dir), "--environment", environment,
            "--dataset", f"{__name__}:counter_eval_rows", "--group_by", "target",
            "--num_generations", str(episodes_per_target), "--output_dir", str(output_dir), *settings]


def serve_policy(base_url: str, model_dir: str | Path, version: int = 0,
                 weights: Iterable[tuple[str, Any]] | None = None) -> None:
    """Push weights into the running server as policy ``version`` (:func:`trainer.sync.push_weights`).

    Lets one server start every run from the same policy (tests, benchmark): a training run
    leaves its last weights on the server.

    Args:
        base_url: The vLLM server.
        model_dir: The served checkpoint (names and shapes are checked against it).
        version: The policy version the server reports afterwards.
        weights: ``(name, tensor)`` pairs to push; default: the weights saved in ``model_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.sync import push_weights

    if weights is None:
        weights = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()
    push_weights(base_url, weights, version, model_dir)


def counter_trainer(model_dir: str | Path, environment_factory: Any, config: AsyncGRPOConfig,
                    callbacks: Sequence[Any] = ()) -> Any:
    """The demo's ``AsyncGRPOTrainer`` on the counter task (the progress table and plots of ``config``).

    The training reward is the environment's ``get_reward`` (1.0 at the target) plus
    :func:`trainer.rewards.tool_error_penalty` (-0.5 for a rollout with a failed call).
    """
    from transformers import AutoTokenizer

    from trainer.async_grpo_trainer import AsyncGRPOTrainer
    from trainer.rewards import tool_error_penalty

    trainer = AsyncGRPOTrainer(model=str(model_dir), args=config, train_dataset=counter_dataset(),
                               reward_funcs=tool_error_penalty,
                               processing_class=AutoTokenizer.from_pretrained(model_dir),
                               environment_factory=environment_factory, callbacks=list(callbacks))
    return trainer


@dataclass
class LearningRun:
    """A before/after measurement around one training run.

    Attributes:
        before: Held-out evaluation of the served policy before training.
        after: The same evaluation after training.
        log_history: The trainer's log history (one entry per step, then the summary).
        train_s: Wall time of ``trainer.train()``.
    """

    before: PolicyEval
    after: PolicyEval
    log_history: list[dict[str, Any]] = field(default_factory=list)
    train_s: float = 0.0


def learning_run(model_dir: str | Path, environment_factory: Any, config: AsyncGRPOConfig,
                 episodes_per_target: int = EVAL_EPISODES_PER_TARGET, callbacks: Sequence[Any] = (),
                 before: PolicyEval | None = None) -> LearningRun:
    """Evaluate the served policy, train it on the counter task, evaluate again.

    Trains with :func:`counter_trainer`; the evaluations count the environment's reward only.

    The server at ``config.vllm_server_base_url`` must already serve ``model_dir``'s weights
    (see :func:`serve_policy`); the trainer leaves its final weights there.

    Args:
        model_dir: The model to train (its weights are the served ones).
        environment_factory: The counter environment (local class or ``remote_factory``).
        config: The training configuration (see :func:`counter_config`).
        episodes_per_target: Evaluation episodes per target, before and after.
        callbacks: Extra trainer callbacks (progress table, plots, ...).
        before: An evaluation already made of these weights (skips the first one).
    """
    base_url = config.vllm_server_base_url
    if before is None:
        before = evaluate_counter(base_url, model_dir, environment_factory, episodes_per_target)
    trainer = counter_trainer(model_dir, environment_factory, config, callbacks)
    t0 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t0
    after = evaluate_counter(base_url, model_dir, environment_factory, episodes_per_target)
    return LearningRun(before=before, after=after, log_history=list(trainer.state.log_history), train_s=train_s)
