"""FLOPs of a tree-packed training step and the device's peak: ``perf/fwd_bwd_mfu`` and ``perf/wall_clock_mfu``.

Model FLOPs of one packed row (forward + backward = 3 x forward; recomputation under gradient
checkpointing is not model work and is not counted), per decoder layer:

* the projections and the MLP: ``2 x matmul parameters`` per forwarded token (a token shared by
  several samples of the tree is forwarded, and counted, once). MoE layers count the experts a
  token is routed to (``num_experts_per_tok``) and the router;
* attention: ``4 x heads x head_dim`` per query-key pair *the tree allows* (``q.k`` and ``p.v``),
  which is ``PackedRow.attention_cost`` (sum over tokens of depth + 1), not ``tokens^2 / 2``;

plus the LM head, ``2 x hidden x vocab`` per *trained* token only: the fused head loss
(:func:`trainer.training.logprobs.head_loss_from_hidden`) computes logits for trained positions and
nothing else. Embedding lookups and norms are not matmuls and are not counted.

MFU divides these FLOPs by the step's seconds times the peak of every training device at the
precision the matmuls run in (bf16/fp16 under mixed precision, else the parameters' dtype). The
table holds dense (non-sparse) tensor-core peaks from the vendor's data sheets. An unknown device or
precision, or an architecture this model does not describe, gives ``None`` and one warning saying
why: the metric is then absent, never a guess.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from trainer.training.packing import PackedRow

__all__ = ["FlopModel", "SUPPORTED_MODEL_TYPES", "peak_flops", "row_flops"]

logger = logging.getLogger(__name__)

# model_type values whose decoder is the Llama shape this estimate describes (Qwen3-VL: its text model).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe",
                         "qwen3_vl_moe_text", "mistral")

# Dense peak FLOP/s per device, by the dtype the matmuls run in. Most specific name first (substring match).
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "tf32": 378e12, "float32": 51e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float16": 835e12, "tf32": 418e12, "float32": 60e12}),
    ("H100", {"bfloat16": 989e12, "float16": 989e12, "tf32": 494e12, "float32": 67e12}),
    ("H800", {"bfloat16": 989e12, "float16": 989e12, "tf32": 494e12, "float32": 67e12}),
    ("H200", {"bfloat16": 989e12, "float16": 989e12, "tf32": 494e12, "float32": 67e12}),
    ("GH200", {"bfloat16": 989e12, "float16": 989e12, "tf32": 494e12, "float32": 67e12}),
    ("A100", {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
    ("B200", {"bfloat16": 2250e12, "float16": 2250e12, "tf32": 1100e12}),
)
_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("perf/fwd_bwd_mfu and perf/wall_clock_mfu are not logged: %s", reason)


def matmul_dtype(param_dtype: torch.dtype, mixed_precision: str | None) -> str:
    """The precision the step's matmuls run in: the autocast dtype under mixed precision, else the
    parameters' (float32 as ``tf32`` when PyTorch lets matmuls use TF32)."""
    if mixed_precision in ("bf16", "fp16"):
        return "bfloat16" if mixed_precision == "bf16" else "float16"
    name = str(param_dtype).removeprefix("torch.")
    if name == "float32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return name


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense peak FLOP/s of one ``device`` at ``dtype`` (see :func:`matmul_dtype`); ``None`` with a
    warning when it is not known (a CPU, an unlisted GPU, a precision the table lacks)."""
    if device.type != "cuda":
        _warn_once(f"the training device is {device.type}, whose peak FLOP/s is not known")
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in _PEAKS:
        if key in name:
            if dtype in peaks:
                return peaks[dtype]
            _warn_once(f"no {dtype} peak is tabulated for {name}")
            return None
    _warn_once(f"the peak FLOP/s of {name!r} is not known (tabulated: {', '.join(k for k, _ in _PEAKS)})")
    return None


@dataclass(frozen=True)
class FlopModel:
    """Forward FLOPs per unit of a decoder-only model (see the module docstring).

    Attributes:
        per_token: Projection + MLP FLOPs of all layers per forwarded token.
        per_pair: Attention FLOPs of all layers per allowed query-key pair.
        per_trained: LM-head FLOPs per trained token.
    """

    per_token: float
    per_pair: float
    per_trained: float

    @classmethod
    def from_config(cls, config: Any) -> FlopModel | None:
        """The model of a transformers config (a VL config's ``text_config``); ``None`` with a warning
        for an architecture it does not describe."""
        text = getattr(config, "text_config", None) or config
        model_type = getattr(config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            _warn_once(f"the FLOP estimate does not describe model_type={model_type!r} "
                       f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
            return None
        d = text.hidden_size
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or d // heads
        attn = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2  # q, o and k, v
        experts = getattr(text, "num_experts", 0) or 0
        if experts:
            moe_every = getattr(text, "decoder_sparse_step", 1) or 1
            moe_mlp = 3 * d * text.moe_intermediate_size * text.num_experts_per_tok + d * experts
            dense_mlp = 3 * d * text.intermediate_size
            layers = text.num_hidden_layers
            sparse = [i for i in range(layers) if (i + 1) % moe_every == 0
                      and i not in set(getattr(text, "mlp_only_layers", []) or [])]
            mlp_total = len(sparse) * moe_mlp + (layers - len(sparse)) * dense_mlp
        else:
            mlp_total = text.num_hidden_layers * 3 * d * text.intermediate_size
        layers = text.num_hidden_layers
        return cls(per_token=2.0 * (layers * attn + mlp_total), per_pair=4.0 * layers * heads * head_dim,
                   per_trained=2.0 * d * text.vocab_size)

    def forward_flops(self, tokens: int, pairs: int, trained: int) -> float:
        """Forward FLOPs of ``tokens`` forwarded tokens, ``pairs`` allowed query-key pairs and ``trained``
        trained tokens."""
        return self.per_token * tokens + self.per_pair * pairs + self.per_trained * trained


def row_flops(model: FlopModel, row: PackedRow) -> float:
    """Model FLOPs of forward + backward on one packed row (3 x forward)."""
    return 3.0 * model.forward_flops(row.num_unique_tokens, row.attention_cost, row.num_trained)
