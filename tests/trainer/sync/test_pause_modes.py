"""The weight sync's pause modes on the real vLLM CPU server, with requests running through the sync.

``"reset"`` (TRL's AsyncGRPOTrainer's ``/pause?mode=keep``, which clears the KV cache) preempts every running
request; ``"keep"`` (``clear_cache=false``) preempts none; ``"none"`` (the whole update in one
engine call) never pauses the server and preempts none. All finish every request in full.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.launch.vllm_server import VLLMServer
from trainer.sync import weight_synchronizer
from trainer.sync.weight_sync import WeightSynchronizer
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.prometheus import ServerLoad, parse_prometheus, server_load

REQUESTS = 6
LONG = 1000  # tokens per request (the session server's max_model_len is 1024): running when the sync comes


def _load(base_url: str) -> ServerLoad:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        return server_load(parse_prometheus(r.read().decode()))


def _streamed_completions(base_url: str, model: str, started: threading.Event) -> list[int]:
    """Stream ``REQUESTS`` long completions of one prompt; set ``started`` at the first token.

    One request with ``n=REQUESTS`` puts every sequence into the engine in the same step, so all are
    running together and each has ~a thousand tokens to go when the first one streams. (Six separate
    requests entered one by one as the API server got to them: under load the first had all but
    finished when the last began. And the ``/metrics`` running gauge is no start signal: under load
    the API server answered it late, once as late as the thousandth token.) Returns each
    sequence's number of streamed tokens.
    """
    body = {"model": model, "prompt": [5, 6, 7, 8], "n": REQUESTS, "max_tokens": LONG, "ignore_eos": True,
            "seed": 0, "logprobs": 0, "stream": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    tokens = [0] * REQUESTS
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            data = line.decode().removeprefix("data:").strip()
            if data and data != "[DONE]":
                for choice in json.loads(data)["choices"]:
                    tokens[choice["index"]] += len(choice["logprobs"]["tokens"])
                    started.set()
    return tokens


def _watch_paused(admin: VLLMAdminClient, seen: list[bool], stop: threading.Event) -> None:
    while not stop.is_set():
        seen.append(bool(admin.request("GET", "/is_paused")["is_paused"]))


def _sync_through_requests(base: str, model: str, sync: WeightSynchronizer, weights: list[Any],
                           version: int) -> tuple[int, list[bool], list[int]]:
    """Stream the long requests and sync once they run; returns how many still ran after the sync, what
    ``/is_paused`` said during it, and each request's streamed tokens."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        completions = pool.submit(_streamed_completions, base, model, started)
        while not started.wait(timeout=1):  # the first token: every sequence is running
            assert not completions.done(), completions.exception()
        paused: list[bool] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_paused, args=(VLLMAdminClient(base, timeout_s=30), paused, stop))
        watcher.start()
        try:
            sync.sync(weights, version=version)
        finally:
            stop.set()
            watcher.join()
        # Every sequence streamed before the sync; still going after it, each was running through it.
        running = 0 if completions.done() else REQUESTS
        return running, paused, completions.result(timeout=300)


@pytest.mark.parametrize(("mode", "preempts"), [("reset", True), ("keep", False), ("none", False)])
def test_sync_under_load(mode: str, preempts: bool, vllm_server: VLLMServer, tiny_model_dir: Path,
                         restore_served_weights: WeightSynchronizer) -> None:
    base = vllm_server.base_url
    admin = VLLMAdminClient(base, timeout_s=120)
    sync = weight_synchronizer(base, tiny_model_dir, pause_mode=mode)
    weights = list(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    model = admin.request("GET", "/v1/models")["data"][0]["id"]
    for attempt in range(1, 4):
        before = _load(base).preemptions
        running, paused, lengths = _sync_through_requests(base, model, sync, weights, attempt)
        assert lengths == [LONG] * REQUESTS
        preempted = _preempted_since(base, admin, model, before, running if preempts else 0)
        # Without a pause generation goes on, and a slow sync may outlast every request: that requests were
        # running at its start and the server never paused is what "none" shows. The other modes need
        # requests still running in the engine at the pause. "Still streaming after the sync" is the client's
        # view: on a loaded machine the engine can finish them while the API server is still streaming them
        # (the sync's staging outlasted them twice in full runs at load 5-13; once "reset" then counted no
        # preemption of 6 streaming requests): such an attempt proves nothing and is made again.
        if mode == "none" or (running and (preempted >= running or not preempts)):
            break
    if mode != "none":
        assert running, "in three attempts the requests finished during the sync: the test proves nothing"
    if mode == "none":  # (a pause of the other modes is too short to be seen by every poll)
        assert paused and not any(paused), f"the server paused during the sync: {paused}"
    assert preempted >= running if preempts else preempted == 0, f"{preempted} preempted, {running} running"


def _preempted_since(base: str, admin: VLLMAdminClient, model: str, before: float, expected: int) -> float:
    """Preemptions counted since ``before``, waiting up to 30 s for ``expected`` of them: the engine publishes
    its counters with a later step's stats, so an idle engine is given steps (one-token requests)."""
    deadline = time.monotonic() + 30
    while (preempted := _load(base).preemptions - before) < expected and time.monotonic() < deadline:
        admin.request("POST", "/v1/completions", {"model": model, "prompt": [5], "max_tokens": 1})
        time.sleep(0.2)
    return preempted
