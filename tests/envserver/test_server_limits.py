"""Limits that are on by default: capacity + wait queue, idle reaping, call deadline, no leaks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from tests.envserver.servers import ProbeEnv, health, http_get, make_server, request, wait_until, ws_url


def metric(server: Any, name: str, **labels: str) -> float:
    """The value of one sample of ``/metrics`` (0.0 when absent)."""
    text = http_get(server.url + "/metrics")[1].decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_full_server_queues_then_refuses_with_server_full():
    with make_server(max_sessions=2, max_waiting=1, queue_timeout=0.6) as srv:

        async def scenario():
            a = await websockets.connect(ws_url(srv, "counter"))
            b = await websockets.connect(ws_url(srv, "counter"))
            await a.recv(), await b.recv()
            queued = await websockets.connect(ws_url(srv, "counter"))
            await asyncio.sleep(0.1)
            waiting = health(srv)["waiting"]
            async with websockets.connect(ws_url(srv, "counter")) as refused:
                full = json.loads(await refused.recv())
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(queued.recv(), 0.1)  # still queued: no hello yet
            await request(a, 1, "close")
            hello = json.loads(await asyncio.wait_for(queued.recv(), 2))
            async with websockets.connect(ws_url(srv, "counter")) as late:  # waits 0.6 s, then gives up
                timed_out = json.loads(await late.recv())
            for ws, rid in ((b, 1), (queued, 1)):
                await request(ws, rid, "close")
            return waiting, full, hello, timed_out

        waiting, full, hello, timed_out = asyncio.run(scenario())
        assert waiting == 1
        assert full["op"] == "bye" and full["error"]["code"] == "server_full"
        assert hello["op"] == "hello"
        assert timed_out["error"]["code"] == "server_full" and "within 0.6 s" in timed_out["error"]["message"]
        assert metric(srv, "toolgym_sessions_rejected_total", reason="server_full") == 2
        assert health(srv)["sessions"] == 0


def test_idle_sessions_are_reaped_and_counted():
    # 1.5 s: long enough that a loaded CI machine still gets the reset in before the reaper runs.
    with make_server(idle_timeout=1.5) as srv:

        async def scenario():
            async with websockets.connect(ws_url(srv, "counter")) as ws:
                await ws.recv()
                await request(ws, 1, "reset")
                bye = json.loads(await asyncio.wait_for(ws.recv(), 15))
                with pytest.raises(websockets.ConnectionClosed):
                    await ws.recv()
            return bye

        bye = asyncio.run(scenario())
        assert bye["op"] == "bye" and bye["error"]["code"] == "session_evicted" and "idle" in bye["error"]["message"]
        assert metric(srv, "toolgym_sessions_evicted_total", env="counter", reason="idle") == 1
        assert metric(srv, "toolgym_sessions_open", env="counter") == 0


def test_call_deadline_fails_the_call_not_the_session():
    with make_server(call_timeout=0.3) as srv:

        async def scenario():
            async with websockets.connect(ws_url(srv, "probe")) as ws:
                await ws.recv()
                await request(ws, 1, "reset")
                async_late = await request(ws, 2, "call", tool="anap", args={"seconds": 2})
                after_async = await request(ws, 3, "call", tool="echo", args={"text": "a"})
                sync_late = await request(ws, 4, "call", tool="nap", args={"seconds": 0.6})
                busy = await request(ws, 5, "call", tool="echo", args={"text": "b"})
                await asyncio.sleep(0.5)
                recovered = await request(ws, 6, "call", tool="echo", args={"text": "c"})
                await request(ws, 7, "close")
            return async_late, after_async, sync_late, busy, recovered

        async_late, after_async, sync_late, busy, recovered = asyncio.run(scenario())
        assert async_late["error"]["code"] == "call_timeout"
        assert after_async["result"] == "a"
        assert sync_late["error"]["code"] == "call_timeout"
        assert busy["error"]["code"] == "session_busy"
        assert recovered["result"] == "c"
        assert metric(srv, "toolgym_requests_total", env="probe", op="call", tool="anap", outcome="call_timeout") == 1


async def _others_progress_during_a_nap(server: Any, seconds: float = 5.0) -> tuple[bool, dict[str, Any]]:
    """Run ``nap(seconds)`` on one session and 20 echo calls on another; whether they all finished first."""
    async with websockets.connect(ws_url(server, "probe")) as slow, \
               websockets.connect(ws_url(server, "probe")) as fast:
        await slow.recv(), await fast.recv()
        await slow.send(json.dumps({"id": 1, "op": "call", "tool": "nap", "args": {"seconds": seconds}}))
        slow_reply_task = asyncio.ensure_future(slow.recv())
        for rid in range(1, 21):
            assert (await request(fast, rid, "call", tool="echo", args={"text": "x"}))["ok"]
        # Ordering, not timing: the other session's 20 calls all finished while the nap ran.
        fast_done_first = not slow_reply_task.done()
        slow_reply = json.loads(await slow_reply_task)
        await request(slow, 2, "close"), await request(fast, 21, "close")
    return fast_done_first, slow_reply


def test_slow_tool_does_not_block_other_sessions():
    with make_server(call_timeout=30.0) as srv:  # a 5 s nap, well inside the call deadline
        fast_done_first, slow_reply = asyncio.run(_others_progress_during_a_nap(srv))
    assert fast_done_first
    assert slow_reply["result"] == "rested"


def test_a_cheap_tool_runs_inline_until_it_runs_long_then_goes_back_to_the_pool():
    """Adaptive inlining: a sync tool proven cheap runs on the loop; one long run sends it back."""
    async def warm_up_then_one_long_run(server: Any) -> tuple[bool, bool]:
        async with websockets.connect(ws_url(server, "probe")) as ws:
            await ws.recv()
            rid = 0
            while not policy.inline(ProbeEnv.nap) and rid < 500:  # cheap naps until it is inlined
                rid += 1
                assert (await request(ws, rid, "call", tool="nap", args={"seconds": 0}))["ok"]
            inlined = policy.inline(ProbeEnv.nap)
            assert (await request(ws, rid + 1, "call", tool="nap", args={"seconds": 0.05}))["ok"]
            demoted = not policy.inline(ProbeEnv.nap)
            await request(ws, rid + 2, "close")
        return inlined, demoted

    with make_server(call_timeout=30.0, inline_threshold=0.001) as srv:
        policy = srv.table.pools["probe"].policy  # read for assertions only (it belongs to the server's loop)
        inlined, demoted = asyncio.run(warm_up_then_one_long_run(srv))
        fast_done_first, slow_reply = asyncio.run(_others_progress_during_a_nap(srv))
    assert inlined and demoted
    assert fast_done_first and slow_reply["result"] == "rested"


def test_many_concurrent_sessions_are_isolated(server):
    async def one(index: int) -> tuple[float, float]:
        async with websockets.connect(ws_url(server, "counter")) as ws:
            await ws.recv()
            target = index % 5 + 1
            await request(ws, 1, "reset", kwargs={"target": target})
            for rid in range(2, 2 + target):
                await request(ws, rid, "call", tool="increment", args={"step": 1})
            hit = (await request(ws, 100, "reward"))["result"]
            await request(ws, 101, "call", tool="increment", args={"step": 1})
            miss = (await request(ws, 102, "reward"))["result"]
            await request(ws, 103, "close")
        return hit, miss

    async def scenario():
        return await asyncio.gather(*(one(i) for i in range(128)))

    results = asyncio.run(scenario())
    assert results == [(1.0, 0.0)] * 128
    assert wait_until(lambda: health(server)["sessions"] == 0)


_KILLED_CLIENTS = textwrap.dedent("""
    import asyncio, json, sys
    import websockets

    async def one(url):
        ws = await websockets.connect(url)
        await ws.recv()
        await ws.send(json.dumps({"id": 1, "op": "call", "tool": "nap", "args": {"seconds": 1.5}}))
        await asyncio.sleep(30)

    async def main():
        tasks = [asyncio.create_task(one(sys.argv[1])) for _ in range(int(sys.argv[2]))]
        await asyncio.sleep(0.5)
        print("calling", flush=True)
        await asyncio.gather(*tasks)

    asyncio.run(main())
