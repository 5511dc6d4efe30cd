"""Warm start: a short supervised fine-tune of the tiny model on synthetic transcripts.

A randomly initialised model never emits a well-formed tool call, so an RL run starting from it has
no signal. The warm start teaches the format, not the skill: transcripts come from a deliberately
imperfect policy, so the warm model calls tools correctly but reaches the goal only part of the
time, and RL has something to learn. Two tasks:

- ``counter``: :class:`environments.counter.IncrementEnv` with its real tool schema. The prompt is
  what ``reset(target=t)`` returns; the assistant calls ``increment`` once, stepping straight to the
  target with probability ``exact_step_prob`` and otherwise by a step drawn uniformly from
  ``[1, max_target]``; the tool reply carries the counter and a final assistant message states it.
  With the defaults half the transcripts succeed (0.4 + 0.6 / 6), after a teaching phase where
  every call is exact (``WarmStartConfig.restart_check_step``). The skill RL then sharpens is
  reading the target into the call, which every episode exercises the same way (one call, one
  answer): successes and failures have the same shape and length, so the reward tells apart only
  the step. The earlier multi-step policy (random steps until the counter reached the target)
  learned slowly and unreliably under RL; see ``bench/e2e/README.md`` for the study.
- ``arithmetic``: ``What is a + b?`` answered ``The answer is \\boxed{s}.``, with a wrong sum in a
  fraction ``arithmetic_error_rate`` of transcripts.

Command line (through the tiny-model kit)::

    toolgym tiny-model OUT --warm-start {counter,arithmetic,all} [--seed N]
"""

from __future__ import annotations

import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BatchEncoding,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback
from transformers.utils.chat_template_utils import get_json_schema

from environments.counter import IncrementEnv
from trainer.exceptions import ConfigError
from trainer.launch.threads import torch_threads
from trainer.records import TrainingSample, TrainingSequence
from trainer.rollout.chat_template import (
    EMPTY_REASONING,
    build_assistant_message,
    completion_text,
    render_prompt_ids,
    rollout_family,
    stop_token_ids,
)
from trainer.training.logprobs import forward_packed
from trainer.training.packing import build_row
from trainer.training.tree_attention import enable_tree_attention

__all__ = [
    "TASKS",
    "EvalResult",
    "Transcript",
    "WarmStartConfig",
    "arithmetic_prompt",
    "counter_tools",
    "evaluate",
    "fine_tune",
    "synthetic_transcripts",
    "warm_start",
]

TASKS = ("counter", "arithmetic")


