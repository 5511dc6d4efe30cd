"""``AsyncGRPOTrainer``: GRPO with generation decoupled from training.

A spawned rollout worker streams scored groups from a vLLM server while this process trains on
them; every ``weight_sync_steps`` optimizer steps the weights go to the server and the policy
version goes up by one. The class is a ``transformers.Trainer``: callbacks, ``report_to``,
checkpoints, optimizer and scheduler are the ecosystem's. What it changes: the data (micro-batches
of tree-packed rows from the rollout queue instead of a DataLoader), the step (packed forward,
chunked log-probs, the loss of docs/loss.md), logging (the pipeline's metrics), checkpoints (plus
``rollout_state.json``) and the stop condition (epochs count prompts actually trained).

Data flow: dataset -> rollout worker -> vLLM / env server -> queue -> packer -> loss -> weight sync
(see ``docs/architecture.md``).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import torch
from accelerate.utils import broadcast_object_list
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_utils import get_last_checkpoint

from trainer.checkpoint import ROLLOUT_STATE, StagedCheckpoints
from trainer.config import AsyncGRPOConfig
from trainer.construction_checks import check_construction, check_dataset, check_output_head, check_picklable
from trainer.exceptions import ConfigError, PipelineStalledError
from trainer.launch.for_run import launch_servers
from trainer.metrics import MetricWindow
from trainer.records import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from trainer.reporting import CompletionRecord, display_callbacks, report_completions
from trainer.rollout.concurrency import AllowanceRule, StalenessAllowance
from trainer.rollout.eval_in_training import (
    EpochEvaluation,
    EvalPlan,
    eval_rows,
    evaluate_outside_training,
    record_evaluation,
    request_evaluation,
)
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.prompt_order import is_stream
from trainer.rollout.settings import RolloutSettings
from trainer.rollout.tool_runner import tools_from_functions
from trainer.rollout.training_templates import rollout_chat_template
from trainer.rollout.worker import RolloutWorker, WorkerChannels, spawn_context
from trainer.step_callback import PipelineCallback
from trainer.sync.policy_sync import PolicySync
from trainer.training.batching import MicroBatch, MicroBatchStream
from trainer.training.compile import CompileTracker, RowBuckets, compile_decoder_layers, use_compiled_step
from trainer.training.compile_cache import use_compile_cache
from trainer.training.compile_warmup import CompileWarmUp, expected_lengths, grpo_step
from trainer.training.distributed import StepFeed, StepPayload, all_reduce_loss_stats
from trainer.training.flops import FlopModel, row_flops
from trainer.training.fsdp import enable_fsdp_on_cpu
from trainer.training.loss import LossConfig, loss_metrics, packed_grpo_loss, reduce_loss_stats
from trainer.training.model_loading import freeze_outside_language_model, load_model
from trainer.training.moe import RouterLogits, resolve_aux_loss_coef
from trainer.training.row_forward import forwarded_positions
from trainer.training.stall import StallReport, StallWatch
from trainer.training.step_guard import SpikeClip, StepGuard
from trainer.training.tree_attention import enable_tree_attention
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.fleet import FleetState
from trainer.vllm.server_info import ServerInfo, candidate_path, dtype_mismatch, read_server_info
from trainer.vllm.servers import read_servers, read_servers_info

__all__ = ["AsyncGRPOTrainer", "AsyncRolloutLoop", "Rollout", "RolloutGroup", "TrainingSequence", "TurnRecord"]

logger = logging.getLogger(__name__)


class AsyncGRPOTrainer(Trainer):
    """Asynchronous GRPO trainer (see the module docstring).

    Args:
        model: A model id or directory (loaded in ``args.dtype`` with ``AutoModelForCausalLM``, or
            ``AutoModelForImageTextToText`` for a vision-language config), or a ``PreTrainedModel``.
            Its attention is switched to tree attention (and Gated DeltaNet layers to their tree path)
            for packed training; of a vision-language model only the language model trains, on text
            (see :mod:`trainer.training.model_loading`).
        reward_funcs: A reward function or a list of them (sync or async, picklable); optional when
            environments score through ``get_reward``.
        args: The config; defaults to ``AsyncGRPOConfig(output_dir="<model>-AsyncGRPO")``.
        train_dataset: Conversational prompts (``prompt`` column) plus any columns the reward
            functions or environments read. ``None`` when the environment owns the data (then
            ``max_steps`` is required).
        eval_dataset: Evaluation rows, like ``train_dataset``'s (map-style or a stream), evaluated at
            ``eval_strategy`` / ``eval_steps`` / ``eval_on_start`` and by :meth:`evaluate`. ``None`` with an
            environment: seeded episodes of it (``eval_num_rows``).
        processing_class: The tokenizer; loaded from the model when ``None``. A missing pad token
            defaults to EOS.
        callbacks: Extra ``TrainerCallback``s.
        optimizers: ``(optimizer, scheduler)``; AdamW and the configured scheduler when ``None``.
        peft_config: A PEFT config to wrap the model with. Synced as merged weights, or as an adapter
            when the server runs ``--enable-lora`` (see :mod:`trainer.sync.lora_sync`).
        tools: Functions the model may call (type hints + Google docstrings; module level).
        environment_factory: A zero-argument callable making an environment, or a dict
            name -> callable routed by the dataset's ``environment`` column. With ``launch_envserver`` an
            environment class, hosted on an env server for the run (:mod:`trainer.launch.for_run`).
    """

    # Narrower than the base Trainer's declarations: this trainer always has all three.
    args: AsyncGRPOConfig
    model: torch.nn.Module
    processing_class: PreTrainedTokenizerBase
    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop
    _checkpoints: StagedCheckpoints | None = None  # made at the first save
    prompt_column_required: bool = True  # without an environment, the dataset must have a "prompt" column

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable[..., Any] | list[Callable[..., Any]] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: list[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
    ) -> None:
        model_id = str(model if isinstance(model, str) else model.config._name_or_path)
        args = self._checked_inputs(model_id, reward_funcs, args, train_dataset, eval_dataset, peft_config,
                                    environment_factory)
        model, processing_class = self._load(model, model_id, processing_class, args)
        # Checked at start: a template that is not prefix-preserving is replaced, for the rollouts, by a
        # shipped training template when it is of a known family, else a warning says turns will fork.
        template_kwargs = dict(cast("dict[str, Any] | None", args.chat_template_kwargs) or {})
        self.rollout_chat_template = rollout_chat_template(
            processing_class, [t.schema for t in tools_from_functions(tools)] or None,
            **template_kwargs) if tools or environment_factory else None
        model = self._prepare_model(model, args, peft_config)
        if self._compile_tracker is not None and args.world_size == 1 and args.packing == "tree":
            callbacks = [*(callbacks or []), self._compile_warm_up(model, args)]
        self.model_id = model_id
        self.reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs] if reward_funcs else []
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.rollout_dataset = train_dataset
        self._explicit_max_steps = args.max_steps > 0
        # The trainer's own copy of the config (the caller's stays as given, reusable) takes a launched server's
        # URL, the progress table's disable_tqdm and, when the epoch count stops the run, a cap on the steps.
        args = copy.copy(args)
        if not self._explicit_max_steps:
            args.max_steps = 10**9
        self._init_pipeline_state(args)
        super().__init__(model=model, args=args, train_dataset=None, eval_dataset=self.eval_rows,
                         processing_class=processing_class, callbacks=display_callbacks(args, callbacks),
                         optimizers=optimizers)
        if args.progress == "table":
            self.remove_callback(PrinterCallback)  # the progress table replaces transformers' raw log dicts
        self.add_callback(PipelineCallback(self))
        self.add_callback(EpochEvaluation())  # after the pipeline's: it reads the epoch that callback sets
        self._policy_sync = PolicySync(self.accelerator, lambda: self.model, self.model_id, self.args,
                                      self._frozen_weights, self.metrics, self._publish_version)
        self.loss_config = LossConfig(epsilon=args.epsilon, epsilon_high=args.epsilon_high,
                                      score_centering=args.score_centering,
                                      clip_min=args.vllm_importance_sampling_clip_min,
                                      clip_max=args.vllm_importance_sampling_clip_max)

    # ------------------------------------------------------------------------------ construction
    def _checked_inputs(self, model_id: str, reward_funcs: Any, args: AsyncGRPOConfig | None, train_dataset: Any,
                        eval_dataset: Any, peft_config: Any, environment_factory: Any) -> AsyncGRPOConfig:
        """The config (a default one when ``None``), after refusing what the trainer cannot run
        (:mod:`trainer.construction_checks`); sets ``eval_rows``, the evaluation rows when evaluation is asked for."""
        if args is None:
            args = AsyncGRPOConfig(output_dir=f"{Path(model_id).name}-AsyncGRPO")
        if not isinstance(args, AsyncGRPOConfig):
            raise ConfigError(f"args must be an AsyncGRPOConfig, got {type(args).__name__}")
        if train_dataset is None and environment_factory is None:
            raise ConfigError("give a train_dataset, or an environment_factory whose reset() returns the prompt")
        if train_dataset is None and args.max_steps <= 0:
            raise ConfigError("without a train_dataset the environment owns the data, so the run has no epochs: "
                              "set max_steps (e.g. AsyncGRPOConfig(max_steps=1000))")
        has_env = environment_factory is not None or not self.prompt_column_required
        check_dataset(train_dataset, has_env)
        check_dataset(eval_dataset, has_env, "eval_dataset")
        wants_eval = args.eval_strategy != "no" or args.eval_on_start or eval_dataset is not None
        self.eval_rows = eval_rows(eval_dataset, args.eval_num_rows, environment_factory is not None) \
            if wants_eval else None
        check_construction(reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, peft_config=peft_config,
                           environment_factory=environment_factory)
        return args

    def _load(self, model: str | PreTrainedModel, model_id: str, processing_class: Any,
              args: AsyncGRPOConfig) -> tuple[PreTrainedModel, Any]:
        """The model (loaded from ``model`` when it is an id or directory) and its tokenizer (pad token: EOS
        when it has none); a vision tower is frozen here, neither trained nor synced."""
        # A JSON string from the command line is a dict by now (AsyncGRPOConfig.__post_init__).
        init_kwargs = dict(cast("dict[str, Any] | None", args.model_init_kwargs) or {})
        if isinstance(model, str):
            init_kwargs.setdefault("dtype", getattr(torch, args.dtype) if args.dtype != "auto" else "auto")
            model = load_model(model, trust_remote_code=args.trust_remote_code, **init_kwargs)
        self._frozen_weights = freeze_outside_language_model(model)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model_id, trust_remote_code=args.trust_remote_code, revision=init_kwargs.get("revision"))
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        return model, processing_class

    def _prepare_model(self, model: PreTrainedModel, args: AsyncGRPOConfig, peft_config: Any) -> PreTrainedModel:
        """The model as it trains: PEFT-wrapped if asked, MoE router loss, tree attention for packed rows,
        its FLOP model, and its decoder layers compiled where ``compile_training_step`` says so."""
        if peft_config is not None:
            from peft import get_peft_model

            model = cast(PreTrainedModel, get_peft_model(model, peft_config))  # forwards the model's attributes
        check_output_head(model)
        self._aux_coef = resolve_aux_loss_coef(model, args.router_aux_loss_coef)
        self._router = RouterLogits(model) if self._aux_coef > 0 else None
        if args.packing == "tree":
            enable_tree_attention(model)  # else per-sample rows, through the model's own layers
        self._num_params = sum(p.numel() for p in model.parameters())
        self._flop_model = FlopModel.from_config(model.config)
        self._compile_tracker: CompileTracker | None = None
        self._row_buckets: RowBuckets | None = None  # static shapes: tree rows padded to a bucket
        if args.device.type == "cuda":  # FlexAttention and the head loss compile even in an eager step
            use_compile_cache(args.compile_cache_dir)
        if use_compiled_step(args.compile_training_step, args.device):  # trainer.training.compile
            if args.compile_row_bucket is not None and args.packing == "tree":
                self._row_buckets = RowBuckets(args.compile_row_bucket)
            compile_decoder_layers(model, dynamic=self._row_buckets is None)
            self._compile_tracker = CompileTracker(announce=args.process_index == 0)
        return model

    def _compile_warm_up(self, model: PreTrainedModel, args: AsyncGRPOConfig) -> CompileWarmUp:
        """The callback that compiles the expected step shapes before the first step (training/compile_warmup.py)."""
        bucket = args.compile_row_bucket
        return CompileWarmUp(
            model, grpo_step(model, args.temperature, lambda: self.compute_loss_context_manager()),
            lambda: expected_lengths(self.stream.token_budget if self.stream else None, bucket),
            pad=self._row_buckets, device=args.device, tracker=self._compile_tracker)

    def _init_pipeline_state(self, args: AsyncGRPOConfig) -> None:
        """The pipeline's parts (made when training starts) and the step's counters."""
        self.metrics = MetricWindow()
        self.worker: RolloutWorker | None = None
        self.stream: MicroBatchStream | None = None  # type: ignore[assignment]
        self.feed: StepFeed | None = None  # multi-process: rank 0 -> other ranks
        self._step_feed_state = StepPayload([], epoch_done=False, first_untrained=0, policy_version=0)
        self._policy_version = 0
        self._requested_version = 0  # the version of the last sync started (every rank counts them)
        self._allowance: StalenessAllowance | None = None  # rank 0: the worker's staleness allowance
        self._resume_state: dict[str, Any] = {}
        self._step_fwd_bwd_s = self._step_fwd_s = self._step_flops = 0.0
        self._step_groups: set[int] = set()  # distinct groups trained in the step (every row, every rank)
        self._num_tokens = 0
        self._step_tokens = (0, 0)  # (forwarded, trained) tokens of the current step
        self._loss_stats: list[dict[str, torch.Tensor]] = []
        self._step_guard = StepGuard()  # a step with non-finite gradients is skipped, never applied or synced
        self._spike_clip = None if args.grad_spike_clip is None else SpikeClip(args.grad_spike_clip)

    def create_accelerator_and_postprocess(self) -> None:
        """The base accelerator, with accelerate's FSDP2 path also on for a multi-process CPU run."""
        super().create_accelerator_and_postprocess()
        if enable_fsdp_on_cpu(self.accelerator, self.args.fsdp_plugin_args):
            self.is_fsdp_enabled = True

    # ------------------------------------------------------------------------------ lifecycle
    def train(  # type: ignore[override]  # trial, ignore_keys_for_eval: passed on through **kwargs
        self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any
    ) -> Any:
        """Train until the epochs are done (or ``max_steps``); always stops the rollout worker and the servers
        that ``launch_vllm`` / ``launch_envserver`` started for it (:mod:`trainer.launch.for_run`)."""
        check_picklable(reward_funcs=self.reward_funcs, tools=self.tools,
                         environment_factory=self.environment_factory, loop_cls=self.loop_cls,
                         **self.rollout_loop_kwargs())
        if resume_from_checkpoint is True:
            resume_from_checkpoint = cast("str | None", get_last_checkpoint(self.args.output_dir))
            if resume_from_checkpoint is None:
                raise ConfigError(f"resume_from_checkpoint=True but {self.args.output_dir} holds no checkpoint")
        if resume_from_checkpoint:
            state_file = Path(resume_from_checkpoint) / ROLLOUT_STATE
            if state_file.exists():
                self._resume_state = json.loads(state_file.read_text())
        with ExitStack() as launched:  # launch_vllm / launch_envserver's servers: stopped after the worker
            try:
                launch_servers(self, launched)
                return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            except BaseException as exc:
                if self.feed is not None and self.is_world_process_zero():
                    self.feed.fail(exc)  # the other ranks re-raise it instead of waiting for data
                if isinstance(exc, PipelineStalledError):
                    self._save_after_stall()
                raise
            finally:
                self._shutdown()

    def _report_stall(self, report: StallReport) -> None:
        """A stall warning: on the console, as ``pipeline/*`` metrics (``report_to``) and in the progress table."""
        logger.warning(report.message())
        super().log(report.metrics())  # the base log: this trainer's own would flush the step's metric window

    def _save_after_stall(self) -> None:
        """Keep what was trained before a stall stops the run, whatever ``save_strategy`` says.

        Single process only: under several, the other ranks are already leaving through the step feed and
        a sharded save needs them all (the last periodic checkpoint stands).
        """
        if self.accelerator.num_processes > 1 or self.stream is None:
            return
        folder = Path(super()._get_output_dir(None)) / f"checkpoint-{self.state.global_step}"
        if folder.exists():
            return  # this step was saved already
        try:
            self._save_checkpoint(self.model, None)
            logger.warning("the run stalled: saved %s before stopping", folder)
        except Exception:  # the stall is the error to report; a failed save only adds to it
            logger.exception("the run stalled, and saving a checkpoint before stopping failed")

    def _shutdown(self) -> None:
        self._policy_sync.stop_overlapped()
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        self._policy_sync.close()  # after the worker: no rollout still asks for an adapter
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def get_train_dataloader(self) -> MicroBatchStream | StepFeed:  # type: ignore[override]
        """Start the pipeline and return the micro-batch stream that replaces the DataLoader.

        Four steps: where to start (:meth:`_resume_position`), the vLLM servers read once and the weight
        sync connected (:meth:`_connect_server`), the rollout worker started (:meth:`_start_worker`), the
        stream over its queue (:meth:`_make_stream`). With several processes only rank 0 does that; the
        others get the :class:`StepFeed` through which rank 0 sends them each step's micro-batches
        (see :meth:`get_batch_samples`).
        """
        args = self.args
        start, done, version = self._resume_position()
        admins = [VLLMAdminClient(url, timeout_s=args.vllm_server_timeout) for url in args.vllm_server_base_urls]
        if self.accelerator.num_processes > 1:
            self.feed = StepFeed(timeout_s=args.rollout_worker_timeout, group_timeout_s=args.ddp_timeout)
            if not self.is_world_process_zero():
                if self.is_fsdp_enabled:  # it gathers with rank 0, so it learns the way of the syncs too
                    self._policy_sync.connect(admins, read_server_info(admins[0]), sharded=True)
                self.feed.wait_ready()
                return self.feed
        fleet = FleetState.create(spawn_context(), len(admins), version)
        servers = self._connect_server(admins, version, fleet)
        self.worker = self._start_worker(servers, start, done, version, fleet)
        self.stream = self._make_stream(args.token_budget or servers[0].max_model_len, start, done, version)
        if self.feed is not None:
            self.feed.mark_ready()
        return self.stream

    def _resume_position(self) -> tuple[int, list[int], int]:
        """(first untrained prompt, prompts past it already trained, policy version) to start from."""
        start = int(self._resume_state.get("first_untrained_position", 0))
        done = [int(p) for p in self._resume_state.get("done_positions", [])]  # trained past `start`
        if is_stream(self.rollout_dataset) and (start or done):
            logger.warning("train_dataset is a stream, which cannot be repositioned: the rollout worker starts "
                           "again from its first prompt (the checkpoint had trained up to position %d)", start)
            start, done = 0, []
        version = int(self._resume_state.get("policy_version", 0))
        self._policy_version = self._requested_version = version
        self._step_feed_state = StepPayload([], epoch_done=False, first_untrained=start, policy_version=version)
        return start, done, version

    def _connect_server(self, admins: list[VLLMAdminClient], version: int, fleet: FleetState) -> list[ServerInfo]:
        """Read each server once (waiting for it up to ``vllm_server_timeout``; they must agree), connect
        the weight sync to them, and bring a resumed policy (or adapter version 0) to every server."""
        servers = read_servers_info(admins)
        server = servers[0]
        mismatch = dtype_mismatch(server, str(next(self.model.parameters()).dtype).removeprefix("torch."))
        if mismatch:
            logger.warning(mismatch)
        self._policy_sync.connect(admins, server, sharded=self.is_fsdp_enabled, fleet=fleet)
        # Resumed: the server still has the initial weights. Adapter sync: version 0 is an adapter too.
        if (version > 0 or self._policy_sync.adapter is not None) and not self.is_fsdp_enabled:  # FSDP: _start_sharded
            self._policy_sync.sync(version, barrier=False)  # the other ranks wait in StepFeed.wait_ready
        return servers

    def _start_worker(self, servers: list[ServerInfo], start: int, done: list[int], version: int, fleet: FleetState
                      ) -> RolloutWorker:
        """The rollout worker with its settings, channels and staleness allowance (started now, or with
        FSDP once training begins: :meth:`_start_sharded`)."""
        args = self.args
        server = servers[0]  # they agree (read_servers_info)
        token_budget = args.token_budget or server.max_model_len
        rule = cast(AllowanceRule, args.staleness_allowance)  # one of them: AsyncGRPOConfig checks it
        self._allowance = StalenessAllowance(rule, args.max_staleness, token_budget * self.accelerator.num_processes
                                             * args.gradient_accumulation_steps)
        ctx = spawn_context()
        sized = self.rollout_dataset is not None and not is_stream(self.rollout_dataset)
        channels = WorkerChannels.create(ctx, initial_allowance=self._allowance.initial, initial_version=version,
                                         epoch_size=len(self.rollout_dataset) if sized else 0, fleet=fleet)
        adapter = self._policy_sync.adapter
        settings = RolloutSettings.from_config(
            args, self.model_id, server, chat_template=self.rollout_chat_template,
            candidates=candidate_path(server, args.top_k, args.top_p, args.min_p),
            lora_name=adapter.lora_name if adapter is not None else None, servers=servers)
        loop_kwargs: dict[str, Any] = dict(
            processing_class=self.processing_class, dataset=self.rollout_dataset, reward_funcs=self.reward_funcs,
            tools=self.tools, environment_factory=self.environment_factory, dataset_start_index=start,
            dataset_skip_positions=done, **self.rollout_loop_kwargs())
        worker = RolloutWorker(self.loop_cls, settings, loop_kwargs, channels, args.rollout_worker_timeout, ctx)
        if not self.is_fsdp_enabled:
            worker.start()
        return worker

    def _make_stream(self, token_budget: int, start: int, done: list[int], version: int) -> MicroBatchStream:
        """The micro-batch stream over the worker's queue, stopping at the epochs asked for."""
        args = self.args
        assert self.worker is not None  # _start_worker ran
        stop, stop_epochs = None, None
        if not self._explicit_max_steps and self.rollout_dataset is not None:
            if is_stream(self.rollout_dataset):  # its size is known once the worker's first pass ends
                stop_epochs = args.num_train_epochs
            else:
                stop = int(round(args.num_train_epochs * len(self.rollout_dataset)))
        stream = MicroBatchStream(self.worker, self.accelerator.num_processes, token_budget, args.max_staleness,
                                  self.metrics, start_position=start, stop_position=stop,
                                  keep_samples=args.log_completions, done_positions=done, stop_epochs=stop_epochs,
                                  share_prefixes=args.packing == "tree",
                                  stall=StallWatch(args.stall_timeout, self._report_stall))
        stream.policy_version = version
        return stream

    def _start_sharded(self) -> None:
        """FSDP: the base Trainer shards the model, and loads a resumed checkpoint into it, only after
        :meth:`get_train_dataloader`; so the first sync (a resumed version, or adapter version 0), in
        which every rank gathers, and then the rollout worker's start happen here, as training begins."""
        if not self.is_fsdp_enabled:
            return
        if self._policy_version > 0 or self._policy_sync.adapter is not None:
            self._policy_sync.sync(self._policy_version, barrier=False)
        if self.worker is not None:
            self.worker.start()

    def rollout_loop_kwargs(self) -> dict[str, Any]:
        """Extra constructor arguments of ``loop_cls``: a subclass's own settings (a field of your config
        subclass, say: the loop gets a ``RolloutSettings``, not the config). They must pickle. Default: none."""
        return {}

    # ------------------------------------------------------------------------------ the step
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[MicroBatch], None]:
        """One optimizer step's ``num_batches`` micro-batches: pulled from the stream on rank 0
        (and sent to the other ranks), received from rank 0 elsewhere."""
        batches = [next(epoch_iterator) for _ in range(num_batches)]
        if self.stream is None:  # a rank other than 0: epoch_iterator is the StepFeed
            assert self.feed is not None and self.feed.last is not None  # next() above received a payload
            self._step_feed_state = self.feed.last
            self._policy_version = self.feed.last.policy_version
            return batches, None
        self._step_feed_state = StepPayload(
            batches, epoch_done=self.stream.epoch_done, first_untrained=self.stream.progress.first_untrained,
            policy_version=self._policy_version)
        if self.feed is not None:
            self.feed.send(self._step_feed_state)
        return batches, None

    def training_step(  # type: ignore[override]  # inputs: the MicroBatch of get_batch_samples, not a dict
        self, model: torch.nn.Module, inputs: MicroBatch, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Forward this process's packed row, compute the loss, backward; returns the detached loss."""
        model.train()
        t0 = self._synced_clock()
        row = inputs.row_for(self.accelerator.process_index).to(self.args.device)
        if self._row_buckets is not None:
            row = self._row_buckets(row)
        if self._router is not None:
            self._router.clear()
        with self.compute_loss_context_manager():
            # The LM head's gradient is formed during this forward (trainer.training.logprobs.head_loss_from_hidden).
            loss, stats = packed_grpo_loss(model, row, self.args.temperature, self.loss_config,
                                           inputs.num_trained_global)
            loss = loss / self.current_gradient_accumulation_steps
        self._step_fwd_s += self._synced_clock() - t0
        # DDP averages gradients over the W processes, and this rank's loss is its row's sum over the
        # trained tokens of all rows (num_trained_global): times W, the average is the global sum.
        loss = loss * self.accelerator.num_processes
        if self._router is not None:  # MoE: + coef x the load-balancing loss of this row's real tokens
            aux = self._router.aux_loss(forwarded_positions(model, row))
            self.metrics.add("aux_loss", float(aux.detach()))
            loss = loss + self._aux_coef * aux / self.current_gradient_accumulation_steps
        self.accelerator.backward(loss)
        self._loss_stats.append(stats)
        self._step_fwd_bwd_s += self._synced_clock() - t0
        self._step_tokens = (self._step_tokens[0] + inputs.forwarded_tokens,
                             self._step_tokens[1] + inputs.num_trained_global)
        if self._flop_model is not None:  # every row of the micro-batch: MFU is over all training devices
            self._step_flops += sum(row_flops(self._flop_model, r) for r in inputs.rows)
        self._step_groups.update(g for r in inputs.rows for g in r.sample_group_ids)
        return cast(torch.Tensor, loss.detach())  # the accelerator's num_processes made it Any

    def _synced_clock(self) -> float:
        """``perf_counter`` after the device's queued work (CUDA runs asynchronously; timing needs it)."""
        if self.args.device.type == "cuda":
            torch.cuda.synchronize(self.args.device)
        return time.perf_counter()

    def floating_point_ops(self, inputs: Any) -> int:
        """6 x parameters x this process's forwarded tokens (forward + backward of the dense layers;
        the Trainer sums ``total_flos`` over processes)."""
        if not isinstance(inputs, MicroBatch):
            return 0
        tokens = inputs.row_for(self.accelerator.process_index).num_unique_tokens
        return 6 * self._num_params * tokens

    def _publish_version(self, version: int) -> None:
        """Make ``version`` the policy version of the trainer, the stream and new rollouts."""
        self._policy_version = version
        if self.stream is not None:
            self.stream.policy_version = version
        if self.worker is not None:
            self.worker.channels.policy_version.value = version

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the window's pipeline metrics to the Trainer's logs (loss, grad_norm, learning_rate)."""
        if self._loss_stats:  # every rank logs at the same steps: the all-reduce is collective
            logs.update(loss_metrics(all_reduce_loss_stats(reduce_loss_stats(self._loss_stats))))
            self._loss_stats = []
        if self.worker is not None:
            self.metrics.add_records(self.worker.drain_metrics())
        logs.update(self.metrics.flush())
        logs["num_tokens"] = float(self._num_tokens)
        if self.stream is not None and self.args.log_completions:
            self._report_completions(self.stream)
        super().log(logs, start_time)

    def _report_completions(self, stream: MicroBatchStream) -> None:
        """``log_completions`` (rank 0): show the completions trained since the last log."""
        samples = stream.take_trained_samples()[:self.args.num_completions_to_print]

        def decode(ids: list[int]) -> str:
            return cast(str, self.processing_class.decode(ids, skip_special_tokens=True))  # one sequence: a str
        records = []
        for sample in samples:
            ids, mask = sample.sequence.input_ids, sample.sequence.loss_mask
            start = mask.index(1) if 1 in mask else len(ids)  # the completion starts at the first trained token
            records.append(CompletionRecord(self.state.global_step, decode(ids[:start]), decode(ids[start:]),
                                            sample.reward, sample.advantage))
        report_completions(records, self.state.global_step, self.callback_handler.callbacks)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,  # type: ignore[override]
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Run evaluation episodes of the newest policy; log and return their metrics (docs/evaluation.md).

        ``transformers`` calls it at ``eval_strategy`` / ``eval_steps`` and ``eval_on_start``. During
        training the rollout worker runs the episodes beside training's (none of them is trained on);
        otherwise this process runs them against the server's weights. The metrics are
        ``{metric_key_prefix}_success_rate`` (with ``_low`` / ``_high``: its 95 % interval), ``_mean_reward``,
        ``_pass@k``, ... (``report_to`` shows them as ``eval/...``); the episodes go to
        ``<output_dir>/eval/step-N/`` (``toolgym eval --compare`` reads two such folders).

        Args:
            eval_dataset: Rows to evaluate instead of the trainer's ``eval_dataset``.
            ignore_keys: Unused (there are no model outputs to filter).
            metric_key_prefix: The metrics' prefix.
        """
        t0 = time.monotonic()
        metrics: dict[str, float] | None = None
        if self.is_world_process_zero():
            rows = self.eval_rows if eval_dataset is None else None
            if rows is None:
                rows = eval_rows(eval_dataset, self.args.eval_num_rows, self.environment_factory is not None)
            plan = EvalPlan.from_config(self.args, rows)
            if self.worker is not None:
                episodes = request_evaluation(self.worker, plan)
            else:
                args = self.args
                servers = read_servers(args.vllm_server_base_urls, args.vllm_server_timeout)
                settings = RolloutSettings.from_config(args, self.model_id, servers[0], servers=servers,
                                                       chat_template=self.rollout_chat_template)
                episodes = evaluate_outside_training(settings, plan, self.loop_cls, dict(
                    processing_class=self.processing_class, reward_funcs=self.reward_funcs, tools=self.tools,
                    environment_factory=self.environment_factory, **self.rollout_loop_kwargs()))
            folder = Path(str(self.args.output_dir)) / metric_key_prefix / f"step-{self.state.global_step}"
            metrics = record_evaluation(episodes, folder, metric_key_prefix, time.monotonic() - t0,
                                        {"step": self.state.global_step, "model": self.model_id})
        if self.accelerator.num_processes > 1:  # every rank decides the same (best model, scheduler)
            metrics = broadcast_object_list([metrics])[0]
        assert metrics is not None
        super().log(metrics)  # the base log: this trainer's own would flush the step's metric window
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _get_output_dir(self, trial: Any) -> str:
        run_dir = super()._get_output_dir(trial)
        return self._checkpoints.output_dir(run_dir) if self._checkpoints is not None else run_dir

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The base save plus ``rollout_state.json``, atomically (:mod:`trainer.checkpoint`): a kill or
        a full disk mid-save leaves the earlier checkpoints as they were."""
        self._policy_sync.wait()  # the saved policy version is the one the server has
        if self._checkpoints is None:
            self._checkpoints = StagedCheckpoints(self.accelerator.wait_for_everyone, self.is_world_process_zero())
        run_dir = super()._get_output_dir(trial)
        rollout_state = self.stream.state() if self.stream is not None and self.is_world_process_zero() else None
        with self._checkpoints.saving(run_dir, self.state, rollout_state, self.args.save_total_limit):
            super()._save_checkpoint(model, trial)
