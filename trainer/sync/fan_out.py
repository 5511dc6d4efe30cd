"""One pass over the policy's weights feeding several servers' syncs at once (:func:`fan_out`).

Under FSDP2 the weights are gathered from the shards while they are sent, and every rank must join
each gather (:mod:`trainer.sync.gather`): the stream can be read once per sync, whatever the number
of servers. So each server's sync runs on a thread of its own and reads a *branch*: the stream is read
once here and each item put on every branch's queue, which holds at most ``depth`` items (a server
that reads slowly holds the others back; no more than ``depth`` tensors per server wait in memory). A
sync that fails stops being fed; the others go on. A branch has the source's ``meta()`` when the
source has one, so each sync still checks names and shapes before sending anything.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from trainer.sync.weight_sync import TensorSource

__all__ = ["fan_out"]

T = TypeVar("T")
NamedTensor = tuple[str, torch.Tensor]
ReadDone = Callable[[], None]
_END = object()
_PUT_POLL_S = 0.1


class _Branch:
    """One consumer's view of the stream: iterable once, with the source's ``meta`` when it has one."""

    def __init__(self, items: queue.Queue[Any], meta: Callable[[], Any] | None) -> None:
        self._items = items
        if meta is not None:
            self.meta = meta

    def __iter__(self) -> Iterator[NamedTensor]:
        while True:
            item = self._items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class _Countdown:
    """Calls ``done`` once every one of ``n`` parties has called :meth:`arrive`."""

    def __init__(self, n: int, done: ReadDone | None) -> None:
        self._left = n
        self._done = done
        self._lock = threading.Lock()

    def arrive(self) -> None:
        with self._lock:
            self._left -= 1
            fire = self._left == 0
        if fire and self._done is not None:
            self._done()


def fan_out(source: TensorSource, consumers: list[Callable[[TensorSource, ReadDone], T]],
            read_done: ReadDone | None = None, depth: int = 2) -> list[T | BaseException]:
    """Run every ``consumer(branch, read_done)`` on a thread of its own, feeding each branch from one
    pass over ``source``; ``read_done`` is called once every consumer has called its own (or failed).

    Returns:
        Per consumer, its result or the exception it raised (in order).
    """
    n = len(consumers)
    countdown = _Countdown(n, read_done)
    queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=depth) for _ in range(n)]
    stopped = [threading.Event() for _ in range(n)]

    def run(i: int) -> T:
        arrived = threading.Event()

        def arrive() -> None:
            if not arrived.is_set():
                arrived.set()
                countdown.arrive()
        try:
            return consumers[i](_Branch(queues[i], getattr(source, "meta", None)), arrive)
        finally:
            stopped[i].set()  # the feeder stops waiting on this branch
            arrive()

    with ThreadPoolExecutor(n, thread_name_prefix="toolgym-sync-fan-out") as pool:
        futures = [pool.submit(run, i) for i in range(n)]
        try:
            for item in source:
                for i in range(n):
                    _put(queues[i], item, stopped[i])
            for i in range(n):
                _put(queues[i], _END, stopped[i])
        except BaseException as exc:  # the gather failed: every branch raises it
            for i in range(n):
                _put(queues[i], exc, stopped[i])
            raise
        results: list[T | BaseException] = []
        for future in futures:
            error = future.exception()
            results.append(error if error is not None else future.result())
    return results


def _put(items: queue.Queue[Any], item: object, stopped: threading.Event) -> None:
    """Put ``item`` on a branch's queue unless its consumer has stopped reading."""
    while not stopped.is_set():
        try:
            items.put(item, timeout=_PUT_POLL_S)
            return
        except queue.Full:
            continue
