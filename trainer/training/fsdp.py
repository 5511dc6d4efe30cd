"""Sharded training: FSDP2 through accelerate, and the parallelism the trainer refuses.

Sharded training is FSDP2 (``torch.distributed.fsdp.fully_shard``) driven by accelerate, chosen in
either of the two usual ways:

* ``AsyncGRPOConfig(fsdp="full_shard", fsdp_config={"version": 2, ...})`` (the TrainingArguments
  fields; ``fsdp=True`` too), under ``torchrun`` or ``accelerate launch``;
* an accelerate config file with ``distributed_type: FSDP`` and ``fsdp_version: 2``, under
  ``accelerate launch --config_file ...`` (accelerate passes it on as ``ACCELERATE_USE_FSDP`` /
  ``FSDP_VERSION`` in the environment).

Everything else about the step stays as it is without sharding: rank 0 runs the rollout worker and
feeds each rank its row (:mod:`trainer.training.distributed`), gradients are reduce-scattered with
the same averaging as DDP's all-reduce, and the weight sync gathers full tensors from the shards
(:mod:`trainer.sync.gather`). Under mixed precision (``bf16=True``, the default on GPUs) accelerate
upcasts every trainable parameter to float32 before sharding, so the master weights and the
optimizer state are float32 whatever ``dtype`` says, while forward and backward run in bf16.

Refused at construction (:func:`refuse_unsupported_parallelism`), each with the fix: DeepSpeed,
context, sequence and tensor parallelism (``parallelism_config`` with ``cp_size``/``sp_size``/
``tp_size`` > 1; a rank's row is a whole packed tree, which none of them can split), FSDP1
(``fsdp_config`` ``version`` 1) and ``fsdp`` options that exist only for FSDP1 (``hybrid_shard``...).

accelerate enables FSDP only for GPU-like distributed types; :func:`enable_fsdp_on_cpu` turns the
same plugin on for a multi-process CPU run (gloo), where ``fully_shard`` works as well, so that
sharded training is exercised by the CPU test-suite exactly as it runs on GPUs.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.exceptions import ConfigError

__all__ = ["FSDP2_OPTIONS", "enable_fsdp_on_cpu", "is_sharded", "refuse_unsupported_parallelism"]

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


def refuse_unsupported_parallelism(args: Any) -> None:
    """Raise :class:`ConfigError` for parallelism this trainer does not support (see the module docstring).

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


def enable_fsdp_on_cpu(accelerator: Any, plugin_args: dict[str, Any] | None) -> bool:
    """Turn on accelerate's FSDP2 path for a multi-process CPU run; returns whether it did.

    accelerate builds its FSDP plugin only for GPU-like distributed types and leaves a ``MULTI_CPU``
    run unsharded, silently. ``fully_shard`` runs on a CPU device mesh with gloo, so the same plugin
    (from the config's ``fsdp`` fields) is installed on the accelerator's state, with the mixed
    precision the run asked for.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if plugin_args is None or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # Every later AcceleratorState() copies the process state's type over its own: set it there too,
    # as accelerate's own FSDP set-up does.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def is_sharded(model: Any) -> bool:
    """Whether any parameter of ``model`` is a DTensor shard (FSDP2 prepared it)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
