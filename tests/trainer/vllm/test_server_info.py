"""Reading what the vLLM server is, once, against an HTTP server on loopback that answers vLLM's routes
(the real server's answers are checked in the vLLM tier: ``tests/toolgym/test_vllm_server.py``)."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from trainer.exceptions import VLLMServerError
from trainer.launch.vllm_server import free_port
from trainer.vllm import server_info
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.server_info import LoRALimits, ServerInfo, read_server_info

# The shapes of vLLM 0.32's answers, cut to what is read.
MODELS = {"data": [{"id": "adapter-v1", "parent": "org/base", "max_model_len": 2048},
                   {"id": "org/base", "parent": None, "max_model_len": 2048}]}
SERVER_INFO = {
    "vllm_config": {
        "model_config": {"served_model_name": None, "dtype": "torch.bfloat16", "max_model_len": 2048,
                         "logprobs_mode": "processed_logprobs", "max_logprobs": 20, "return_sampling_mask": False},
        "lora_config": {"max_loras": 3, "max_lora_rank": 16},
        "weight_transfer_config": {"backend": "nccl"},
    },
    "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True},
}
METRICS = ('vllm:cache_config_info{block_size="16",num_cpu_blocks="None",num_gpu_blocks="512"} 1.0\n'
           'vllm:kv_cache_usage_perc{engine="0"} 0.0\n')


class _VLLMRoutes(BaseHTTPRequestHandler):
    hits: Counter[str]
    routes: dict[str, Any]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        self.hits[path] += 1
        if path not in self.routes:
            self.send_error(404)
            return
        answer = self.routes[path]
        body = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def fake_vllm(port: int, routes: dict[str, Any]) -> Iterator[Counter[str]]:
    """Serve ``routes`` (path -> JSON or text) on ``port``; yields the hits per path."""
    hits: Counter[str] = Counter()
    handler = type("Handler", (_VLLMRoutes,), {"hits": hits, "routes": routes})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_one_get_of_each_route_gives_every_field() -> None:
    port = free_port()
    with fake_vllm(port, {"/v1/models": MODELS, "/server_info": SERVER_INFO, "/metrics": METRICS}) as hits:
        info = read_server_info(VLLMAdminClient(f"http://127.0.0.1:{port}", timeout_s=10))
    assert info == ServerInfo(model="org/base", max_model_len=2048, dtype="bfloat16", kv_cache_tokens=512 * 16,
                              logprobs_mode="processed_logprobs", max_logprobs=20,
                              lora=LoRALimits(max_loras=3, max_lora_rank=16, runtime_loading=True),
                              weight_transfer_backend="nccl")
    assert hits == Counter({"/v1/models": 1, "/server_info": 1, "/metrics": 1})


def test_outside_dev_mode_the_flags_count_as_off() -> None:
    port = free_port()
    with fake_vllm(port, {"/v1/models": MODELS}) as hits:
        info = read_server_info(VLLMAdminClient(f"http://127.0.0.1:{port}", timeout_s=10))
    assert info == ServerInfo(model="org/base", max_model_len=2048)
    assert hits == Counter({"/v1/models": 1, "/server_info": 1, "/metrics": 1})


def test_a_server_that_is_not_up_is_waited_for_and_the_wait_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server_info, "FIRST_WAIT_LOG_S", 0.0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logged = threading.Event()

    class Starter(logging.Handler):
        """Starts the server once the wait was logged: the reader must go on waiting and then read it."""

        def emit(self, record: logging.LogRecord) -> None:
            logged.set()

    started: list[Counter[str]] = []

    def serve_when_logged() -> None:
        logged.wait(30)
        with fake_vllm(port, {"/v1/models": MODELS, "/server_info": SERVER_INFO, "/metrics": METRICS}) as hits:
            started.append(hits)
            done.wait(60)

    done = threading.Event()
    logger = logging.getLogger(server_info.__name__)
    starter = Starter(level=logging.WARNING)
    logger.addHandler(starter)
    thread = threading.Thread(target=serve_when_logged)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger=server_info.__name__):
            info = read_server_info(VLLMAdminClient(url, timeout_s=60))
    finally:
        done.set()
        thread.join()
        logger.removeHandler(starter)
    assert info.model == "org/base"
    assert started and started[0] == Counter({"/v1/models": 1, "/server_info": 1, "/metrics": 1})
    assert any(f"waiting for the vLLM server at {url} to answer GET /v1/models" in r.getMessage()
               for r in caplog.records)


def test_no_server_at_all_fails_after_the_timeout_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(VLLMServerError, match=f"could not reach the vLLM server at {url}.*waited 1 s"):
        read_server_info(VLLMAdminClient(url, timeout_s=60), wait_s=1)
