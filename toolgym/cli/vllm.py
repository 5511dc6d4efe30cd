"""``toolgym vllm``: start a vLLM server with the flags the trainer needs, until Ctrl-C.

::

    toolgym vllm MODEL [--port P] [--max_model_len N] [--enable_lora ...] [-- extra vllm serve flags]

The server is :class:`trainer.launch.vllm_server.VLLMServer` (the one ``launch_vllm`` starts for a run).
"""

from __future__ import annotations

import argparse
import sys
import time

from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """``toolgym vllm MODEL [--port P] [--max-model-len N] [-- extra vllm flags]``."""
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="toolgym vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model directory or id to serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max_model_len", "--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv_cache_gib", "--kv-cache-gib", type=int, default=1)
    parser.add_argument("--enable_lora", "--enable-lora", action="store_true",
                        help="serve LoRA adapters loaded at run time (adapter-only sync of a LoRA model)")
    parser.add_argument("--max_loras", "--max-loras", type=int, default=None,
                        help="with --enable-lora: at least max_staleness + 2")
    parser.add_argument("--max_lora_rank", "--max-lora-rank", type=int, default=None,
                        help="with --enable-lora: at least the LoRA rank")
    args = parser.parse_args(argv)
    config = VLLMServerConfig(
        model=args.model, host=args.host, port=args.port, max_model_len=args.max_model_len,
        dtype=args.dtype, kv_cache_gib=args.kv_cache_gib, enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        extra_args=extra,
    )
    server = VLLMServer(config)
    print(f"starting: {' '.join(config.command(server.port))}", flush=True)
    with server:
        print(f"vLLM ready at {server.base_url} after {server.ready_s:.1f} s (log: {server.log_path}); "
              "Ctrl-C stops it", flush=True)
        try:
            while server.alive():
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        if not server.alive():
            print(server.log_tail(), file=sys.stderr)
            return 1
    return 0
