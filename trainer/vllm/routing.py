"""Which of several vLLM servers takes the next rollout (:class:`ServerRouter`), and which are out.

A rollout is routed once, when it starts, and all its turns go to that server (its prefix cache
holds the conversation so far). The router picks the server with the least load, where a server's
load is what the worker knows now (its own rollouts in flight there) plus the requests the server
last said wait in its queue (``/metrics``), scaled by that server's concurrency cap::

    load_i = (in_flight_i + waiting_i) / cap_i

A slower server finishes its rollouts later, so more of them stay in flight there and it gets fewer
new ones. KV-cache use acts through the cap (it shrinks above 80 %: :mod:`trainer.rollout.concurrency`),
not as a term of its own: a reading is up to 5 s old, and with a large KV cache its differences
between equal servers (fractions of a percent) outweighed whole rollouts in flight: two equal CPU
servers got 72 and 204 of 276 requests with it, against the 20 % of even this router must keep.

A server is taken out once it has failed every request for ``down_after_s`` seconds (default 5 s:
long enough for a request's connection retry, short enough that its in-flight rollouts move on
within seconds); one answer resets that clock.

Ties go to the server with the fewest rollouts routed so far, so servers under equal load take
turns. A server taken out (:meth:`ServerRouter.take_out`, after it stopped answering) gets no new
rollouts until :meth:`ServerRouter.bring_back` (the trainer synced it again,
:mod:`trainer.vllm.fleet`); taking out the last one raises :class:`~trainer.exceptions.VLLMServerError`,
as losing the one server does. The rollout worker's side is :mod:`trainer.rollout.servers`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trainer.exceptions import VLLMServerError
from trainer.vllm.prometheus import ServerLoad

logger = logging.getLogger(__name__)

__all__ = ["ServerRouter"]


class ServerRouter:
    """Routes rollouts over servers by load; counts what it routed and what it lost.

    Args:
        urls: The servers, in the order of ``vllm_server_base_url`` (index ``i`` is ``vllm/<i>/...``).
        down_after_s: Seconds of nothing but failures after which a server is taken out.
        clock: Seconds, monotonic.
    """

    def __init__(self, urls: tuple[str, ...], down_after_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ValueError("a router needs at least one server")
        self.urls = urls
        self.in_flight = [0] * len(urls)
        self.routed = [0] * len(urls)
        """Rollouts started on each server since the start (``vllm/<i>/rollouts_routed``)."""
        self.caps = [1] * len(urls)
        self.loads: list[ServerLoad | None] = [None] * len(urls)
        self.up = [True] * len(urls)
        self.servers_lost = 0
        self.down_after_s = down_after_s
        self._clock = clock
        self._failing_since: list[float | None] = [None] * len(urls)

    def load(self, i: int) -> float:
        """Server ``i``'s load (module docstring): 0 when idle, 1 or more when its cap is full."""
        last = self.loads[i]
        waiting = last.waiting if last else 0.0
        return (self.in_flight[i] + waiting) / max(self.caps[i], 1)

    def pick(self) -> int:
        """The server for the next rollout: the least loaded that is up (ties: fewest routed, then first)."""
        candidates = [i for i, up in enumerate(self.up) if up]
        return min(candidates, key=lambda i: (self.load(i), self.routed[i], i))

    def started(self, i: int) -> None:
        """A rollout started on server ``i``."""
        self.in_flight[i] += 1
        self.routed[i] += 1

    def finished(self, i: int) -> None:
        """A rollout on server ``i`` ended (kept, dropped or to be retried elsewhere)."""
        self.in_flight[i] -= 1

    def observe(self, i: int, load: ServerLoad | None, cap: int) -> None:
        """Server ``i``'s last ``/metrics`` reading (``None``: unreadable) and its concurrency cap now."""
        self.loads[i] = load
        self.caps[i] = cap

    def take_out(self, i: int, reason: str) -> None:
        """Route nothing more to server ``i``; the last server's loss raises.

        Raises:
            VLLMServerError: No server is left, naming the last one and ``reason``.
        """
        if not self.up[i]:
            return
        self.up[i] = False
        self.servers_lost += 1
        if not any(self.up):
            raise VLLMServerError(f"the last vLLM server, {self.urls[i]}, stopped answering: {reason}")
        logger.warning("vLLM server %d (%s) taken out: %s; %d of %d servers left", i, self.urls[i], reason,
                       sum(self.up), len(self.urls))

    def bring_back(self, i: int) -> None:
        """Route to server ``i`` again (it came back and holds the current policy)."""
        self.up[i] = True
        self._failing_since[i] = None
        logger.warning("vLLM server %d (%s) is back; %d of %d servers up", i, self.urls[i], sum(self.up),
                       len(self.urls))

    def answered(self, i: int) -> None:
        """Server ``i`` answered a request: its failures so far are forgiven."""
        self._failing_since[i] = None

    def failed(self, i: int, reason: str) -> bool:
        """A request to server ``i`` failed; whether the server is now out (failing for ``down_after_s``).

        Raises:
            VLLMServerError: That took out the last server (:meth:`take_out`).
        """
        now = self._clock()
        since = self._failing_since[i]
        if since is None:
            self._failing_since[i] = since = now
        if self.up[i] and now - since >= self.down_after_s:
            self.take_out(i, f"{reason} (failing for {now - since:.1f} s)")
        return not self.up[i]