""")


def test_churn_with_clients_killed_mid_call_leaves_no_session():
    with make_server(resume_grace=0.3, threads=64) as srv:

        async def churn() -> None:
            async def cycle(index: int) -> None:
                ws = await websockets.connect(ws_url(srv, "probe"))
                await ws.recv()
                await request(ws, 1, "reset")
                if index % 3 == 0:  # killed mid-call: the socket vanishes without a close
                    await ws.send(json.dumps({"id": 2, "op": "call", "tool": "nap", "args": {"seconds": 0.2}}))
                    ws.transport.abort()
                elif index % 3 == 1:  # dropped between calls
                    ws.transport.abort()
                else:
                    await request(ws, 2, "call", tool="echo", args={"text": "x"})
                    await request(ws, 3, "close")
            for start in range(0, 150, 50):
                await asyncio.gather(*(cycle(i) for i in range(start, start + 50)))

        killed = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENTS, ws_url(srv, "probe"), "40"],
                                  stdout=subprocess.PIPE, text=True)
        assert killed.stdout is not None and killed.stdout.readline().strip() == "calling"
        asyncio.run(churn())
        killed.kill()
        killed.wait()
        assert wait_until(lambda: health(srv)["sessions"] == 0, timeout=10)
        assert metric(srv, "toolgym_sessions_open", env="probe") == 0
        assert metric(srv, "toolgym_sessions_total", env="probe") == 190
        assert metric(srv, "toolgym_sessions_evicted_total", env="probe", reason="expired") == 140
