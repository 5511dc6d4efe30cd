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

Refused when the config is built (``AsyncGRPOConfig``, :mod:`trainer.config`), each with the fix: DeepSpeed,
context, sequence and tensor parallelism (``parallelism_config`` with ``cp_size``/``sp_size``/
``tp_size`` > 1; a rank's row is a whole packed tree, which none of them can split), FSDP1
(``fsdp_config`` ``version`` 1) and ``fsdp`` options that exist only for FSDP1 (``hybrid_shard``...).

accelerate enables FSDP only for GPU-like distributed types; :func:`enable_fsdp_on_cpu` turns the
same plugin on for a multi-process CPU run (gloo), where ``fully_shard`` works as well, so that
sharded training is exercised by the CPU test-suite exactly as it runs on GPUs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["enable_fsdp_on_cpu"]

def enable_fsdp_on_cpu(accelerator: Any, plugin_args: dict[str, Any] | None) -> bool:
    """Turn on accelerate's FSDP2 path for a multi-process CPU run; returns whether it did.

    accelerate builds its FSDP plugin only for GPU-like distributed types and leaves a ``MULTI_CPU``
    run unsharded, silently. ``fully_shard`` runs on a CPU device mesh with gloo, so the same plugin
    is installed on the accelerator's state, with the mixed precision the run asked for: from the
    config's ``fsdp`` fields (``plugin_args``), else from an accelerate config file (``accelerate
    launch`` exports it as ``ACCELERATE_USE_FSDP`` and ``FSDP_*``, which the plugin reads).
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, parse_flag_from_env

    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    if plugin_args is not None:
        plugin = FullyShardedDataParallelPlugin(**plugin_args)
    elif parse_flag_from_env("ACCELERATE_USE_FSDP"):
        plugin = FullyShardedDataParallelPlugin()
    else:
        return False
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # Every later AcceleratorState() copies the process state's type over its own: set it there too,
    # as accelerate's own FSDP set-up does.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True

