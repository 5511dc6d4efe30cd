"""The trainer's own callback: what happens around each optimizer step of an :class:`AsyncGRPOTrainer`.

``transformers.Trainer`` owns the step loop; this callback hooks into it for what the asynchronous
pipeline adds: step timing, the non-finite step guard and the gradient spike clip, the weight sync
every ``weight_sync_steps`` applied steps, the staleness allowance and metrics at the step's end, and
the stop once the epochs counted in trained prompts are done.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from trainer.rollout.prompt_order import is_stream
from trainer.training.batching import FORWARDED_PER_STEP, UNPACKED_PER_STEP
from trainer.training.flops import matmul_dtype, peak_flops

if TYPE_CHECKING:
    from trainer.async_grpo_trainer import AsyncGRPOTrainer

__all__ = ["PipelineCallback"]


class PipelineCallback(TrainerCallback):
    """Step timing, the step guard, weight sync, allowance updates and the epoch stop, around each optimizer step.

    Args:
        trainer: The trainer it serves (it reads and sets the trainer's pipeline state).
    """

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer
        self._step_start = time.perf_counter()
        self._opt_start = 0.0
        self._applied_since_sync = 0  # optimizer steps applied (not skipped by the step guard) since the last sync

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.trainer._start_sharded()
        self._step_start = time.perf_counter()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.trainer._step_fwd_bwd_s = self.trainer._step_fwd_s = self.trainer._step_flops = 0.0
        self.trainer._step_groups = set()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.trainer._policy_sync.wait(block=False)  # the optimizer is about to change the weights it reads
        t = self.trainer
        if t._step_guard.check(t.model, state.global_step + 1):
            t.metrics.add("batch/skipped_nonfinite_step_count", 1)
        else:
            self._applied_since_sync += 1
            if t._spike_clip is not None:
                norm, bound = t._spike_clip.clip(t.model)
                t.metrics.add("batch/grad_spike_clipped_count", float(norm > bound))
                if bound < float("inf"):
                    t.metrics.add("batch/grad_norm_to_median", norm * t._spike_clip.factor / bound)
        self._opt_start = time.perf_counter()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.trainer.metrics.add("perf/optimizer_s", time.perf_counter() - self._opt_start)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        t = self.trainer
        # Skipped steps change nothing: a sync after only those would send the same weights as a new version.
        if state.global_step % args.weight_sync_steps == 0 and self._applied_since_sync:
            self._applied_since_sync = 0
            t._requested_version += 1  # not _policy_version + 1: an overlapped sync publishes it later
            t._policy_sync.sync(t._requested_version, overlap=True)
        self._record_step(t, time.perf_counter() - self._step_start)
        self._step_start = time.perf_counter()
        if not t._explicit_max_steps and t._step_feed_state.epoch_done:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.trainer._policy_sync.wait()  # the last step's sync: its error is the run's

    def _record_step(self, t: AsyncGRPOTrainer, step_s: float) -> None:
        """The step's metrics, the worker's new token allowance and the epoch reached."""
        args = t.args
        consumed, wait_s, per_step = t.stream.take_step_stats() if t.stream is not None else (0, 0.0, {})
        if t.worker is not None and t._allowance is not None and consumed > 0:  # docs/pipeline.md
            t.worker.channels.token_allowance.value = t._allowance.after_step(
                consumed, int(per_step.get(UNPACKED_PER_STEP, 0)), int(per_step.get(FORWARDED_PER_STEP, 0)))
        forwarded, trained = t._step_tokens
        t._step_tokens = (0, 0)
        t._num_tokens += forwarded
        m = t.metrics
        for name, value in per_step.items():
            m.add(name, value)
        m.add("batch/microbatches_per_step", args.gradient_accumulation_steps)
        m.add("perf/step_s", step_s)
        m.add("perf/rollout_wait_s", wait_s)
        m.add("perf/weight_sync_wait_s", t._policy_sync.take_wait_s())
        m.add("perf/fwd_bwd_s", t._step_fwd_bwd_s)
        m.add("perf/fwd_s", t._step_fwd_s)
        m.add("batch/groups_per_step", len(t._step_groups))
        if t._compile_tracker is not None:
            compile_s, compiles = t._compile_tracker.take()
            m.add("perf/compile_s", compile_s)
            m.add("perf/compile_count", compiles)
        m.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, t._step_fwd_bwd_s)
        m.add_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        m.add_rate("perf/wall_clock_trained_tokens_per_s", trained, step_s)
        peak = self._peak_flops(t)
        if peak and t._step_flops:  # trainer.training.flops: every row's FLOPs over every device's peak
            devices_peak = peak * t.accelerator.num_processes
            m.add_rate("perf/fwd_bwd_mfu", t._step_flops / devices_peak, t._step_fwd_bwd_s)
            m.add_rate("perf/wall_clock_mfu", t._step_flops / devices_peak, step_s)
        if t.worker is not None:
            m.add_records(t.worker.drain_metrics())
        if t.rollout_dataset is not None:
            size = (len(t.rollout_dataset) if not is_stream(t.rollout_dataset)
                    else t.worker.epoch_size() if t.worker is not None else None)
            done = t._step_feed_state.first_untrained
            if t.stream is not None and t.stream.stop_position is not None:
                done = min(done, t.stream.stop_position)  # prompts past the epoch limit are not trained
            if size:
                t.state.epoch = done / size

    @staticmethod
    def _peak_flops(t: AsyncGRPOTrainer) -> float | None:
        """One training device's peak FLOP/s at the precision its matmuls run in (None: unknown, warned)."""
        if t._flop_model is None:
            return None
        dtype = matmul_dtype(next(t.model.parameters()).dtype, t.accelerator.mixed_precision)
        return peak_flops(t.args.device, dtype)
