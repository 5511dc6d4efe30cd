"""The weight sync's pause modes on the real vLLM CPU server, with requests running through the sync.

``"reset"`` (the source's ``/pause?mode=keep``, which clears the KV cache) preempts every running
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

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolgym.launch.vllm_server import VLLMServer
from trainer.rollout.sampler_client import ServerLoad, parse_prometheus, server_load
from trainer.sync.weight_sync import (
    SharedMemorySender,
    VLLMAdminClient,
    WeightSynchronizer,
    checkpoint_manifest,
)

REQUESTS = 6
LONG = 1000  # tokens per request (the session server's max_model_len is 1024): running when the sync comes


def _load(base_url: str) -> ServerLoad:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        return server_load(parse_prometheus(r.read().decode()))


def _long_completion(base_url: str, model: str, i: int) -> int:
    body = {"model": model, "prompt": [5, 6, 7, 8 + i], "max_tokens": LONG, "ignore_eos": True, "seed": i}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return int(json.load(r)["usage"]["completion_tokens"])


def _watch_paused(admin: VLLMAdminClient, seen: list[bool], stop: threading.Event) -> None:
    while not stop.is_set():
        seen.append(bool(admin.request("GET", "/is_paused")["is_paused"]))


@pytest.mark.parametrize(("mode", "preempts"), [("reset", True), ("keep", False), ("none", False)])
def test_sync_under_load(mode: str, preempts: bool, vllm_server: VLLMServer, tiny_model_dir: Path,
                         restore_served_weights: WeightSynchronizer) -> None:
    base = vllm_server.base_url
    admin = VLLMAdminClient(base, timeout_s=120)
    sync = WeightSynchronizer(admin, SharedMemorySender(admin), checkpoint_manifest(tiny_model_dir), pause_mode=mode)
    weights = list(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    model = admin.request("GET", "/v1/models")["data"][0]["id"]
    with ThreadPoolExecutor(REQUESTS) as pool:
        futures = [pool.submit(_long_completion, base, model, i) for i in range(REQUESTS)]
        # Sync as soon as requests hold KV blocks (waiting for all of them races their end on a fast
        # machine); the ones running then are what the pause mode may preempt.
        deadline = time.monotonic() + 120
        while (load := _load(base)).running < 1:
            assert time.monotonic() < deadline, "no request ever ran"
            time.sleep(0.02)
        before, running = load.preemptions, load.running
        paused: list[bool] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_paused, args=(VLLMAdminClient(base, timeout_s=30), paused, stop))
        watcher.start()
        try:
            sync.sync(weights, version=1)
        finally:
            stop.set()
            watcher.join()
        if mode != "none":  # without a pause generation goes on, and a slow sync may outlast every request;
            # that requests were running at its start and the server never paused is what "none" shows
            assert not any(f.done() for f in futures), "a request finished during the sync: the test proves nothing"
        if mode == "none":  # (a pause of the other modes is too short to be seen by every poll)
            assert paused and not any(paused), f"the server paused during the sync: {paused}"
        lengths = [f.result(timeout=300) for f in futures]
    assert lengths == [LONG] * REQUESTS
    # The engine publishes its counters with a later step's stats: read them once every request is done.
    deadline = time.monotonic() + 30
    while (preempted := _load(base).preemptions - before) < running and preempts and time.monotonic() < deadline:
        time.sleep(0.2)
    assert preempted >= running if preempts else preempted == 0