@dataclass(frozen=True)
class WarmStartConfig:
    """How the transcripts are drawn and how long the fine-tune runs.

    Attributes:
        task: ``"counter"``, ``"arithmetic"`` or ``"all"`` (both, interleaved).
        seed: Seeds the transcripts, the data order and the initialisation of training.
        num_transcripts: Transcripts per task; ``None`` draws as many as the run reads
            (``max_steps * batch_size`` in all), so none is seen twice.
        steps_per_task: Optimizer steps per task (the run has ``max_steps`` of them). Sampled
            counter success grows with it up to about 500 (measured with both tasks: 200 gave
            10-25 %, 500 gave 33-42 %, 1,000 no more).
        batch_size: Transcripts per optimizer step.
        learning_rate: Peak AdamW learning rate (linear warm-up over 5 % of steps, then cosine).
        max_target: Counter targets are drawn from ``[1, max_target]`` (``IncrementEnv``'s default range).
        exact_step_prob: Probability that the counter call steps exactly to the target; the other
            calls step by a uniform draw from ``[1, max_target]``.
        restart_check_step: The first ``restart_check_step * batch_size`` counter transcripts always
            step exactly to the target (the strongest signal for learning to read it); at that
            step the fine-tune measures the model's probability of stepping to the target
            (:func:`target_step_prob`) and, still at chance (below ``1.25 / max_target``), restarts
            from a fresh initialisation. Whether the model learns to read the target at all
            depends on the initialisation: from one init it does within ~100-300 steps, from
            another it sits at exactly ``1 / max_target`` for 800 steps (measured over ten
            seeds, about half each way), so waiting longer does not help. The rest of the
            transcripts follow the imperfect policy (``exact_step_prob``).
        max_attempts: Initialisations tried before keeping the last one (with a warning).
        digit_weight: Loss weight of the trained digit tokens (the counter's step, the final answer's
            number, the arithmetic answer) against 1 for every other trained token. Whether the model
            can read the target cheaply depends on the call layout: in Qwen3's JSON call the step
            follows the same `` `` token as the target in the prompt (``... to 3.`` / ``"step": 3``),
            so one induction head copies it; in an XML layout (Qwen3.5's ``<parameter=step>\n3``)
            nothing in front of the step matches the prompt, and at weight 1 the model sat at chance
            (probability 0.165 of the target's step after 200 steps, four initialisations in a row).
            At 10 the same run reached 0.81 at step 150 and 0.90 at step 200 (only exact steps,
            ``bench/e2e/README.md``).
        empty_think_prob: Fraction of counter transcripts whose assistant turns open with an empty
            reasoning block (``<think>\n\n</think>\n\n``), as Qwen3-style templates open every turn
            when thinking is off. A model that never saw the block loses the call format after it
            (measured: it wrote ``2}}`` with no ``<tool_call>``). 0 draws nothing extra, so the
            transcripts of a seed do not change.
        arithmetic_max: Arithmetic operands are drawn from ``[0, arithmetic_max]``.
        arithmetic_error_rate: Fraction of arithmetic transcripts whose boxed answer is wrong.
        num_threads: Torch intra-op threads while training and sampling. The matrices are tiny:
            on a busy 2-core machine one thread ran a step 4-8x faster than two (no OpenMP spinning).
    """

    task: str = "all"
    seed: int = 0
    num_transcripts: int | None = None
    steps_per_task: int = 500
    batch_size: int = 16
    learning_rate: float = 3e-3
    max_target: int = 6
    exact_step_prob: float = 0.4
    restart_check_step: int = 150
    max_attempts: int = 4
    digit_weight: float = 1.0
    empty_think_prob: float = 0.0
    arithmetic_max: int = 5
    arithmetic_error_rate: float = 0.3
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.task not in (*TASKS, "all"):
            raise ConfigError(f"task must be one of {(*TASKS, 'all')}, got {self.task!r}")
        for name in ("num_transcripts", "steps_per_task", "batch_size", "max_target", "num_threads",
                     "restart_check_step", "max_attempts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.digit_weight <= 0:
            raise ConfigError(f"digit_weight must be > 0, got {self.digit_weight}")
        for name in ("exact_step_prob", "arithmetic_error_rate", "empty_think_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this configuration trains on."""
        return TASKS if self.task == "all" else (self.task,)

    @property
    def max_steps(self) -> int:
        """Optimizer steps of the whole run: ``steps_per_task`` for each task."""
        return self.steps_per_task * len(self.tasks)

    @property
    def transcripts_per_task(self) -> int:
        """``num_transcripts``, or what the run reads when it is ``None``."""
        if self.num_transcripts is not None:
            return self.num_transcripts
        return self.steps_per_task * self.batch_size


@dataclass
class Transcript:
    """One synthetic conversation and the tool schemas rendered with it.

    Attributes:
        messages: The chat messages, first user prompt included.
        tools: Tool JSON schemas, or ``None`` for a task without tools.
        success: Whether the transcript reaches the task's goal.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    success: bool


def counter_tools() -> list[dict[str, Any]]:
    """The counter environment's tool schemas, exactly as the trainer renders them."""
    return [get_json_schema(IncrementEnv().increment)]


def arithmetic_prompt(a: int, b: int) -> str:
    """The user prompt of the arithmetic task for ``a + b`` (answer expected in ``\\boxed{}``)."""
    return f"What is {a} + {b}?"


# The transcripts' one call has an id (Kimi K2's form, which its template writes back) that its result names.
CALL_ID = "functions.increment:0"


def _tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "id": CALL_ID, "function": {"name": name, "arguments": arguments}}


def counter_transcript(target: int, rng: random.Random, config: WarmStartConfig, exact: bool = False) -> Transcript:
    """An episode of the imperfect counter policy against the real environment: one call, one answer.

    Args:
        target: The counter target passed to ``reset``.
        rng: Draws the step.
        config: The policy's exact-step probability and step range.
        exact: Step straight to the target (the policy's ``exact_step_prob`` is ignored).
    """
    env = IncrementEnv()
    messages: list[dict[str, Any]] = [{"role": "user", "content": env.reset(target=target)}]
    exact = exact or rng.random() < config.exact_step_prob
    step = target if exact else rng.randint(1, config.max_target)
    # The template puts a newline between content and the call: the call turn's block ends with one.
    think = config.empty_think_prob > 0 and rng.random() < config.empty_think_prob
    call = _tool_call("increment", {"step": step})
    opening = EMPTY_REASONING[:-1] if think else ""
    messages.append({"role": "assistant", "content": opening, "tool_calls": [call]})
    messages.append({"role": "tool", "name": "increment", "tool_call_id": CALL_ID, "content": str(env.increment(step))})
    answer = f"The counter is now {env.counter}."
    messages.append({"role": "assistant", "content": EMPTY_REASONING + answer if think else answer})
    return Transcript(messages, counter_tools(), success=env.get_reward() == 1.0)


def arithmetic_transcript(rng: random.Random, config: WarmStartConfig) -> Transcript:
    """One addition question, answered correctly unless the error draw says otherwise."""
    a, b = rng.randint(0, config.arithmetic_max), rng.randint(0, config.arithmetic_max)
    answer = a + b
    if rng.random() < config.arithmetic_error_rate:
        answer = max(0, answer + rng.choice((-2, -1, 1, 2)))
    messages = [
        {"role": "user", "content": arithmetic_prompt(a, b)},
        {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."},
    ]
    return Transcript(messages, None, success=answer == a + b)


def synthetic_transcripts(config: WarmStartConfig) -> list[Transcript]:
    """``config.transcripts_per_task`` transcripts per task, deterministic in ``config.seed``.

    With several tasks the list alternates between them every ``config.batch_size`` transcripts,
    so that read in order, each training batch holds one task (rows of similar length, little
    padding) and consecutive batches alternate (no task is forgotten for long).
    """
    rng = random.Random(config.seed)
    count = config.transcripts_per_task
    taught = config.restart_check_step * config.batch_size  # exact steps only: see WarmStartConfig
    per_task: list[list[Transcript]] = []
    for task in config.tasks:
        if task == "counter":
            per_task.append(
                [counter_transcript(rng.randint(1, config.max_target), rng, config, exact=i < taught)
                 for i in range(count)]
            )
        else:
            per_task.append([arithmetic_transcript(rng, config) for _ in range(count)])
    size = config.batch_size
    chunks = zip(*([group[i : i + size] for i in range(0, len(group), size)] for group in per_task), strict=True)
    return [t for chunk in chunks for batch in chunk for t in batch]


@dataclass
class WarmStartResult:
    """What the fine-tune did.

    Attributes:
        losses: Training loss at every logged step (every step) of the kept attempt, in order.
        seconds: Wall time of the fine-tune, loading and saving included.
        attempts: Initialisations trained (1 unless the counter fine-tune restarted).
        target_step_prob: The saved model's :func:`target_step_prob` (``None`` without the counter task).
    """

    losses: list[float]
    seconds: float
    attempts: int = 1
    target_step_prob: float | None = None


def _training_sample(tokenizer: PreTrainedTokenizerBase, transcript: Transcript) -> TrainingSample:
    """One transcript as a training sample: only assistant turns (content and EOS) are trained."""
    out = cast(BatchEncoding, tokenizer.apply_chat_template(  # return_dict=True: a BatchEncoding
        transcript.messages,
        tools=transcript.tools,  # type: ignore[arg-type]  # typed as an invariant list of dict-or-callable
        return_assistant_tokens_mask=True,
        return_dict=True,
    ))
    ids = list(out["input_ids"])
    mask = list(out["assistant_masks"])
    family = rollout_family(tokenizer.chat_template)
    if mask and mask[-1] and ids[-1] not in stop_token_ids(tokenizer, family):
        # The template leaves the final turn open (GLM's turns end on the next role's token): teach the stop.
        ids.append(tokenizer.get_vocab()[family.turn_end(False)])
        mask.append(1)
    sequence = TrainingSequence(input_ids=ids, loss_mask=mask, sampler_logprobs=[0.0] * len(ids))
    return TrainingSample(sequence=sequence, advantage=1.0, group_id=0, policy_version=0)


class _ProgressLines(TrainerCallback):
    """One line on stderr every tenth of the run: step, mean loss since the last line, elapsed time."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.started = time.perf_counter()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if "loss" in (logs := kwargs.get("logs") or {}):
            self.losses.append(float(logs["loss"]))
        if state.global_step % max(1, state.max_steps // 10) == 0 and self.losses:
            loss, elapsed = sum(self.losses) / len(self.losses), time.perf_counter() - self.started
            step = f"{state.global_step}/{state.max_steps}"
            print(f"warm start: step {step}, loss {loss:.3f}, {elapsed:.0f} s", file=sys.stderr)
            self.losses.clear()


_DIGITS = frozenset("0123456789")


class _TreePackedTrainer(Trainer):
    """A ``Trainer`` whose batch is one tree-packed row (:mod:`trainer.training.packing`).

    The transcripts of a counter batch share their first ~170 tokens (system prompt, tool schema,
    ``Increment the counter to``): packed as a prefix trie, those are forwarded once per batch
    instead of once per transcript, and nothing is padded; the loss is unchanged.

    Args:
        digit_ids: The tokenizer's digit tokens, whose loss is weighted by ``digit_weight``.
        digit_weight: See :class:`WarmStartConfig`.
    """

    def __init__(self, *args: Any, digit_ids: torch.Tensor, digit_weight: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.digit_ids, self.digit_weight = digit_ids, digit_weight

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, Any]]:
        row = inputs["row"]
        logp = forward_packed(model, row, temperature=1.0).logp  # (T,) trained tokens of the batch
        weight = torch.where(torch.isin(row.target_ids, self.digit_ids), self.digit_weight, 1.0)
        loss = -(weight * logp).sum() / weight.sum()  # weighted negative log-likelihood per assistant token
        return (loss, {}) if return_outputs else loss


def target_step_prob(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_target: int) -> float:
    """Mean probability the model gives the step that reaches the target, over targets ``1..max_target``.

    Teacher-forced on the counter conversation: the prompt, then the call up to its ``step``
    argument. ``1 / max_target`` is a model that has not learned to read the target.
    """
    samples = []
    for target in range(1, max_target + 1):
        env = IncrementEnv()
        messages: list[dict[str, Any]] = [{"role": "user", "content": env.reset(target=target)},
                    {"role": "assistant", "content": "", "tool_calls": [_tool_call("increment", {"step": target})]}]
        sample = _training_sample(tokenizer, Transcript(messages, counter_tools(), success=True))
        ids, mask = sample.sequence.input_ids, sample.sequence.loss_mask
        step_at = next(i for i, (t, m) in enumerate(zip(ids, mask, strict=True))
                       if m and tokenizer.decode([t]) == str(target))
        sample.sequence.loss_mask = [int(i == step_at) for i in range(len(ids))]
        samples.append(sample)
    with torch.no_grad():
        logp = forward_packed(model, build_row(samples), temperature=1.0).logp
    return float(logp.exp().mean())


class _RestartCheck(TrainerCallback):
    """Stops the run at ``step`` when the model still steps to the target only by chance."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: WarmStartConfig) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.stuck = False

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.global_step != self.config.restart_check_step:
            return
        prob = target_step_prob(kwargs["model"], self.tokenizer, self.config.max_target)
        self.stuck = prob < 1.25 / self.config.max_target
        if self.stuck:
            print(f"warm start: step {state.global_step}, target step probability {prob:.3f} "
                  "(chance): restarting from a fresh initialisation", file=sys.stderr)
            control.should_training_stop = True


def warm_start(model_dir: str | Path, config: WarmStartConfig | None = None) -> WarmStartResult:
    """Fine-tune the model in ``model_dir`` on synthetic transcripts and save it back in place.

    Deterministic given ``config.seed`` on one machine (CPU, no data-loader workers).

    Args:
        model_dir: A directory written by :func:`toolgym.kit.tiny_model.build_tiny_model` (any causal
            LM with a chat template that marks assistant turns with ``{% generation %}`` works).
        config: Transcripts and schedule. The defaults use one thread: both tasks took 3 min of
            CPU time here (5 min of wall time on a machine shared with other jobs).

    Returns:
        The per-step losses, the wall time, the initialisations tried and the counter's target step
        probability.
    """
    config = config or WarmStartConfig()
    started = time.perf_counter()
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    transcripts = synthetic_transcripts(config)
    check = "counter" in config.tasks and config.restart_check_step < config.max_steps
    attempts = config.max_attempts if check else 1
    for attempt in range(1, attempts + 1):
        if attempt > 1:  # a fresh initialisation, deterministic in the seed and the attempt
            torch.manual_seed(config.seed * 1000 + attempt)
            fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
            fresh.generation_config = model.generation_config
            model = fresh
        restart = _RestartCheck(tokenizer, config) if check and attempt < attempts else None
        trainer = _fine_tune(model, tokenizer, transcripts, config, restart)
        if restart is None or not restart.stuck:
            break
    prob = target_step_prob(model, tokenizer, config.max_target) if "counter" in config.tasks else None
    if check and prob is not None and prob < 1.25 / config.max_target:
        print(f"warning: warm start kept a model that steps to the target with probability {prob:.3f} "
              f"(chance: {1 / config.max_target:.3f}) after {attempts} initialisations", file=sys.stderr)
    model.set_attn_implementation("sdpa")  # the saved model is an ordinary causal LM again
    model.save_pretrained(model_dir)
    losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    return WarmStartResult(losses=losses, seconds=time.perf_counter() - started, attempts=attempt,
                           target_step_prob=prob)


def fine_tune(model_dir: str | Path, transcripts: list[Transcript],
              config: WarmStartConfig | None = None) -> list[float]:
    """Fine-tune the model in ``model_dir`` on ``transcripts`` of your own and save it back in place.

    Runs ``config.max_steps`` steps of ``config.batch_size`` transcripts (read in order, cycling), with
    the warm start's schedule and no restart check.

    Returns:
        The training loss at every step.
    """
    config = config or WarmStartConfig()
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = _fine_tune(model, tokenizer, transcripts, config, None)
    model.set_attn_implementation("sdpa")
    model.save_pretrained(model_dir)
    return [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


def _fine_tune(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, transcripts: list[Transcript],
               config: WarmStartConfig, restart: _RestartCheck | None) -> Trainer:
    """One supervised run over ``transcripts`` (tree-packed batches, attention set up and restored)."""
    enable_tree_attention(model)
    with tempfile.TemporaryDirectory(prefix="toolgym-warm-start-") as scratch:
        args = TrainingArguments(
            output_dir=scratch,
            max_steps=config.max_steps,
            per_device_train_batch_size=config.batch_size,
            learning_rate=config.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, config.max_steps // 20),
            weight_decay=0.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=config.seed,
            data_seed=config.seed,
            use_cpu=True,
            train_sampling_strategy="sequential",  # one task per batch, alternating: see synthetic_transcripts
            disable_tqdm=True,
        )
        trainer = _TreePackedTrainer(
            model=model,
            args=args,
            train_dataset=transcripts,
            data_collator=lambda batch: {"row": build_row([_training_sample(tokenizer, t) for t in batch])},
            digit_ids=torch.tensor([id_ for token, id_ in tokenizer.get_vocab().items() if token in _DIGITS]),
            digit_weight=config.digit_weight,
        )
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(_ProgressLines())
        if restart is not None:
            trainer.add_callback(restart)
        with torch_threads(config.num_threads):
            trainer.train()
    return trainer


@dataclass
class EvalResult:
    """Sampled behaviour of a model on fresh episodes of one task.

    Attributes:
        task: The task evaluated.
        episodes: Number of episodes sampled.
        format_rate: Fraction of episodes whose every turn ended with EOS and whose tool calls all
            parsed and matched the tool's schema (counter: exactly ``increment(step=<int>)``), ending with
            a final answer; arithmetic: exactly one ``\\boxed{<int>}`` and no tool call.
        success_rate: Fraction of episodes that reached the goal (counter: reward 1.0;
            arithmetic: the boxed integer equals the sum).
    """

    task: str
    episodes: int
    format_rate: float
    success_rate: float


_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


def _generate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], temperature: float
) -> tuple[str, bool]:
    """One completion: its text as the rollout loop decodes it and whether it ended with a stop token."""
    # PreTrainedModel has no generate (the causal-LM classes mix GenerationMixin in): mypy sees nn.Module.__getattr__.
    output = model.generate(  # type: ignore[operator]
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=64,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
    )[0, len(prompt_ids) :].tolist()
    stops = stop_token_ids(tokenizer, rollout_family(tokenizer.chat_template))
    ended = next((i for i, t in enumerate(output) if t in stops), None)
    if ended is None:
        return completion_text(tokenizer, output, stops), False
    return completion_text(tokenizer, output[: ended + 1], stops), True


def _counter_episode(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: int, temperature: float, max_turns: int
) -> tuple[bool, bool]:
    """Play one counter episode against the real environment; returns (well formed, success)."""
    env, tools = IncrementEnv(), counter_tools()
    family = rollout_family(tokenizer.chat_template)
    messages: list[dict[str, Any]] = [{"role": "user", "content": env.reset(target=target)}]
    for _ in range(max_turns):
        text, ended = _generate(model, tokenizer, render_prompt_ids(tokenizer, messages, tools), temperature)
        _, calls = family.parse(text, tools)
        messages.append(build_assistant_message(text, family, tools))
        if not ended:
            return False, False
        if not calls:
            return True, env.get_reward() == 1.0
        for call in calls:
            args = call["arguments"]
            if "error" in call or call["name"] != "increment" or args is None or set(args) != {"step"}:
                return False, False
            if type(args["step"]) is not int:  # bool is an int too, and not a step
                return False, False
            messages.append(family.tool_message(call, str(env.increment(args["step"]))))
    return False, False


def _arithmetic_episode(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, a: int, b: int, temperature: float
) -> tuple[bool, bool]:
    """Ask one sum; returns (well formed, success)."""
    prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": arithmetic_prompt(a, b)}])
    text, ended = _generate(model, tokenizer, prompt, temperature)
    boxed = _BOXED.findall(text)
    well_formed = ended and len(boxed) == 1 and not rollout_family(tokenizer.chat_template).parse(text)[1]
    return well_formed, well_formed and int(boxed[0]) == a + b


def evaluate(
    model_dir: str | Path,
    task: str,
    episodes: int = 100,
    seed: int = 1234,
    temperature: float = 1.0,
    max_turns: int = 8,
    config: WarmStartConfig | None = None,
) -> EvalResult:
    """Sample ``episodes`` fresh episodes with transformers ``generate`` and score format and success.

    Args:
        model_dir: A saved model with its tokenizer.
        task: ``"counter"`` or ``"arithmetic"``.
        episodes: How many episodes to sample.
        seed: Seeds the episodes and the sampling.
        temperature: Sampling temperature (no top-k/top-p truncation).
        max_turns: Counter episodes that have not given a final answer after this many turns fail.
        config: Where targets and operands are drawn from (``max_target``, ``arithmetic_max``).
    """
    config = config or WarmStartConfig()
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    results = []
    with torch.inference_mode(), torch_threads(config.num_threads):
        for _ in range(episodes):
            if task == "counter":
                target = rng.randint(1, config.max_target)
                results.append(_counter_episode(model, tokenizer, target, temperature, max_turns))
            else:
                a, b = rng.randint(0, config.arithmetic_max), rng.randint(0, config.arithmetic_max)
                results.append(_arithmetic_episode(model, tokenizer, a, b, temperature))
    return EvalResult(
        task=task,
        episodes=episodes,
        format_rate=sum(f for f, _ in results) / episodes,
        success_rate=sum(s for _, s in results) / episodes,
    )
