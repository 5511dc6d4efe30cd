"""What ``toolgym eval`` samples from: a running vLLM server, or one it starts on ``--model``.

``--model`` is a model directory (a training run's ``checkpoint-N`` folder is one), or a PEFT LoRA
adapter folder (it holds ``adapter_config.json``). An adapter is served on its base model
(``base_model_name_or_path``): a server started here gets ``--enable-lora`` and a
``--max-lora-rank`` that fits; on a running server (started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, as ``toolgym vllm MODEL --enable_lora`` does) it is loaded at
run time. Either way every request asks for it by name, as training's adapter-only sync does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.exceptions import ConfigError, VLLMServerError
from trainer.records import adapter_name

if TYPE_CHECKING:
    from toolgym.cli.eval import EvalArguments

__all__ = ["ADAPTER_NAME", "LORA_RANKS", "ServedModel", "served_model"]

ADAPTER_NAME = "toolgym-eval"
"""The adapter's name prefix on the server; requests ask for ``toolgym-eval-v0`` (policy version 0)."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM accepts."""
RUNNING_SERVER_WAIT_S = 30.0
"""How long a ``--vllm_server_base_url`` server may take to answer before the evaluation gives up."""


@dataclass(frozen=True)
class ServedModel:
    """The server an evaluation samples from.

    Attributes:
        base_url: The vLLM server.
        name: What is evaluated (the model directory, or the adapter folder).
        tokenizer: Where the tokenizer is loaded from (the adapter's folder when it holds one).
        lora_name: The adapter's name prefix on the server, ``None`` without an adapter.
    """

    base_url: str
    name: str
    tokenizer: str
    lora_name: str | None = None


def adapter_config(model: str) -> dict[str, object] | None:
    """``model``'s ``adapter_config.json`` when it is a PEFT adapter folder, else ``None``."""
    path = Path(model) / "adapter_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _tokenizer_source(model: str, base: str) -> str:
    return model if (Path(model) / "tokenizer_config.json").is_file() else base


def _load_adapter(base_url: str, model: str, timeout_s: float) -> None:
    from trainer.vllm.admin import VLLMAdminClient

    body = {"lora_name": adapter_name(ADAPTER_NAME, 0), "lora_path": str(Path(model).resolve())}
    try:
        VLLMAdminClient(base_url, timeout_s=timeout_s).request("POST", "/v1/load_lora_adapter", body)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"the server at {base_url} did not load the adapter {model}: start it with LoRA enabled "
                          f"(toolgym vllm BASE_MODEL --enable_lora --max_lora_rank R); {exc}") from exc


def _check_running(base_url: str) -> None:
    from trainer.vllm.admin import VLLMAdminClient
    from trainer.vllm.server_info import read_server_info

    try:
        read_server_info(VLLMAdminClient(base_url, timeout_s=RUNNING_SERVER_WAIT_S))
    except VLLMServerError as exc:
        raise VLLMServerError(f"no vLLM server answers at {base_url} (waited {RUNNING_SERVER_WAIT_S:g} s): start "
                              "one (toolgym vllm MODEL), or leave out --vllm_server_base_url to serve --model here",
                              exc.message) from None


@contextlib.contextmanager
def served_model(args: EvalArguments, output_dir: Path) -> Iterator[ServedModel]:
    """The server for ``args``: the running one at ``--vllm_server_base_url``, else one started on
    ``--model`` for as long as the ``with`` block lasts (its log in ``output_dir/vllm.log``).

    Raises:
        ConfigError: ``--model`` is not a directory (and no server is given), or an adapter's base model
            is not one.
        VLLMServerError: The server did not start, or a running one does not answer within
            :data:`RUNNING_SERVER_WAIT_S`.
    """
    adapter = adapter_config(args.model) if args.model else None
    base = str(adapter.get("base_model_name_or_path") or "") if adapter else args.model
    lora_name = ADAPTER_NAME if adapter else None
    if args.vllm_server_base_url is not None:
        _check_running(args.vllm_server_base_url)
        if adapter:
            _load_adapter(args.vllm_server_base_url, args.model, args.vllm_server_timeout)
        tokenizer = _tokenizer_source(args.model, base) if args.model else ""
        yield ServedModel(args.vllm_server_base_url, args.model, tokenizer, lora_name)
        return
    for what, path in (("--model", args.model), ("the adapter's base model", base)):
        if not Path(path).is_dir():
            raise ConfigError(f"{what} {path!r} is not a model directory: give a folder holding config.json and the "
                              "weights (a training run's checkpoint-N folder works), or --vllm_server_base_url of a "
                              "server that serves it")
    from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig

    rank = int(str(adapter.get("r", 16))) if adapter else 0
    config = VLLMServerConfig(model=base, max_model_len=args.vllm_max_model_len, log_path=str(output_dir / "vllm.log"),
                              enable_lora=adapter is not None,
                              max_lora_rank=min(r for r in LORA_RANKS if r >= rank) if adapter else None)
    output_dir.mkdir(parents=True, exist_ok=True)
    with VLLMServer(config) as server:
        print(f"vLLM server on {base} ready at {server.base_url} in {server.ready_s:.0f} s")
        if adapter:
            _load_adapter(server.base_url, args.model, args.vllm_server_timeout)
        yield ServedModel(server.base_url, args.model, _tokenizer_source(args.model, base), lora_name)
