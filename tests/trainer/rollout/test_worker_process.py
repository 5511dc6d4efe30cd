"""The rollout worker process's lifecycle, with a stand-in loop (no vLLM server is needed to fill a queue)."""

from __future__ import annotations

import multiprocessing as mp
import time

from trainer.rollout.settings import RolloutSettings
from trainer.rollout.worker import RolloutWorker, WorkerChannels
from trainer.vllm.server_info import ServerInfo


class FloodingLoop:
    """Puts more on the group and metric queues than their pipes hold, then waits for the stop event.

    Module level: it must pickle into the spawned process.
    """

    def __init__(self, settings: RolloutSettings, channels: WorkerChannels, items: int) -> None:
        self.channels = channels
        self.items = items

    async def run(self) -> None:
        import asyncio

        for _ in range(self.items):  # 64 x 256 KiB: far past a pipe's 64 KiB, nobody reads them
            self.channels.rollout_buffer.put(b"x" * 256 * 1024)
            self.channels.metrics_queue.put([b"y" * 1024])
        while not self.channels.stop.is_set():
            await asyncio.sleep(0.01)


def test_stop_lets_a_worker_with_unread_queues_exit_by_itself() -> None:
    ctx = mp.get_context("spawn")
    channels = WorkerChannels.create(ctx, initial_allowance=0, initial_version=0)
    settings = RolloutSettings(model_name="unused", vllm_server_base_url="http://127.0.0.1:9",
                               server=ServerInfo(model="unused", max_model_len=64))
    worker = RolloutWorker(FloodingLoop, settings, {"items": 64}, channels, timeout_s=60, ctx=ctx)  # type: ignore[arg-type]
    worker.start()
    deadline = time.monotonic() + 60
    while channels.rollout_buffer.empty() and time.monotonic() < deadline:  # it has started sending
        time.sleep(0.05)
    assert not channels.rollout_buffer.empty(), "the worker sent nothing"
    t0 = time.monotonic()
    worker.stop(timeout_s=30)
    # Its feeder threads could flush, so it returned from run() and exited with 0: not terminated
    # (-15) or killed (-9) at the end of the 30 s it was given.
    assert worker.process.exitcode == 0
    assert time.monotonic() - t0 < 30
