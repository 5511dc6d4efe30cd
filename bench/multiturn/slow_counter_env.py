"""``IncrementEnv`` whose tool waits ``SLOW_COUNTER_MS`` milliseconds: a simulated tool latency.

Served by ``bench_multiturn.py`` with ``toolgym serve slow_counter_env:SlowCounterEnv``.
"""

from __future__ import annotations

import asyncio
import os

from environments.counter import IncrementEnv

DELAY_S = int(os.environ.get("SLOW_COUNTER_MS", "50")) / 1000


class SlowCounterEnv(IncrementEnv):
    """The counter, with a tool that takes ``SLOW_COUNTER_MS`` to answer (async: no thread held)."""

    async def increment(self, step: int) -> int:  # type: ignore[override]
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        await asyncio.sleep(DELAY_S)
        self.counter += step
        return self.counter
