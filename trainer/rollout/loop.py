"""``AsyncRolloutLoop``: generates and scores rollouts in the worker process; its hooks are the API.

Each prompt goes through, in order: :meth:`~AsyncRolloutLoop.filter_prompt` (generate for it?),
``num_generations`` x :meth:`~AsyncRolloutLoop.run_rollout` (a whole rollout; the default is
:meth:`~AsyncRolloutLoop.generate_one`, a multi-turn tool loop calling
:meth:`~AsyncRolloutLoop.generate_one_turn` per sampling request), then the group is scored
(reward functions + environments' ``get_reward`` + ``Rollout.reward``) and
:meth:`~AsyncRolloutLoop.compute_advantages` runs once. The training samples go on the queue the
trainer drains. :meth:`~AsyncRolloutLoop.setup` / :meth:`~AsyncRolloutLoop.close` bracket the run
on the loop's event loop. Customise a run by subclassing and setting the trainer's ``loop_cls``;
the subclass must be importable (module level), as the loop is built in a spawned process. A hook
reads the run's settings in :attr:`~AsyncRolloutLoop.settings` (a
:class:`~trainer.rollout.settings.RolloutSettings`); settings of a subclass's own come as its
constructor's keyword arguments, from the trainer's ``rollout_loop_kwargs()``. A hook logs its own
metrics with :meth:`~AsyncRolloutLoop.log_metric` / :meth:`~AsyncRolloutLoop.log_rate`: they
reach the trainer's logs with the built-in ones.

What runs around the hooks lives beside this module: when groups start, their rollouts, scoring
and the queue in :mod:`trainer.rollout.scheduler`; the metrics' way to the trainer in
:mod:`trainer.rollout.telemetry`.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from sdk.tools import Tool
from trainer.exceptions import RolloutFailed, VLLMServerError
from trainer.metrics import RecordBuffer
from trainer.records import Rollout, RolloutGroup, TurnRecord, adapter_name
from trainer.rollout.chat_template import build_assistant_message, completion_text, rollout_family, stop_token_ids
from trainer.rollout.concurrency import AdaptiveCap
from trainer.rollout.env_pool import EnvironmentFactory, EnvironmentPool
from trainer.rollout.prompt_render import ConversationRenderer, splits_at_added_tokens
from trainer.rollout.scheduler import GroupScheduler, RolloutResult, group_version
from trainer.rollout.scoring import RewardFunc, RewardRunner, group_advantages
from trainer.rollout.servers import ServerFleet
from trainer.rollout.settings import RolloutSettings
from trainer.rollout.telemetry import LoopTelemetry
from trainer.rollout.tool_runner import ToolRunner, tools_from_functions
from trainer.rollout.worker import WorkerChannels, heartbeat, require_channels, wait_for_stop
from trainer.vllm.client import SamplingParams
from trainer.vllm.server_info import check_turn_length, truncates, turn_fits

__all__ = ["AsyncRolloutLoop"]


class AsyncRolloutLoop:
    """Generates and scores rollouts for :class:`~trainer.AsyncGRPOTrainer` in the rollout process.

    Args:
        settings: The run's settings (the trainer builds them from its config and the server).
        processing_class: The tokenizer (with its chat template); its EOS token ends a turn.
        channels: The IPC channels to the trainer; ``None`` outside the worker process (then only
            :meth:`evaluate` runs: :meth:`run` needs them).
        dataset: Training prompts (``None`` when the environment owns the data).
        reward_funcs: Reward functions (may be empty when environments score).
        tools: Functions exposed to the model as tools.
        environment_factory: Environment factory, or dict name -> factory.
        score_queue_maxsize: Finished groups waiting to be scored before generation blocks.
        dataset_start_index: Stream position to start from (resume).
        dataset_skip_positions: Positions past ``dataset_start_index`` already trained before the
            checkpoint being resumed (not generated again).
    """

    def __init__(
        self,
        settings: RolloutSettings,
        processing_class: PreTrainedTokenizerBase,
        channels: WorkerChannels | None = None,
        dataset: Any = None,
        reward_funcs: Sequence[RewardFunc] = (),
        tools: list[Callable[..., Any]] | None = None,
        environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None = None,
        score_queue_maxsize: int = 16,
        dataset_start_index: int = 0,
        dataset_skip_positions: Collection[int] = (),
    ) -> None:
        self.settings = settings
        self.tokenizer = processing_class
        # The family's stop tokens end a turn too (GPT-OSS's <|call|>, GLM's <|observation|>), beside EOS.
        self.eos_token_ids: list[int] = stop_token_ids(
            processing_class, rollout_family(settings.chat_template or processing_class.chat_template))
        self.channels = channels
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs)
        self.tools = tools_from_functions(tools)
        self.envs = EnvironmentPool(environment_factory)
        self.start_position = dataset_start_index
        self.skip_positions = frozenset(dataset_skip_positions)
        self.records = RecordBuffer()
        self.telemetry = LoopTelemetry(self.records, channels)
        self.executor = ThreadPoolExecutor(max_workers=settings.max_concurrent_rollouts, thread_name_prefix="tool")
        self.rewards = RewardRunner(self.reward_funcs, self.executor, settings.reward_timeout)
        # One server or several, each rollout routed to one (trainer.rollout.servers).
        self.sampler = ServerFleet(settings, self.records, channels.fleet if channels is not None else None)
        self.params = SamplingParams(
            max_tokens=settings.max_completion_length, temperature=settings.temperature, top_p=settings.top_p,
            top_k=settings.top_k, min_p=settings.min_p, logprobs=settings.num_sampler_logprobs,
            stop_token_ids=self.eos_token_ids, candidates=settings.candidates,
        )
        self._incremental_render: bool | None = None  # decided on the first rollout
        self.scheduler = GroupScheduler(self, score_queue_maxsize)

    @property
    def config(self) -> RolloutSettings:
        """Deprecated: the loop no longer gets the trainer's config; read :attr:`settings`."""
        warnings.warn("AsyncRolloutLoop.config is deprecated and will be removed in toolgym 0.2: read "
                      "self.settings (a RolloutSettings: the config fields the worker uses, same names); a config "
                      "field of your own reaches the loop as a constructor argument, from the trainer's "
                      "rollout_loop_kwargs()", FutureWarning, stacklevel=2)
        return self.settings

    @property
    def policy_version(self) -> int:
        """The newest policy version (new groups start under it); 0 outside the worker process."""
        return int(self.channels.policy_version.value) if self.channels is not None else 0

    # ----------------------------------------------------------------------------------- hooks
    def log_metric(self, name: str, value: float) -> None:
        """Log one value of a metric of your own from any hook (e.g. ``"curriculum/skipped_count"``).

        The value travels to the trainer with the worker's metrics (about once a second) and is
        logged with the next step, reduced over the logging window by the name's last part: a word
        ``count`` sums, ``max`` / ``min`` keep the extreme, anything else is averaged (so log a
        per-event value, not a running total). Use a prefix of your own to stay clear of built-in names.

        Args:
            name: The metric name, ``/``-separated.
            value: The observation.
        """
        self.records.add(name, value)

    def log_rate(self, name: str, numerator: float, denominator: float) -> None:
        """Log one observation of a ratio, logged as sum of numerators / sum of denominators.

        Use it for a fraction over events whose count varies (solved / attempted): the window's
        value weighs every event equally, and is NaN when no denominator was logged in it.

        Args:
            name: The metric name, ``/``-separated.
            numerator: This observation's share of the numerator.
            denominator: This observation's share of the denominator.
        """
        self.records.add_rate(name, numerator, denominator)

    async def setup(self) -> None:
        """Create resources the other hooks need (an HTTP client...). Runs before the first prompt."""

    async def close(self) -> None:
        """Release what :meth:`setup` created. Runs when the loop stops, also on error."""

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt; a rejected prompt counts as consumed. Default: all."""
        return True

    async def generate_one_turn(self, prompt_ids: list[int], params: SamplingParams | None = None) -> TurnRecord:
        """Sample one response to ``prompt_ids`` from the vLLM server with the run's sampling settings
        (or with ``params``, a caller's own limits: the harness endpoint's per-request ``max_tokens``).

        ``max_tokens`` is ``max_completion_length``. A prompt plus that over the server's
        ``max_model_len`` stops the run (:func:`~trainer.vllm.server_info.check_turn_length`); with
        top-k/top-p the turn is cut at ``max_model_len`` instead. An override that calls
        ``self.sampler.complete`` itself passes ``model=self.rollout_model()`` (the LoRA adapter of the
        rollout's policy version).
        """
        params = params or self.params
        room = check_turn_length(len(prompt_ids), params.max_tokens, self.settings.server.max_model_len,
                                 truncates(params.top_k, params.top_p, params.min_p))
        if room < params.max_tokens:
            params = SamplingParams(**{**params.__dict__, "max_tokens": room})
        try:
            return await self.sampler.complete(prompt_ids, params, model=self.rollout_model())
        except VLLMServerError as exc:
            lora_name = self.settings.lora_name
            if lora_name is None or "HTTP 404" not in exc.message:
                raise
            # The group's adapter was retired between rollout_model() and the request: the group is
            # more than max_staleness versions old, so the trainer drops it; finish on the newest.
            newest = adapter_name(lora_name, self.policy_version)
            return await self.sampler.complete(prompt_ids, params, model=newest)

    def _turn_fits(self, prompt_len: int) -> bool:
        """Whether a turn with this prompt fits the server's ``max_model_len`` (see :meth:`generate_one`)."""
        params = self.params
        return turn_fits(prompt_len, params.max_tokens, self.settings.server.max_model_len,
                         truncates(params.top_k, params.top_p, params.min_p))

    def rollout_model(self) -> str | None:
        """The ``model`` a request of the current rollout asks for: ``None`` (the base model) without
        adapter-only LoRA sync, else the adapter of the version the rollout started under (its server's),
        or the newest when that one is too stale to stay loaded (the trainer drops such a group)."""
        lora_name = self.settings.lora_name
        if lora_name is None:
            return None
        current = self.policy_version
        started = group_version()
        version = current if started is None or current - started > self.settings.max_staleness else started
        return adapter_name(lora_name, version)

    async def run_rollout(self, row: dict[str, Any], prompt: list[dict[str, Any]], tools: list[Tool], env: Any,
                          group_id: int = 0) -> Rollout:
        """One rollout once its slot and environment are held; the default runs :meth:`generate_one`.

        The seam for a loop whose rollouts are not its own turn loop (the harness loop runs a
        user's agent here). Raise :class:`RolloutFailed` to fail only this rollout.

        Args:
            row: The dataset row.
            prompt: The row's prompt with the environment's ``reset()`` text appended.
            tools: The trainer's tools and the environment's.
            env: The rollout's environment (``None`` without ``environment_factory``).
            group_id: The rollout's group.
        """
        if not prompt:
            raise RolloutFailed("the rollout has no prompt: the dataset row has no 'prompt' and reset() returned None")
        return await self.generate_one(prompt, tools, group_id=group_id)

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list[Tool], group_id: int = 0) -> Rollout:
        """One whole rollout: a multi-turn tool loop.

        Each turn renders the whole conversation with the chat template (tools as JSON schemas),
        samples with :meth:`generate_one_turn`, parses the tool calls and runs them in emitted order,
        until a turn calls no tool, ``max_tool_calling_iterations`` is reached, or the conversation has
        grown past what the server can continue (a later turn's prompt plus ``max_completion_length``
        over its ``max_model_len``: the rollout ends before that turn, ``rollout/context_full_frac``;
        a first turn that does not fit stops the run, as :meth:`generate_one_turn` says). Only the text a turn
        added is tokenized again (:class:`~trainer.rollout.prompt_render.ConversationRenderer`; the ids are
        those of a full render).
        """
        messages = list(prompt)
        schemas = [t.schema for t in tools] or None
        template = self.settings.chat_template
        if self._incremental_render is None:
            self._incremental_render = splits_at_added_tokens(
                self.tokenizer, schemas, template, **self.settings.chat_template_kwargs)
        render = ConversationRenderer(self.tokenizer, schemas, template, self._incremental_render,
                                      **self.settings.chat_template_kwargs)
        runner = ToolRunner(tools, self.executor, self.settings.env_call_timeout)
        family = rollout_family(template or self.tokenizer.chat_template)  # its call syntax
        turns: list[TurnRecord] = []
        completion: list[dict[str, Any]] = []
        calls = failures = iterations = 0
        exhausted = context_full = False
        while True:
            prompt_ids = render(messages)
            if turns and not self._turn_fits(len(prompt_ids)):
                context_full = True
                break
            turn = await self.generate_one_turn(prompt_ids)
            turns.append(turn)
            text = completion_text(self.tokenizer, turn.output_ids, self.eos_token_ids)
            message = build_assistant_message(text, family, schemas)
            messages.append(message)
            completion.append(message)
            _, parsed = family.parse(text, schemas) if tools else ("", [])
            if tools:  # call markup that is no call (a stray closing marker): counted, not run, not penalised
                self.records.add_rate("tools/malformed_frequency", family.malformed(text), 1)
            if not parsed or not turn.output_ids:
                break
            limit = self.settings.max_tool_calling_iterations
            if limit is not None and iterations >= limit:
                exhausted = True
                break
            iterations += 1
            self.records.add("tools/parallel_calls_mean", len(parsed))
            for call in parsed:
                outcome = await runner.run(call)
                calls += 1
                failures += outcome.failed
                self.telemetry.record_tool_call(outcome)
                tool_message = family.tool_message(call, outcome.content)
                messages.append(tool_message)
                completion.append(tool_message)
        self.records.add("rollout/context_full_frac", float(context_full))
        if tools:  # the tool metrics exist only when the model was shown tools
            self.records.add("tools/loop_exhausted_frac", float(exhausted))
            self.records.add("tools/call_frequency", calls)
            self.records.add_rate("tools/failure_frequency", 0, 0)  # NaN in a window without calls
        completion_ids = [t for turn in turns for t in turn.output_ids]
        return Rollout(completion=completion, completion_ids=completion_ids, turns=turns,
                       tool_call_count=calls, tool_failure_count=failures)

    async def evaluate(self, rows: list[dict[str, Any]], samples_per_row: int,
                       concurrency: int) -> list[RolloutResult]:
        """Rollouts outside training (held-out evaluation): nothing is scored, queued or trained.

        Runs ``samples_per_row`` rollouts of each row with at most ``concurrency`` in flight, each as a
        training rollout would run (environment, tools, turn loop), then releases the loop's sampler
        client, environments and thread pool: the loop is spent afterwards.

        Returns:
            Per rollout: its prompt, the :class:`Rollout`, and the environment's ``(source, reward)``
            (``None`` without an environment or a ``get_reward``).
        """
        self.scheduler.cap = AdaptiveCap(concurrency, None, self.settings.server.max_model_len)
        try:
            jobs = [self.scheduler.one_rollout(row, i) for i, row in enumerate(rows) for _ in range(samples_per_row)]
            return list(await asyncio.gather(*jobs))
        finally:
            await self.sampler.close()
            await self.envs.aclose()
            self.executor.shutdown(wait=False)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards normalised within the group (NaN rewards get 0)."""
        assert group.rewards is not None
        return group_advantages(group.rewards)

    # ------------------------------------------------------------------------------ the run
    async def run(self) -> None:
        """Generate until the trainer sets the stop event (or a failure raises): the worker process's work.

        Raises:
            RolloutWorkerError: The loop has no channels (it runs outside the worker process), or it failed.
        """
        channels = require_channels(self.channels)
        await self.setup()
        try:
            await self.sampler.wait_ready(self.settings.vllm_server_timeout)
            scheduler = self.scheduler
            await scheduler.run(channels, wait_for_stop(channels), heartbeat(channels),
                                self.telemetry.flush_forever(self.sampler, scheduler.cap, scheduler.score_queue),
                                *self.sampler.background())
        finally:
            await self.envs.aclose()
            await self.sampler.close()
            await self.close()
            self.executor.shutdown(wait=False, cancel_futures=True)
