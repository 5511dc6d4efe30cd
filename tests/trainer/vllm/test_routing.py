"""Routing rollouts over several servers by load (:class:`trainer.vllm.routing.ServerRouter`)."""

from __future__ import annotations

import random

import pytest

from trainer.exceptions import VLLMServerError
from trainer.vllm.prometheus import ServerLoad
from trainer.vllm.routing import ServerRouter

URLS = ("http://a:8000", "http://b:8000")


def _load(waiting: float = 0.0, kv: float = 0.0) -> ServerLoad:
    return ServerLoad(kv_cache_usage=kv, running=0.0, waiting=waiting, preemptions=0.0)


def test_equal_servers_share_rollouts_within_a_fifth_of_even() -> None:
    router = ServerRouter(URLS)
    for i in range(2):
        router.observe(i, _load(), cap=8)
    rng = random.Random(0)
    live: list[int] = []
    for _ in range(1000):  # rollouts of random lengths: each step one starts, some end
        i = router.pick()
        router.started(i)
        live.append(i)
        while live and rng.random() < 0.5:
            router.finished(live.pop(rng.randrange(len(live))))
    even = sum(router.routed) / 2
    assert all(abs(n - even) <= 0.2 * even for n in router.routed), router.routed


def test_the_server_that_says_it_is_busier_gets_fewer() -> None:
    router = ServerRouter(URLS)
    router.observe(0, _load(waiting=6, kv=0.9), cap=8)
    router.observe(1, _load(), cap=8)
    picks = []
    for _ in range(8):
        picks.append(router.pick())
        router.started(picks[-1])
    assert picks.count(1) > picks.count(0)


def test_a_server_taken_out_gets_nothing_and_losing_the_last_is_the_error(caplog) -> None:
    router = ServerRouter(URLS)
    router.take_out(0, "connection refused")
    assert "taken out" in caplog.text
    assert {router.pick() for _ in range(5)} == {1}
    assert router.servers_lost == 1
    router.take_out(0, "again")  # counted once
    assert router.servers_lost == 1
    with pytest.raises(VLLMServerError, match=r"last vLLM server, http://b:8000, stopped answering: timed out"):
        router.take_out(1, "timed out")


def test_a_server_failing_for_down_after_s_is_taken_out_and_an_answer_resets_the_clock() -> None:
    now = [0.0]
    router = ServerRouter(URLS, down_after_s=5.0, clock=lambda: now[0])
    assert router.failed(0, "refused") is False
    now[0] = 4.0
    router.answered(0)
    now[0] = 6.0
    assert router.failed(0, "refused") is False  # the clock restarted at 6 s
    now[0] = 11.0
    assert router.failed(0, "refused") is True
    assert router.up == [False, True] and router.servers_lost == 1
