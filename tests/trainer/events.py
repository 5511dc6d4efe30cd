"""Waiting for events in trainer runs instead of hoping a fixed number of steps shows them.

Which step logs a worker-side event (a stale sample, a blocked producer, a curriculum skip, a reward
timeout) depends on how the trainer, the rollout worker and the vLLM server are scheduled: a run of
a fixed, small ``max_steps`` sees it on an idle machine and misses it on a loaded one. A test gives
the run a generous ``max_steps`` cap and stops it with :class:`StopOnceLogged` when the event came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback


class StopOnceLogged(TrainerCallback):
    """Stops training at the first log by which each of ``names`` has a non-zero total.

    Args:
        *names: Metric names to wait for (summed over the run's logs in ``totals``).
        min_steps: Do not stop before this many optimizer steps.
    """

    def __init__(self, *names: str, min_steps: int = 1) -> None:
        self.totals = {name: 0.0 for name in names}
        self.min_steps = min_steps
        self.stopped_at: int | None = None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        """Add this log's values; ask the trainer to stop once every name was seen."""
        for name in self.totals:
            self.totals[name] += (logs or {}).get(name, 0.0)
        if all(self.totals.values()) and state.global_step >= self.min_steps and self.stopped_at is None:
            self.stopped_at = state.global_step
            control.should_training_stop = True


class StopWhen(TrainerCallback):
    """Stops training at the end of the first optimizer step after which ``predicate()`` holds.

    Args:
        predicate: Checked at every step end (e.g. "the episode log shows both environments").
    """

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self.predicate = predicate
        self.stopped_at: int | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """Ask the trainer to stop once the predicate holds."""
        if self.stopped_at is None and self.predicate():
            self.stopped_at = state.global_step
            control.should_training_stop = True
