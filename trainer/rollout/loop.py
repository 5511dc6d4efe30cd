"""``AsyncRolloutLoop``: generates and scores rollouts in the worker process.

Each prompt goes through, in order: :meth:`~AsyncRolloutLoop.filter_prompt` (generate for it?),
``num_generations`` x :meth:`~AsyncRolloutLoop.generate_one` (a whole rollout; the default is a
multi-turn tool loop calling :meth:`~AsyncRolloutLoop.generate_one_turn` per sampling request),
then the group is scored (reward functions + environments' ``get_reward`` + ``Rollout.reward``)
and :meth:`~AsyncRolloutLoop.compute_advantages` runs once. The training samples go on the queue
the trainer drains. :meth:`~AsyncRolloutLoop.setup` / :meth:`~AsyncRolloutLoop.close` bracket the
run on the loop's event loop. Customise a run by subclassing and setting the trainer's
``loop_cls``; the subclass must be importable (module level), as the loop is built in a spawned
process. A hook logs its own metrics with :meth:`~AsyncRolloutLoop.log_metric` /
:meth:`~AsyncRolloutLoop.log_rate`: they reach the trainer's logs with the built-in ones.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import multiprocessing
import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from sdk.exceptions import ServerDrainingError, ServerUnavailableError, SessionLostError, ToolgymError
from sdk.tools import Tool, environment_tools
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import RolloutFailed, RolloutWorkerError, TrainerError, VLLMServerError
from trainer.metrics import RecordBuffer
from trainer.records import (
    QueuedGroup,
    Rollout,
    RolloutGroup,
    TrainingSample,
    TurnRecord,
    adapter_name,
)
from trainer.rollout.chat_template import build_assistant_message, completion_text, rollout_family
from trainer.rollout.concurrency import AdaptiveCap, TokenAllowance
from trainer.rollout.env_pool import EnvironmentPool
from trainer.rollout.prompt_order import PromptRow, is_stream, map_style_rows, stream_rows
from trainer.rollout.prompt_render import ConversationRenderer, splits_at_added_tokens
from trainer.rollout.reconcile import reconcile_turns
from trainer.rollout.scoring import (
    RewardRunner,
    group_advantages,
    is_degenerate,
    reward_func_name,
    sum_rewards,
)
from trainer.rollout.stats import group_stds, record_group_metrics, record_rollout_metrics
from trainer.rollout.tool_runner import (
    ToolRunner,
    call_maybe_async,
    tools_from_functions,
)
from trainer.rollout.worker import WorkerChannels
from trainer.vllm.client import SamplerClient, SamplingParams
from trainer.vllm.server_info import CandidatePath, check_turn_length, truncates

logger = logging.getLogger(__name__)

LOAD_POLL_S = 5.0
HEARTBEAT_S = 1.0
METRICS_FLUSH_S = 1.0
# The policy version a group started under, seen by its rollouts' requests (asyncio tasks copy it).
_GROUP_VERSION: contextvars.ContextVar[int | None] = contextvars.ContextVar("toolgym_group_version", default=None)
FAILING_ROLLOUTS_LIMIT = 32  # consecutive failed rollouts (none succeeding) before the run stops
ENV_RETRIES = 2  # restarts of a rollout on another environment after its env server or session was lost
# The env server or the session went away mid-episode: the rollout starts over on another instance.
_ENVIRONMENT_LOST = (ServerUnavailableError, SessionLostError, ServerDrainingError)


class AsyncRolloutLoop:
    """Generates and scores rollouts for :class:`~trainer.AsyncGRPOTrainer` in the rollout process.

    Args:
        config: The trainer config (a subclass may carry its own fields).
        model_name: The model name the vLLM server serves.
        dataset: Training prompts (``None`` when the environment owns the data).
        reward_funcs: Reward functions (may be empty when environments score).
        processing_class: The tokenizer (with its chat template).
        eos_token_ids: Token ids that end a turn.
        channels: The IPC channels to the trainer.
        tools: Functions exposed to the model as tools.
        environment_factory: Environment factory, or dict name -> factory.
        score_queue_maxsize: Finished groups waiting to be scored before generation blocks.
        dataset_start_index: Stream position to start from (resume).
        dataset_skip_positions: Positions past ``dataset_start_index`` already trained before the
            checkpoint being resumed (not generated again).
        max_model_len: The server's ``max_model_len`` (discovered by the trainer).
        kv_cache_tokens: The server's KV-cache capacity, ``None`` when unknown.
        chat_template: The template :meth:`generate_one` renders with instead of the tokenizer's own
            (the training template the trainer chose at start, see :mod:`trainer.rollout.training_templates`).
        lora_name: With adapter-only LoRA sync, the prefix of the adapters' names: each request
            asks for the adapter of the policy version its group started under
            (:meth:`rollout_model`). ``None``: the base model's name.
        served_model: The name the server serves the trainer's model under (requests name it);
            ``None``: requests name none, and vLLM serves its base model.
        candidates: How each sampled token's top-k/top-p candidate set is read from the server, as
            chosen at start (:func:`trainer.vllm.server_info.candidate_path`); ``None``: not at all.
    """

    def __init__(
        self,
        config: AsyncGRPOConfig,
        model_name: str,
        dataset: Any,
        reward_funcs: list[Any],
        processing_class: Any,
        eos_token_ids: list[int],
        channels: WorkerChannels,
        tools: list[Any] | None = None,
        environment_factory: Any = None,
        score_queue_maxsize: int = 16,
        dataset_start_index: int = 0,
        dataset_skip_positions: Collection[int] = (),
        max_model_len: int = 2048,
        kv_cache_tokens: int | None = None,
        chat_template: str | None = None,
        lora_name: str | None = None,
        served_model: str | None = None,
        candidates: CandidatePath | None = None,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs)
        self.tokenizer = processing_class
        self.eos_token_ids = list(eos_token_ids)
        self.channels = channels
        self.tools = tools_from_functions(tools)
        self.envs = EnvironmentPool(environment_factory)
        self.score_queue_maxsize = score_queue_maxsize
        self.start_position = dataset_start_index
        self.skip_positions = frozenset(dataset_skip_positions)
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens
        # A JSON string from the command line is a dict by now (AsyncGRPOConfig.__post_init__).
        self.chat_template_kwargs = dict(cast("dict[str, Any] | None", config.chat_template_kwargs) or {})
        self.chat_template = chat_template
        self.lora_name = lora_name
        self._incremental_render: bool | None = None  # decided on the first rollout
        self.records = RecordBuffer()
        self.executor = ThreadPoolExecutor(max_workers=config.max_concurrent_rollouts, thread_name_prefix="tool")
        self.rewards = RewardRunner(self.reward_funcs, self.executor, config.reward_timeout)
        self.sampler = SamplerClient(config.vllm_server_base_url, max_connections=config.max_concurrent_rollouts,
                                     timeout_s=config.vllm_server_timeout, seed=config.seed)
        self.sampler.model = served_model
        self.params = SamplingParams(
            max_tokens=config.max_completion_length, temperature=config.temperature, top_p=config.top_p,
            top_k=config.top_k, min_p=config.min_p, logprobs=config.num_sampler_logprobs,
            stop_token_ids=self.eos_token_ids, candidates=candidates,
        )
        self._failed_in_a_row = 0
        self._generated_tokens = 0
        self._groups_started = 0  # group_id: groups counted from 0

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
        """Sample one response to ``prompt_ids`` from the vLLM server with the config's settings
        (or with ``params``, a caller's own limits: the harness endpoint's per-request ``max_tokens``).

        ``max_tokens`` is ``max_completion_length``. A prompt plus that over the server's
        ``max_model_len`` stops the run (:func:`~trainer.vllm.server_info.check_turn_length`); with
        top-k/top-p the turn is cut at ``max_model_len`` instead. An override that calls
        ``self.sampler.complete`` itself passes ``model=self.rollout_model()`` (the LoRA adapter of the
        rollout's policy version).
        """
        params = params or self.params
        room = check_turn_length(len(prompt_ids), params.max_tokens, self.max_model_len,
                                 truncates(params.top_k, params.top_p, params.min_p))
        if room < params.max_tokens:
            params = SamplingParams(**{**params.__dict__, "max_tokens": room})
        try:
            return await self.sampler.complete(prompt_ids, params, model=self.rollout_model())
        except VLLMServerError as exc:
            if self.lora_name is None or "HTTP 404" not in exc.message:
                raise
            # The group's adapter was retired between rollout_model() and the request: the group is
            # more than max_staleness versions old, so the trainer drops it; finish on the newest.
            newest = adapter_name(self.lora_name, int(self.channels.model_version.value))
            return await self.sampler.complete(prompt_ids, params, model=newest)

    def rollout_model(self) -> str | None:
        """The ``model`` a request of the current rollout asks for: ``None`` (the base model) without
        adapter-only LoRA sync, else the adapter of the version the rollout's group started under, or
        the newest when that one is too stale to stay loaded (the trainer drops such a group)."""
        if self.lora_name is None:
            return None
        current = int(self.channels.model_version.value)
        started = _GROUP_VERSION.get()
        version = current if started is None or current - started > self.config.max_staleness else started
        return adapter_name(self.lora_name, version)

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
        until a turn calls no tool or ``max_tool_calling_iterations`` is reached. Only the text a turn
        added is tokenized again (:class:`~trainer.rollout.prompt_render.ConversationRenderer`; the ids are
        those of a full render).
        """
        messages = list(prompt)
        schemas = [t.schema for t in tools] or None
        if self._incremental_render is None:
            self._incremental_render = splits_at_added_tokens(
                self.tokenizer, schemas, self.chat_template, **self.chat_template_kwargs)
        render = ConversationRenderer(self.tokenizer, schemas, self.chat_template, self._incremental_render,
                                      **self.chat_template_kwargs)
        runner = ToolRunner(tools, self.executor)
        family = rollout_family(self.chat_template or self.tokenizer.chat_template)  # its call syntax
        turns: list[TurnRecord] = []
        completion: list[dict[str, Any]] = []
        calls = failures = iterations = 0
        exhausted = False
        while True:
            prompt_ids = render(messages)
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
            limit = self.config.max_tool_calling_iterations
            if limit is not None and iterations >= limit:
                exhausted = True
                break
            iterations += 1
            self.records.add("tools/parallel_calls_mean", len(parsed))
            for call in parsed:
                outcome = await runner.run(call)
                calls += 1
                failures += outcome.failed
                self._record_tool_call(outcome)
                tool_message = family.tool_message(call, outcome.content)
                messages.append(tool_message)
                completion.append(tool_message)
        if tools:  # the tool metrics exist only when the model was shown tools
            self.records.add("tools/loop_exhausted_frac", float(exhausted))
            self.records.add("tools/call_frequency", calls)
            self.records.add_rate("tools/failure_frequency", 0, 0)  # NaN in a window without calls
        completion_ids = [t for turn in turns for t in turn.output_ids]
        return Rollout(completion=completion, completion_ids=completion_ids, turns=turns,
                       tool_call_count=calls, tool_failure_count=failures)

    async def evaluate(self, rows: list[dict[str, Any]], samples_per_row: int,
                       concurrency: int) -> list[tuple[list[dict[str, Any]], Rollout, Any]]:
        """Rollouts outside training (held-out evaluation): nothing is scored, queued or trained.

        Runs ``samples_per_row`` rollouts of each row with at most ``concurrency`` in flight, each as a
        training rollout would run (environment, tools, turn loop), then releases the loop's sampler
        client, environments and thread pool: the loop is spent afterwards.

        Returns:
            Per rollout: its prompt, the :class:`Rollout`, and the environment's ``(source, reward)``
            (``None`` without an environment or a ``get_reward``).
        """
        self.cap = AdaptiveCap(concurrency, None, self.max_model_len)
        try:
            jobs = [self._one_rollout(row, i) for i, row in enumerate(rows) for _ in range(samples_per_row)]
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
        """Generate until the trainer sets the stop event (or a failure raises)."""
        await self.setup()
        background: list[asyncio.Task[None]] = []
        self._groups: set[asyncio.Task[None]] = set()
        try:
            await self.sampler.wait_ready(self.config.vllm_server_timeout)
            self.cap = AdaptiveCap(self.config.max_concurrent_rollouts, self.kv_cache_tokens, self.max_model_len)
            self.allowance = TokenAllowance()
            self.score_queue: asyncio.Queue[tuple[RolloutGroup, list[Rollout], int]] = asyncio.Queue(
                self.score_queue_maxsize)
            background = [asyncio.create_task(c) for c in (
                self._heartbeat(), self._poll_load(), self._flush_metrics(), self._score_forever())]
            self._group_failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            producer = asyncio.create_task(self._produce())
            stop = asyncio.create_task(self._wait_stop())
            done, _ = await asyncio.wait([producer, stop, self._group_failure, *background],
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            producer.cancel()
            stop.cancel()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            # Groups still in flight are abandoned (the trainer stopped): cancel them before their
            # environments close under them, which would report every one as a failed rollout.
            for task in self._groups:
                task.cancel()
            await asyncio.gather(*self._groups, return_exceptions=True)
            await self.envs.aclose()
            await self.sampler.close()
            await self.close()
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def _wait_stop(self) -> None:
        trainer = multiprocessing.parent_process()  # None when the loop runs in the trainer's process (tests)
        while not self.channels.stop.is_set():
            if trainer is not None and not trainer.is_alive():
                logger.warning("the trainer process is gone (killed?): the rollout worker stops")
                # No one reads the queues any more: exiting must not wait to flush them (their
                # feeder threads block on full pipes).
                for q in (self.channels.rollout_buffer, self.channels.metrics_queue, self.channels.exception_queue):
                    q.cancel_join_thread()
                return
            await asyncio.sleep(0.1)

    async def _heartbeat(self) -> None:
        while True:
            self.channels.heartbeat.value = time.time()
            await asyncio.sleep(HEARTBEAT_S)

    async def _poll_load(self) -> None:
        last_preemptions: float | None = None
        while True:
            load = await self.sampler.load()
            await self.cap.observe(load)
            self.records.add("rollout/concurrency_cap", self.cap.limit)
            if load is not None:
                self.records.add("rollout/vllm_kv_cache_usage_frac", load.kv_cache_usage)
                self.records.add("rollout/vllm_running_requests", load.running)
                self.records.add("rollout/vllm_queued_requests", load.waiting)
                if last_preemptions is not None:
                    self.records.add("rollout/vllm_preemption_count", max(load.preemptions - last_preemptions, 0))
                last_preemptions = load.preemptions
            await asyncio.sleep(LOAD_POLL_S)

    async def _flush_metrics(self) -> None:
        retries_sent = 0
        tokens_sent, t_last = 0, time.monotonic()
        while True:
            await asyncio.sleep(METRICS_FLUSH_S)
            now = time.monotonic()
            self.records.add("rollout/vllm_retry_count", self.sampler.retry_count - retries_sent)
            retries_sent = self.sampler.retry_count
            self.records.add_rate("rollout/generated_tokens_per_s", self._generated_tokens - tokens_sent, now - t_last)
            tokens_sent, t_last = self._generated_tokens, now
            self.records.add("rollout/score_queue_size", self.score_queue.qsize())
            self.records.add("rollout/concurrency", self.cap.take_mean_in_flight())
            self._send_records()

    def _put_group(self, queued: QueuedGroup) -> None:
        """Send a group to the trainer with the metric records logged since the last one (its reward
        metrics, a curriculum's skip counts...): the step that receives it logs them."""
        queued.records = self.records.take()
        self.channels.queued_samples.value += len(queued.samples)
        self.channels.rollout_buffer.put(queued)

    def _send_records(self) -> None:
        batch = self.records.take()
        if batch:
            self.channels.metrics_queue.put(batch)

    # --------------------------------------------------------------------------- producing
    def _prompt_stream(self) -> Iterator[PromptRow]:
        """Yields (position, row_index, row, epoch) from ``start_position`` on, forever
        (:mod:`trainer.rollout.prompt_order`; a stream always from its first prompt)."""
        if self.dataset is None:
            return ((position, position, {}, 0) for position in itertools.count(self.start_position))
        if is_stream(self.dataset):
            return stream_rows(self.dataset, self._report_epoch_size)
        return map_style_rows(self.dataset, self.config.seed, self.start_position)

    def _report_epoch_size(self, size: int) -> None:
        self.channels.epoch_size.value = size

    async def _produce(self) -> None:
        rejected_in_a_row = 0
        for position, row_index, row, epoch in self._prompt_stream():
            if position in self.skip_positions:
                continue  # trained before the checkpoint this run resumed from
            if not self.filter_prompt(row_index, row, epoch):
                rejected_in_a_row += 1
                size = self.channels.epoch_size.value  # known at start, or after a stream's first pass
                if size > 0 and rejected_in_a_row >= size:
                    raise RolloutWorkerError("filter_prompt rejected every prompt of a whole epoch: "
                                             "no batch can ever reach the trainer")
                self._put_group(QueuedGroup(position, row_index))
                continue
            rejected_in_a_row = 0
            t0 = time.monotonic()
            waited = False
            channels = self.channels
            while not self.allowance.may_start(channels.token_allowance.value, channels.consumed_tokens.value):
                waited = True
                await asyncio.sleep(0.02)
            if waited:
                self.records.add("rollout/backpressure_s", time.monotonic() - t0)
            await self.cap.wait_for_room()
            self.cap.reserve(self.config.num_generations)
            self.allowance.started()
            task = asyncio.create_task(self._run_group(position, row_index, row))
            self._groups.add(task)
            task.add_done_callback(self._group_done)
            task.add_done_callback(self._groups.discard)
            await asyncio.sleep(0)

    def _group_done(self, task: asyncio.Task[None]) -> None:
        """A group task ended: its failure (the server is gone, a hook raised...) stops the run."""
        if not task.cancelled() and task.exception() is not None and not self._group_failure.done():
            self._group_failure.set_exception(task.exception())  # type: ignore[arg-type]

    async def _run_group(self, position: int, row_index: int, row: dict[str, Any]) -> None:
        version = int(self.channels.model_version.value)
        _GROUP_VERSION.set(version)  # this task's context, copied into its rollouts' tasks
        group_id, self._groups_started = self._groups_started, self._groups_started + 1
        results = await asyncio.gather(*(self._one_rollout(row, group_id, reserved=True)
                                         for _ in range(self.config.num_generations)),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, RolloutFailed):
                raise r
        ok = [r for r in results if isinstance(r, tuple)]
        if not ok:
            self.allowance.finished(0, 0)
            self._put_group(QueuedGroup(position, row_index, policy_version=version))
            return
        prompts = [p for p, _, _ in ok]
        rollouts = [r for _, r, _ in ok]
        env_rewards = [e for _, _, e in ok]
        columns = {k: v for k, v in row.items() if k != "prompt"}  # reward functions get "environment" too
        sequences = []
        for rollout in rollouts:
            seqs, stats = reconcile_turns(rollout.turns)
            sequences.append(seqs)
            record_rollout_metrics(self.records, rollout, seqs, stats, self.eos_token_ids)
            self._generated_tokens += len(rollout.completion_ids)
        group = RolloutGroup(
            prompts=prompts, reward_kwargs={k: [v] * len(rollouts) for k, v in columns.items()},
            completions=[r.completion for r in rollouts], completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=sequences, tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts], model_version=version, group_id=group_id,
            row_index=row_index, env_rewards=env_rewards, rollout_rewards=[r.reward for r in rollouts],
            queued_at=time.monotonic(), truncated=[r.truncated(self.eos_token_ids) for r in rollouts],
        )
        t0 = time.monotonic()
        await self.score_queue.put((group, rollouts, position))
        self.records.add("rollout/score_block_s", time.monotonic() - t0)

    async def _one_rollout(self, row: dict[str, Any], group_id: int,
                           reserved: bool = False) -> tuple[list[dict[str, Any]], Rollout, Any]:
        """Acquire a slot (promised to this rollout's group when ``reserved``) and an environment, run
        :meth:`run_rollout`, score the environment.

        An env server or session lost mid-episode (the server died, was restarted, drains) starts
        the rollout over on another environment instance, whose ``reset`` opens a new session on a
        live replica (``rollout/env_retry_count``), at most ``ENV_RETRIES`` times; when no replica
        is reachable that ``reset`` raises ``ServerUnavailableError`` and the run stops.
        """
        await self.cap.acquire(reserved)
        t0 = time.monotonic()
        retries = 0
        try:
            while True:
                try:
                    result = await self._rollout_on_an_environment(row, group_id)
                except RolloutFailed as exc:
                    if not isinstance(exc.__cause__, _ENVIRONMENT_LOST) or retries == ENV_RETRIES:
                        self._rollout_failed(str(exc))
                        raise
                    retries += 1
                    logger.warning("rollout starts over on another environment: %s", exc)
                    self.records.add("rollout/env_retry_count", 1)
                    continue
                self._failed_in_a_row = 0
                return result
        finally:
            self.records.add("rollout/duration_s", time.monotonic() - t0)
            await self.cap.release()

    async def _rollout_on_an_environment(self, row: dict[str, Any],
                                         group_id: int) -> tuple[list[dict[str, Any]], Rollout, Any]:
        """One attempt: an environment from the pool (returned after success, dropped after failure)."""
        prompt = list(row.get("prompt") or [])
        tools = list(self.tools)
        if not self.envs.enabled:
            return prompt, await self.run_rollout(row, prompt, tools, None, group_id=group_id), None
        name = self.envs.resolve(row)
        env = self.envs.acquire(name)
        try:
            prompt = await self._reset_env(env, row, prompt)
            tools += environment_tools(env)
            try:
                rollout = await self.run_rollout(row, prompt, tools, env, group_id=group_id)
                env_reward = await self._env_reward(env)
            except TrainerError:
                raise  # the sampler or the trainer failed, not the environment
            except ToolgymError as exc:  # the env server or its session failed, not the model
                raise RolloutFailed(f"environment {type(env).__name__}: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            self.envs.discard(env)  # its state is unknown: never handed to another rollout
            raise
        self.envs.release(name, env)
        return prompt, rollout, env_reward

    async def _reset_env(self, env: Any, row: dict[str, Any], prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", "environment")}
        t0 = time.monotonic()
        try:
            text = await call_maybe_async(env.reset, self.executor, **kwargs)
        except ServerUnavailableError:
            raise  # a new session found no env server (any replica) up: the run stops, naming them
        except Exception as exc:
            raise RolloutFailed(f"{type(env).__name__}.reset raised {type(exc).__name__}: {exc}") from exc
        self.records.add("env/reset_s", time.monotonic() - t0)
        if text is None:
            return prompt
        if prompt and prompt[-1].get("role") == "user":
            last = dict(prompt[-1])
            last["content"] = f"{last.get('content') or ''}{text}"
            return [*prompt[:-1], last]
        return [*prompt, {"role": "user", "content": str(text)}]

    async def _env_reward(self, env: Any) -> tuple[type, float] | None:
        get_reward = getattr(env, "get_reward", None)
        if get_reward is None:
            return None
        t0 = time.monotonic()
        value = await call_maybe_async(get_reward, self.executor)
        self.records.add("env/reward_s", time.monotonic() - t0)
        return None if value is None else (type(env), float(value))

    def _rollout_failed(self, message: str) -> None:
        logger.warning("rollout failed: %s", message)
        self._failed_in_a_row += 1
        self.records.add("rollout/failed_count", 1)
        if self._failed_in_a_row >= FAILING_ROLLOUTS_LIMIT:
            raise RolloutWorkerError(f"every rollout is failing ({self._failed_in_a_row} in a row, none "
                                     f"succeeded); the last error: {message}")

    def _record_tool_call(self, outcome: Any) -> None:
        name = outcome.name or "<unparsed>"
        self.records.add(f"tools/{name}/call_count", 1)
        self.records.add(f"tools/{name}/failure_count", int(outcome.failed))
        self.records.add("tools/unknown_name_count", int(outcome.unknown))
        self.records.add_rate("tools/failure_frequency", int(outcome.failed), 1)
        if not outcome.unknown:
            self.records.add("tools/latency_s", outcome.latency_s)
            self.records.add(f"tools/{name}/latency_s", outcome.latency_s)

    # ---------------------------------------------------------------------------- scoring
    async def _score_forever(self) -> None:
        while True:
            group, rollouts, position = await self.score_queue.get()
            self.records.add("rollout/score_wait_s", time.monotonic() - group.queued_at)
            t0 = time.monotonic()
            queued = self._score(group, await self.rewards(group), position, [r.rollout_id for r in rollouts])
            for name, count in self.rewards.take_timeouts().items():
                self.records.add(f"rewards/{name}/timeout_count", count)
            self.records.add("rollout/score_s", time.monotonic() - t0)
            total_tokens = sum(len(s.input_ids) for seqs in group.completions_sequences for s in seqs)
            self.allowance.finished(queued.tokens, total_tokens)
            self._put_group(queued)

    def _score(self, group: RolloutGroup, func_rewards: list[list[float | None]], position: int,
               rollout_ids: list[str] | None = None) -> QueuedGroup:
        n = len(group.completions)
        sources: dict[str, list[float | None]] = {
            reward_func_name(f): values for f, values in zip(self.reward_funcs, func_rewards, strict=True)}
        env_names = {e[0].__name__ for e in group.env_rewards if e is not None}
        for env_name in env_names:
            sources[env_name] = [e[1] if e is not None and e[0].__name__ == env_name else None
                                 for e in group.env_rewards]
        if any(r is not None for r in group.rollout_rewards):
            sources["rollout"] = list(group.rollout_rewards)
        group.rewards = sum_rewards(list(sources.values()), n)
        trained_rewards = group.rewards
        if self.config.mask_truncated_completions and any(group.truncated):
            # A masked rollout is not trained, so it is left out of the baseline too: the advantages
            # of the rollouts that are trained still sum to zero, and a prefix they all share gets
            # no net push either way.
            trained_rewards = np.where(np.asarray(group.truncated), np.nan, group.rewards)
        dropped = is_degenerate(trained_rewards)
        record_group_metrics(self.records, group, sources, dropped)  # every rollout's reward, truncated or not
        group.rewards = trained_rewards
        queued = QueuedGroup(position, group.row_index, policy_version=group.model_version)
        # The hook runs for every group, a dropped one too (a curriculum tracks solved prompts there);
        # dropping is decided on the rewards above, not on what it returns.
        advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
        if advantages.shape != (n,):
            raise ValueError(f"compute_advantages returned shape {advantages.shape}, expected ({n},)")
        if dropped:
            return queued
        std, func_stds = group_stds(sources, trained_rewards)
        now = time.time()
        for i, seqs in enumerate(group.completions_sequences):
            if self.config.mask_truncated_completions and group.truncated[i]:
                continue  # masked: out of the baseline above, and out of the loss
            for seq in seqs:
                queued.samples.append(TrainingSample(
                    sequence=seq, advantage=float(advantages[i]), group_id=group.group_id,
                    policy_version=group.model_version, row_index=group.row_index,
                    reward=float(group.rewards[i]), queued_at=now,
                    rollout_id=rollout_ids[i] if rollout_ids else "", reward_group_std=std,
                    reward_func_group_stds=func_stds))
        queued.tokens = sum(s.num_tokens for s in queued.samples)
        return queued
