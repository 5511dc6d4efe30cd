"""The rollout worker's metrics: what the loop and its hooks record, and how it reaches the trainer.

Everything is recorded into one :class:`~trainer.metrics.RecordBuffer` (the built-in metrics and a
hook's own, :meth:`AsyncRolloutLoop.log_metric <trainer.rollout.loop.AsyncRolloutLoop.log_metric>`).
The records travel two ways: with the next scored group, through the one group queue, so the step
that trains a group logs the metrics recorded while it was made (:meth:`LoopTelemetry.put_group`);
and about once a second on the metrics queue (:meth:`LoopTelemetry.flush_forever`), with the
gauges sampled then (generation speed, retries, the score queue, the mean rollouts in flight).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from trainer.metrics import RecordBuffer
from trainer.records import QueuedGroup
from trainer.rollout.concurrency import AdaptiveCap
from trainer.rollout.tool_runner import ToolCallOutcome
from trainer.rollout.worker import WorkerChannels, require_channels
from trainer.vllm.prometheus import ServerLoad

if TYPE_CHECKING:
    from trainer.rollout.servers import ServerFleet

__all__ = ["LoopTelemetry", "METRICS_FLUSH_S"]

METRICS_FLUSH_S = 1.0


class LoopTelemetry:
    """Records the rollout loop's metrics and sends them to the trainer.

    Args:
        records: The loop's record buffer (hooks log into it too).
        channels: The worker's channels; ``None`` when the loop runs outside a worker (nothing is sent).
    """

    def __init__(self, records: RecordBuffer, channels: WorkerChannels | None) -> None:
        self.records = records
        self.channels = channels
        self.generated_tokens = 0  # completion tokens of the rollouts put in groups so far
        self._last_preemptions: float | None = None

    def put_group(self, queued: QueuedGroup) -> None:
        """Send a group to the trainer with the metric records logged since the last one (its reward
        metrics, a curriculum's skip counts...): the step that receives it logs them."""
        channels = require_channels(self.channels)
        queued.records = self.records.take()
        channels.queued_samples.value += len(queued.samples)
        channels.rollout_buffer.put(queued)

    def send_records(self) -> None:
        """Send what was recorded since the last send (nothing when nothing was)."""
        batch = self.records.take()
        if batch:
            require_channels(self.channels).metrics_queue.put(batch)

    def record_tool_call(self, outcome: ToolCallOutcome) -> None:
        """``tools/*``: one executed (or refused) tool call."""
        name = outcome.name or "<unparsed>"
        self.records.add(f"tools/{name}/call_count", 1)
        self.records.add(f"tools/{name}/failure_count", int(outcome.failed))
        self.records.add("tools/unknown_name_count", int(outcome.unknown))
        self.records.add_rate("tools/failure_frequency", int(outcome.failed), 1)
        if not outcome.unknown:
            self.records.add("tools/latency_s", outcome.latency_s)
            self.records.add(f"tools/{name}/latency_s", outcome.latency_s)

    def record_load(self, load: ServerLoad | None, cap: AdaptiveCap) -> None:
        """``rollout/vllm_*`` of one ``/metrics`` reading (``None``: unavailable) and the concurrency cap after it."""
        self.records.add("rollout/concurrency_cap", cap.limit)
        if load is None:
            return
        self.records.add("rollout/vllm_kv_cache_usage_frac", load.kv_cache_usage)
        self.records.add("rollout/vllm_running_requests", load.running)
        self.records.add("rollout/vllm_queued_requests", load.waiting)
        if self._last_preemptions is not None:
            self.records.add("rollout/vllm_preemption_count", max(load.preemptions - self._last_preemptions, 0))
        self._last_preemptions = load.preemptions

    async def flush_forever(self, sampler: ServerFleet, cap: AdaptiveCap, score_queue: asyncio.Queue[Any]) -> None:
        """Every ``METRICS_FLUSH_S``: sample the gauges and send everything recorded."""
        retries_sent = 0
        tokens_sent, t_last = 0, time.monotonic()
        while True:
            await asyncio.sleep(METRICS_FLUSH_S)
            now = time.monotonic()
            self.records.add("rollout/vllm_retry_count", sampler.retry_count - retries_sent)
            retries_sent = sampler.retry_count
            self.records.add_rate("rollout/generated_tokens_per_s", self.generated_tokens - tokens_sent, now - t_last)
            tokens_sent, t_last = self.generated_tokens, now
            self.records.add("rollout/score_queue_size", score_queue.qsize())
            self.records.add("rollout/concurrency", cap.take_mean_in_flight())
            self.send_records()
