"""``AsyncGRPOConfig``: every knob of the asynchronous GRPO trainer, documented where declared.

It subclasses ``transformers.TrainingArguments``, so the optimizer, scheduler, logging, saving and
``report_to`` fields are the ecosystem's. Defaults that differ from ``TrainingArguments``:
``logging_steps=1``, ``gradient_checkpointing=True``, ``bf16=True`` unless ``fp16`` (and only where
the device supports it), ``learning_rate=1e-6``, ``lr_scheduler_type="constant"`` (the number of
steps per epoch is not known in advance: multi-turn forks change it), ``ignore_data_skip=True``
(the base Trainer's skip-and-replay does not apply to the rollout queue) and
``remove_unused_columns=False`` (every column reaches the reward functions; it must stay False).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import TrainingArguments

from trainer.exceptions import ConfigError
from trainer.trl_fields import refuse_trl_fields

# activation_checkpointing / activation_checkpointing_kwargs are TrainingArguments' fields from
# transformers 5.23 on (inherited here); before, gradient_checkpointing* are the same settings.
_HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}


def _bf16_supported() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


# ``fsdp`` string options that FSDP2 supports (transformers translates them into fsdp_config).
FSDP2_OPTIONS = ("full_shard", "shard_grad_op", "offload", "auto_wrap")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def _fsdp_version(fsdp_config: dict[str, Any] | str | None) -> int:
    config: dict[str, Any]
    if isinstance(fsdp_config, str):  # a JSON file, as TrainingArguments accepts
        with open(fsdp_config, encoding="utf-8") as f:
            config = json.load(f)
    else:
        config = fsdp_config or {}
    return int(config.get("version", config.get("fsdp_version", 2)))


def _refuse_unsupported_parallelism(args: Any) -> None:
    """Raise :class:`ConfigError` for parallelism this trainer does not support (``trainer.training.fsdp``).

    Called by ``AsyncGRPOConfig`` before ``TrainingArguments`` processes the fields, so a DeepSpeed
    config is refused before anything tries to import DeepSpeed. ``args.fsdp_config`` gets an explicit
    ``version: 2`` when ``fsdp`` is set without one (older transformers default to FSDP1).
    """
    if args.deepspeed or _env_true("ACCELERATE_USE_DEEPSPEED"):
        raise ConfigError("DeepSpeed is not supported by AsyncGRPOTrainer: shard with FSDP2 instead, "
                          "e.g. AsyncGRPOConfig(fsdp='full_shard', fsdp_config={'version': 2}) (docs/distributed.md)")
    pc = args.parallelism_config
    for field_name, what in (("cp_size", "context"), ("sp_size", "sequence"), ("tp_size", "tensor")):
        size = getattr(pc, field_name, None) or 1 if pc is not None else 1
        if size > 1:
            raise ConfigError(f"parallelism_config.{field_name}={size}: {what} parallelism is not supported (each "
                              f"rank trains whole tree-packed rows, which it cannot split); use data-parallel "
                              f"ranks, sharded with FSDP2 for memory, and set {field_name}=1")
    if _env_true("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "2").strip() != "2":
        raise ConfigError(f"the accelerate config asks for FSDP version {os.environ['FSDP_VERSION']}: only FSDP2 "
                          "is supported; set fsdp_version: 2 in the accelerate config file")
    if not args.fsdp:
        return
    options = args.fsdp.split() if isinstance(args.fsdp, str) else list(args.fsdp) if isinstance(args.fsdp, list) \
        else []  # fsdp=True: everything is in fsdp_config
    unsupported = [o for o in options if o not in FSDP2_OPTIONS]
    if unsupported:
        raise ConfigError(f"fsdp={args.fsdp!r}: {unsupported} exist only for FSDP1, which is not supported; "
                          f"FSDP2 takes {list(FSDP2_OPTIONS)} (hybrid sharding: a 2-D device mesh, not an fsdp option)")
    if isinstance(args.fsdp_config, dict) and (args.fsdp_config.get("xla") or args.fsdp_config.get("fsdp_xla")):
        raise ConfigError("fsdp_config xla=True (PyTorch/XLA FSDP) is not supported; use FSDP2 on CUDA or CPU")
    version = _fsdp_version(args.fsdp_config)
    if version != 2:
        raise ConfigError(f"fsdp_config version={version}: only FSDP2 is supported; set fsdp_config={{'version': 2}}")
    if args.fsdp_config is None:
        args.fsdp_config = {"version": 2}
    elif isinstance(args.fsdp_config, dict) and "version" not in args.fsdp_config:
        args.fsdp_config = {**args.fsdp_config, "version": 2}



def server_urls(value: str | Sequence[str]) -> tuple[str, ...]:
    """The server URLs in ``value``: one URL, URLs joined by commas, or a sequence of either.

    Trailing slashes are dropped, so ``http://h:8000/`` and ``http://h:8000`` are one server.

    Raises:
        ConfigError: No URL, an empty entry (``"a,,b"``), or a server named twice.
    """
    parts = [value] if isinstance(value, str) else list(value)
    urls = tuple(u.strip().rstrip("/") for part in parts for u in str(part).split(","))
    if not urls or any(not u for u in urls):
        raise ConfigError(f"vllm_server_base_url={value!r} has an empty entry: give one URL, URLs joined by "
                          "commas, or a list of URLs, e.g. http://host-a:8000,http://host-b:8000")
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise ConfigError(f"vllm_server_base_url names {', '.join(twice)} more than once: name each server once")
    return urls


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    """Configuration of :class:`~trainer.AsyncGRPOTrainer` (see the module docstring for the
    ``TrainingArguments`` defaults it changes)."""

    # --- TrainingArguments defaults changed for this trainer -----------------------------------
    logging_steps: float = field(default=1, metadata={"help": "Log every this many optimizer steps."})
    if _HAS_ACTIVATION_CHECKPOINTING:  # transformers >= 5.23: gradient_checkpointing* are deprecated aliases
        activation_checkpointing: bool | None = field(
            default=True, metadata={"help": "Recompute activations in the backward pass to save memory."}
        )
    else:
        gradient_checkpointing: bool = field(
            default=True, metadata={"help": "Recompute activations in the backward pass to save memory."}
        )
    bf16: bool | None = field(  # type: ignore[assignment]  # widens the base's bool: None is decided below
        default=None,
        metadata={"help": "bfloat16 mixed precision. None: True unless fp16 is set (and the device has bf16)."},
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "Scheduler; constant because steps per epoch are unknown in advance (forks)."},
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata={"help": "Must stay True: resume fast-forwards the rollout worker instead of replaying data."},
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: every dataset column reaches the reward functions."}
    )

    # --- model ----------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for from_pretrained when the model is given as a path or id; "
                  "a 'dtype' here wins over `dtype`; 'revision' also applies to the tokenizer."},
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "dtype the weights are loaded in: 'auto', 'bfloat16', 'float16' or 'float32'. "
                  "float32 by default: the train/inference mismatch is sensitive to the trainer's precision."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow model/tokenizer code from the checkpoint."}
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "MoE load-balancing loss coefficient; None uses the model config's; 0.0 disables. "
                  "An error on a non-MoE model."},
    )

    # --- generation ----------------------------------------------------------------------------
    num_generations: int = field(default=8, metadata={"help": "Rollouts sampled per prompt (the group size)."})
    max_completion_length: int = field(
        default=2048, metadata={"help": "Most tokens generated per vLLM request (per turn of a multi-turn rollout)."}
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Leave out of training every rollout whose last turn was cut at max_completion_length "
                  "(no EOS): no loss, and no place in its group's baseline (unlike TRL's option, which keeps it "
                  "there), so the advantages of the trained rollouts still sum to zero. Without it, a truncated "
                  "rollout that reached the goal before rambling is reinforced, rambling included."},
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(
        default=1.0, metadata={"help": "Nucleus sampling mass in (0, 1]; < 1 requires top_k (see docs/loss.md)."}
    )
    top_k: int = field(default=0, metadata={"help": "Top-k truncation; 0 disables it."})
    min_p: float | None = field(
        default=None, metadata={"help": "Minimum token probability relative to the best one, in [0, 1]; needs top_k."}
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Extra keyword arguments for apply_chat_template (e.g. enable_thinking)."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "Most tool-calling turns per rollout; None: until a turn calls no tool."}
    )

    # --- vLLM server ---------------------------------------------------------------------------
    vllm_server_base_url: str = field(
        default="http://localhost:8000",
        metadata={"help": "Base URL of the vLLM server used for generation. Several servers: URLs joined by commas "
                  "(a list works too in Python and YAML); they must serve the same model and max_model_len "
                  "(checked at start). Each rollout goes to the least-loaded server, every weight sync reaches "
                  "every server, and a server that stops answering is taken out (docs/distributed.md)."},
    )
    vllm_server_timeout: float = field(
        default=1800.0,
        metadata={"help": "Seconds for each vLLM call: readiness wait and weight syncs raise after it; a "
                  "generation request that times out is retried."},
    )

    # --- servers the run starts for itself (trainer/launch/for_run.py) -------------------------
    launch_vllm: bool = field(
        default=False,
        metadata={"help": "Start a vLLM server on the model for the run (the flags of toolgym vllm, "
                  "--max-model-len vllm_max_model_len, --dtype dtype) and set vllm_server_base_url to it; it is "
                  "stopped when train() returns or raises, Ctrl-C included. On CPU a trainer beside it trains on "
                  "half the cores. One training process only (start the server yourself for torchrun)."},
    )
    vllm_max_model_len: int = field(
        default=2048,
        metadata={"help": "--max-model-len of the server launch_vllm starts: the longest prompt + completion it "
                  "accepts (also the default token_budget)."},
    )
    launch_envserver: bool = field(
        default=False,
        metadata={"help": "Host environment_factory on a local env server for the run (as toolgym serve would) and "
                  "train on it remotely; it is stopped when train() returns or raises. The factory must be a "
                  "class a child process can import: module:Class, or a class of the script run as __main__ "
                  "(whose training then sits under if __name__ == '__main__':), bound to JSON arguments with "
                  "functools.partial if need be; or a dict name -> such classes. One training process only."},
    )

    # --- loss ----------------------------------------------------------------------------------
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping epsilon of the trust region."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping epsilon; None uses `epsilon` (DAPO suggests 0.28)."}
    )
    score_centering: bool = field(
        default=True,
        metadata={"help": "Score-centred objective (default); False uses GRPO's clipped surrogate."},
    )
    vllm_importance_sampling_clip_min: float = field(
        default=0.5, metadata={"help": "Tokens whose importance ratio is below this are dropped from the loss."}
    )
    vllm_importance_sampling_clip_max: float = field(
        default=5.0, metadata={"help": "Tokens whose importance ratio is above this are dropped from the loss."}
    )
    tail_token_prob: float | None = field(
        default=1e-3,
        metadata={"help": "Train each rollout up to and including its first tail token, a token sampled with "
                  "less than this times the probability of its position's most likely token (vLLM's min_p "
                  "rule); its later tokens stay as context but are not trained (docs/loss.md). None or 0: "
                  "train every sampled token."},
    )
    turn_baseline: bool = field(
        default=True,
        metadata={"help": "Credit each turn of a multi-turn rollout relative to the rollouts of its group that "
                  "reached the same state (the same tokens up to that turn): its tokens get the rollout's "
                  "advantage minus those rollouts' mean advantage, so a later turn is not credited with what "
                  "earlier turns already decided (trainer/rollout/turn_baseline.py). A turn whose state no "
                  "other rollout reached keeps the rollout's advantage. False: every token gets the rollout's "
                  "advantage (GRPO)."},
    )
    grad_spike_clip: float | None = field(
        default=3.0,
        metadata={"help": "Clip a step's gradient norm at this multiple of the median norm of the previous 16 "
                  "steps (from the 5th step on), after max_grad_norm's absolute clip: one outlier step is not "
                  "written into AdamW's moments for the steps after it (trainer/training/step_guard.py, "
                  "docs/loss.md). Metrics batch/grad_spike_clipped_count and batch/grad_norm_to_median. None: "
                  "only max_grad_norm applies."},
    )
    num_sampler_logprobs: int = field(
        default=8,
        metadata={"help": "Sampler top log-probs requested per generated token (score centering's H_t); "
                  "capped by the server's --max-logprobs."},
    )
    packing: str = field(
        default="tree",
        metadata={"help": "How samples share a row. 'tree': tree packing (docs/packing.md): a row is a prefix trie, a "
                  "prompt shared by a group is forwarded once; full-attention, sliding-window and Gated DeltaNet "
                  "layers. 'per_sample': nothing is shared, each sample is forwarded on its own (a right-padded "
                  "batch, the model's own layers): the way to train families tree packing refuses (Mamba2 and "
                  "other state-space layers, short convolutions such as LFM2, attention sinks), at the cost of "
                  "the packing ratio (each group's prompt forwarded once per sample)."},
    )
    token_budget: int | None = field(
        default=None,
        metadata={"help": "Most unique tokens forwarded in one row; None: the server's max_model_len. A "
                  "sample longer than this is dropped with a warning."},
    )

    # --- asynchronous pipeline -----------------------------------------------------------------
    max_concurrent_rollouts: int = field(
        default=512, metadata={"help": "Hard ceiling on rollouts in flight (also the sync-tool thread pool size)."}
    )
    max_staleness: int = field(
        default=4,
        metadata={"help": "Most weight updates a sample may lag the policy before it is dropped; generation "
                  "stays within max(max_staleness, 1) steps' worth of tokens ahead of training."},
    )
    weight_sync_steps: int = field(default=1, metadata={"help": "Optimizer steps between weight syncs."})
    staleness_allowance: str = field(
        default="capacity",
        metadata={"help": "How far generation may run ahead of training (docs/pipeline.md). 'capacity': "
                  "max(max_staleness - 1, 1) full steps' worth of sample tokens (a step's forwarded-token "
                  "capacity x the packing ratio of the last steps), a step of headroom below the drop limit; "
                  "'consumed': TRL AsyncGRPOTrainer's rule, max(max_staleness, 1) x the sample tokens the last "
                  "step consumed. 'source', its former name, is still accepted (with a warning) until toolgym 0.2."},
    )
    weight_sync_pause: str = field(
        default="none",
        metadata={"help": "How the server pauses for a weight sync (docs/pipeline.md). 'none': no pause: the "
                  "whole update is one engine call between two generation steps (the toolgym_shm backend; "
                  "backends that load chunk by chunk, such as nccl, pause as 'keep'); 'keep': running "
                  "requests keep their KV cache and go on with the new weights after the sync; 'reset': "
                  "TRL AsyncGRPOTrainer's pause, which clears the KV cache and so preempts every running request (each "
                  "recomputes its prefix with the new weights after the sync)."},
    )
    rollout_worker_timeout: float = field(
        default=300.0, metadata={"help": "Seconds without a worker heartbeat before it is declared hung."}
    )
    stall_timeout: float = field(
        default=900.0,
        metadata={"help": "Seconds the training loop may wait without a trainable sample (every group dropped for "
                  "zero reward spread or unscorable rewards, every rollout failing, every sample stale...). A "
                  "warning with the reasons and counts comes after a tenth of it (5-60 s) and again at each such "
                  "interval; past it the run saves a checkpoint (single process) and stops with "
                  "PipelineStalledError. Time spent training does not count (docs/pipeline.md, 'Stalls')."},
    )
    reward_timeout: float | None = field(
        default=300.0,
        metadata={"help": "Seconds one reward function may take on one group (sync ones run in threads, "
                  "math-verify's parsing included). Past it the group is not scored by that function "
                  "(rewards/<name>/timeout_count); three timed-out groups in a row stop the run "
                  "(RewardTimeoutError). None: no limit."},
    )
    env_call_timeout: float | None = field(
        default=120.0,
        metadata={"help": "Seconds one call of a local environment (reset, a tool, get_reward) or of a tool from "
                  "tools=[...] may take. Past it the rollout fails (rollout/failed_count) and its environment "
                  "instance is discarded (a sync call's thread cannot be stopped: it finishes on its own). Remote "
                  "environments are also bounded by their server's call_timeout. None: no limit."},
    )

    # --- training step -------------------------------------------------------------------------
    compile_training_step: bool = field(
        default=True,
        metadata={"help": "On CUDA, compile each decoder layer (regional torch.compile; row lengths: "
                  "compile_row_bucket) for 1.5-2x faster steps; a step that meets a new shape waits for its "
                  "compilation (about 10-20 s, perf/compile_s and perf/compile_count). CPU always runs eager. "
                  "False: eager everywhere (docs/distributed.md)."},
    )

    compile_row_bucket: int | None = field(
        default=1024,
        metadata={"help": "With the compiled step (CUDA, tree packing): each row is padded up to a multiple of this "
                  "many tokens and the layers are compiled for static shapes, one compilation per bucket reached "
                  "(at most token_budget / compile_row_bucket, about 10 s each on an H200; perf/compile_s); "
                  "measured 3-6 points more hardware FLOP utilisation than dynamic shapes at Qwen3 0.6B-4B. "
                  "Equal to token_budget: one graph, rows padded to the budget: faster to start (0.6B: a 10-step run "
                  "0.88x eager's time from a cold cache against 1.68x), about 8 % slower steps "
                  "(bench/packing/README.md). None: one graph with dynamic shapes, compiled once for every row "
                  "length."},
    )
    compile_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Folder where compiled graphs, kernels and Triton/fla autotuning results are kept between "
                  "runs (CUDA), shared by ranks, resumes and concurrent runs, one subfolder per torch/Triton/driver "
                  "version (trainer/training/compile_cache.py): a second run of the same shapes compiles in about "
                  "1 s per row bucket instead of about 10 s. None: $TOOLGYM_COMPILE_CACHE, else "
                  "~/.cache/toolgym/compile. 'off': nothing is kept; every run compiles and tunes from scratch."},
    )

    # --- evaluation during training (eval_strategy, eval_steps, eval_on_start: TrainingArguments') ----
    eval_temperature: float | None = field(
        default=None,
        metadata={"help": "Sampling temperature of evaluation episodes; 0: greedy; None: temperature. Evaluation "
                  "runs in the rollout worker beside training's rollouts, on the newest policy version "
                  "(docs/evaluation.md)."},
    )
    eval_num_generations: int | None = field(
        default=None,
        metadata={"help": "Episodes per evaluation row: the n of eval_pass@k (k = 1..n); None: num_generations."},
    )
    eval_num_rows: int | None = field(
        default=None,
        metadata={"help": "Rows evaluated: eval_dataset's first N (None: all of them). Without an eval_dataset, "
                  "N episodes of the environment, row i reset with seed=i (None: 16)."},
    )
    eval_group_by: str | None = field(
        default=None,
        metadata={"help": "An eval_dataset column naming each row's task: eval_task/<column>=<value>/success_rate "
                  "per value. None: per environment when rows are routed to several, else none."},
    )
    eval_success_threshold: float = field(
        default=1.0,
        metadata={"help": "An evaluation episode succeeds when its summed reward is at least this "
                  "(eval_success_rate, eval_pass@k)."},
    )

    # --- logging -------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False,
        metadata={"help": "At each log, show the completions trained since the previous one (prompt, completion, "
                  "reward, advantage): a table on rank 0's console, and in TensorBoard / Weights & Biases when "
                  "they are in report_to."},
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Most completions shown per log when log_completions; None: all of them."}
    )
    progress: str = field(
        default="table",
        metadata={"help": "What the console shows while training. 'table': one compact row per log (step, reward, "
                  "groups dropped, completion length, generation throughput, queue, staleness, step time), what "
                  "toolgym train prints (transformers' printer and tqdm bar are left out); 'log': transformers' "
                  "own log lines (a tqdm bar, or the raw log dicts with disable_tqdm). report_to is independent of "
                  "it."},
    )
    plots: bool = field(
        default=True,
        metadata={"help": "Write PNG plots of the reward, the groups dropped, the completion length and the "
                  "generation throughput to <output_dir>/plots when training ends."},
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> AsyncGRPOConfig:
        # Before the generated __init__, which would answer a TRL-only name with a bare TypeError.
        refuse_trl_fields(kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16 and _bf16_supported()
        if isinstance(self.chat_template_kwargs, str):
            self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
        if isinstance(self.model_init_kwargs, str):
            self.model_init_kwargs = json.loads(self.model_init_kwargs)
        urls: object = self.vllm_server_base_url
        if not isinstance(urls, str):  # a list from Python or YAML becomes the command line's form
            self.vllm_server_base_url = ",".join(server_urls([str(u) for u in cast("Sequence[Any]", urls)]))
        _refuse_unsupported_parallelism(self)  # DeepSpeed, cp/sp/tp, FSDP1: before the base class acts on them
        super().__post_init__()  # type: ignore[no-untyped-call]  # unannotated in transformers
        self._validate()

    @property
    def vllm_server_base_urls(self) -> tuple[str, ...]:
        """The servers named in ``vllm_server_base_url``, in order (:func:`server_urls`)."""
        return server_urls(self.vllm_server_base_url)

    def _validate(self) -> None:
        server_urls(self.vllm_server_base_url)  # no empty entry, no server named twice
        if self.remove_unused_columns:
            raise ConfigError("remove_unused_columns must stay False: every column reaches the reward functions")
        if not self.ignore_data_skip:
            raise ConfigError("ignore_data_skip must stay True: a resumed run restarts the rollout worker at the first "
                              "untrained prompt instead of replaying the data (the base Trainer's skip-and-replay "
                              "does not apply to the rollout queue)")
        if self.num_generations < 2:
            raise ConfigError(f"num_generations={self.num_generations}: a group needs at least 2 rollouts "
                              "for a group-relative advantage; set num_generations >= 2")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if (self.top_p < 1 or (self.min_p or 0) > 0) and self.top_k == 0:
            raise ConfigError(f"top_p={self.top_p} / min_p={self.min_p} need top_k set: vLLM bounds the candidate "
                              "set by top_k, and the trainer renormalises over it (e.g. top_k=512)")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p={self.min_p} must be in [0, 1]")
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0: the loss needs the sampling distribution")
        if not 0 < self.vllm_importance_sampling_clip_min <= 1 <= self.vllm_importance_sampling_clip_max:
            raise ConfigError(
                "need 0 < vllm_importance_sampling_clip_min <= 1 <= vllm_importance_sampling_clip_max, got "
                f"{self.vllm_importance_sampling_clip_min} and {self.vllm_importance_sampling_clip_max}")
        for name in ("max_concurrent_rollouts", "weight_sync_steps", "max_completion_length", "num_sampler_logprobs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.tail_token_prob is not None and not 0 <= self.tail_token_prob < 1:
            raise ConfigError(f"tail_token_prob={self.tail_token_prob} must be in [0, 1) (or None to train every "
                              "sampled token); 1e-3 leaves out only what follows a token drawn at under a "
                              "thousandth of its position's most likely one")
        if self.grad_spike_clip is not None and not self.grad_spike_clip > 1:
            raise ConfigError(f"grad_spike_clip={self.grad_spike_clip} must be > 1 (a multiple of the recent median "
                              "gradient norm) or None to turn the clip off")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness={self.max_staleness} must be >= 0")
        if self.staleness_allowance == "source":
            warnings.warn("staleness_allowance='source' is deprecated and will be removed in toolgym 0.2: write "
                          "staleness_allowance='consumed' (the same rule: max(max_staleness, 1) x the sample tokens "
                          "the last step consumed)", FutureWarning, stacklevel=3)
            self.staleness_allowance = "consumed"
        choices = {"staleness_allowance": ("capacity", "consumed"), "weight_sync_pause": ("none", "keep", "reset"),
                   "packing": ("tree", "per_sample"), "progress": ("table", "log")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if not self.stall_timeout > 0:
            raise ConfigError(f"stall_timeout={self.stall_timeout} must be > 0 seconds: a run that trains nothing "
                              "must stop some time (raise it for very long rollouts)")
        if self.env_call_timeout is not None and not self.env_call_timeout > 0:
            raise ConfigError(f"env_call_timeout={self.env_call_timeout} must be > 0 (or None for no limit)")
        if self.reward_timeout is not None and self.reward_timeout <= 0:
            raise ConfigError(f"reward_timeout={self.reward_timeout} must be > 0 (or None for no limit)")
        if self.eval_temperature is not None and self.eval_temperature < 0:
            raise ConfigError(f"eval_temperature={self.eval_temperature} must be >= 0 (0: greedy; None: temperature)")
        for name in ("eval_num_generations", "eval_num_rows"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1 (or None for the default)")
        if self.num_completions_to_print is not None and self.num_completions_to_print < 1:
            raise ConfigError(f"num_completions_to_print={self.num_completions_to_print} must be >= 1 "
                              "(or None to show every completion)")
        if self.compile_row_bucket is not None and self.compile_row_bucket < 1:
            raise ConfigError(f"compile_row_bucket={self.compile_row_bucket} must be >= 1 (or None for dynamic shapes)")
        if self.token_budget is not None and self.token_budget < 1:
            raise ConfigError(f"token_budget={self.token_budget} must be >= 1 (or None for the server's max_model_len)")
        if self.vllm_max_model_len < 1:
            raise ConfigError(f"vllm_max_model_len={self.vllm_max_model_len} must be >= 1")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype={self.dtype!r} must be one of 'auto', 'bfloat16', 'float16', 'float32'")
