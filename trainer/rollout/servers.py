"""The rollout worker's vLLM servers: one or several, each rollout routed to one, a lost one left behind.

:class:`ServerFleet` is the loop's ``sampler``. It holds a :class:`~trainer.vllm.client.SamplerClient`
and an adaptive concurrency cap per server (:class:`~trainer.rollout.concurrency.AdaptiveCap`, driven
by that server's own ``/metrics``), and the :class:`~trainer.vllm.routing.ServerRouter` over them.

* **Routing.** :meth:`ServerFleet.run_routed` picks the least-loaded server for one rollout attempt
  and binds it to the attempt's task: every turn of the rollout (``complete``, the harness's requests
  too) goes to that server, whose prefix cache holds the conversation so far. The scheduler's gate on
  rollouts in flight (:attr:`ServerFleet.gate`) is the one server's cap, or with several servers the
  sum of the caps of the servers that are up.
* **Loss.** With several servers, every request's failure and a ``/health`` poll each second
  (:meth:`ServerFleet.watch_health`) feed the router; a server failing for ``down_after_s`` (5 s) is
  taken out: counted (``vllm/servers_lost_count``), logged, and told to the trainer
  (:class:`~trainer.vllm.fleet.FleetState`). Its rollouts in flight are cancelled whole (their
  environment is discarded, none of their turns is kept) and start over on another server
  (``rollout/server_retry_count``). Losing the last server raises
  :class:`~trainer.exceptions.VLLMServerError`, as losing the one server does. With one server
  nothing of this runs: its requests retry and then fail as they always did.
* **Coming back.** A server taken out gets rollouts again once the trainer has synced it to the
  current policy (the shared state says so); each rollout records the policy version of the server
  it ran on (:meth:`ServerFleet.version`).

Metrics: the totals keep their one-server names (``rollout/vllm_*``: requests summed, KV use the
mean over the servers up, ``rollout/concurrency_cap`` the gate); with several servers each also has
``vllm/<i>/...`` (``rollouts_routed_count``, ``in_flight``, ``concurrency_cap``, ``kv_cache_usage_frac``,
``running_requests``, ``queued_requests``, ``up``), with ``vllm/servers_up``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from trainer.config import server_urls
from trainer.exceptions import ServerLostError
from trainer.metrics import RecordBuffer
from trainer.records import TurnRecord
from trainer.rollout.concurrency import AdaptiveCap
from trainer.vllm.client import SamplerClient, SamplingParams
from trainer.vllm.fleet import FleetState
from trainer.vllm.prometheus import ServerLoad
from trainer.vllm.routing import ServerRouter

if TYPE_CHECKING:
    from trainer.rollout.settings import RolloutSettings
    from trainer.rollout.telemetry import LoopTelemetry

__all__ = ["HEALTH_POLL_S", "ServerFleet", "rollout_server"]

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0
_HEALTH_TIMEOUT_S = 2.0
_SEED_STRIDE = 1_000_003  # server i's request seeds come from seed + i * stride: no two servers share a stream
_ROLLOUT_SERVER: contextvars.ContextVar[int | None] = contextvars.ContextVar("toolgym_rollout_server", default=None)
T = TypeVar("T")


def rollout_server() -> int | None:
    """The server the current rollout is bound to (``None`` outside a rollout)."""
    return _ROLLOUT_SERVER.get()


class ServerFleet:
    """The worker's sampler over one or several vLLM servers (module docstring).

    Args:
        settings: The run's settings (``vllm_server_base_url`` names the servers; ``servers`` holds
            what was read from each at start).
        records: Where its metrics go (the loop's buffer).
        state: The servers' state shared with the trainer; ``None`` outside training (then a server
            taken out never comes back).
        down_after_s: Seconds of nothing but failures after which a server is taken out.
    """

    def __init__(self, settings: RolloutSettings, records: RecordBuffer, state: FleetState | None = None,
                 down_after_s: float = 5.0) -> None:
        urls = server_urls(settings.vllm_server_base_url)
        infos = list(settings.servers) or [settings.server] * len(urls)
        if len(infos) != len(urls):
            raise ValueError(f"{len(urls)} server URLs but {len(infos)} server records in the settings")
        if state is not None and len(state) != len(urls):
            raise ValueError(f"{len(urls)} server URLs but a shared state of {len(state)} servers")
        ceiling = settings.max_concurrent_rollouts
        self.clients = [SamplerClient(url, max_connections=ceiling, timeout_s=settings.vllm_server_timeout,
                                      seed=settings.seed + i * _SEED_STRIDE,
                                      model=settings.server.model) for i, url in enumerate(urls)]
        self.caps = [AdaptiveCap(ceiling, info.kv_cache_tokens, info.max_model_len) for info in infos]
        self.router = ServerRouter(urls, down_after_s=down_after_s)
        self.records = records
        self.state = state
        self.lost = [asyncio.Event() for _ in urls]  # set while the server is out: its rollouts start over
        self.retried_rollouts = 0
        if self.several:
            self.gate = AdaptiveCap(ceiling, None, settings.server.max_model_len)
            self.gate.cap = float(min(ceiling, sum(cap.limit for cap in self.caps)))
            for i, client in enumerate(self.clients):
                client.on_failure = self._failure_hook(i)
                client.on_answer = self._answer_hook(i)
        else:
            self.gate = self.caps[0]  # one server: its cap is the gate, exactly as before

    @property
    def several(self) -> bool:
        """Whether there is more than one server."""
        return len(self.clients) > 1

    @property
    def model(self) -> str | None:
        """The name requests give the model (the same on every server)."""
        return self.clients[0].model

    @property
    def retry_count(self) -> int:
        """Requests retried on every server since the start (``rollout/vllm_retry_count``)."""
        return sum(client.retry_count for client in self.clients)

    def version(self, i: int, newest: int) -> int:
        """The policy version server ``i`` holds; ``newest`` (the trainer's) without shared state."""
        return self.state.version(i) if self.state is not None else newest

    # ------------------------------------------------------------------------------ requests
    async def complete(self, prompt_ids: list[int], params: SamplingParams, seed: int | None = None,
                       model: str | None = None) -> TurnRecord:
        """Sample one completion on the current rollout's server (the least-loaded one outside a
        rollout); arguments as :meth:`SamplerClient.complete <trainer.vllm.client.SamplerClient.complete>`."""
        i = rollout_server()
        return await self.clients[self.router.pick() if i is None else i].complete(prompt_ids, params, seed, model)

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every server answers ``/health``."""
        await asyncio.gather(*(client.wait_ready(timeout_s) for client in self.clients))

    async def close(self) -> None:
        """Close every server's HTTP sessions."""
        for client in self.clients:
            await client.close()

    # ------------------------------------------------------------------------------ routing
    async def run_routed(self, attempt: Callable[[int], Coroutine[Any, Any, T]]) -> T:
        """Run ``attempt(server)`` bound to the least-loaded server; when that server is taken out
        meanwhile, the attempt is cancelled and started over on another (its own state discarded).

        Raises:
            VLLMServerError: The last server was lost.
        """
        while True:
            i = self.route()
            task = asyncio.create_task(self._bound(i, attempt))
            lost = asyncio.create_task(self.lost[i].wait())
            try:
                await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
                if not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                self.finished(i)
            if not task.cancelled():
                error = task.exception()
                if error is None:
                    return task.result()
                if not isinstance(error, ServerLostError):
                    raise error
            self.retried_rollouts += 1
            self.records.add("rollout/server_retry_count", 1)
            logger.warning("a rollout on vLLM server %d (%s) starts over on another server: the server was "
                           "taken out", i, self.router.urls[i])

    @staticmethod
    async def _bound(i: int, attempt: Callable[[int], Awaitable[T]]) -> T:
        _ROLLOUT_SERVER.set(i)  # this task's context (and the harness's requests, which copy it)
        return await attempt(i)

    def route(self) -> int:
        """The server for the next rollout (counted as started there)."""
        self.refresh()
        i = self.router.pick()
        self.router.started(i)
        if self.several:
            self.records.add(f"vllm/{i}/rollouts_routed_count", 1)
        return i

    def finished(self, i: int) -> None:
        """A rollout on server ``i`` ended (kept, failed or started over elsewhere)."""
        self.router.finished(i)
        if self.several:  # one server: the gate is its cap and counts its own releases
            self.caps[i].finished += 1

    def refresh(self) -> None:
        """Follow the trainer's view: bring back the servers it synced since they were taken out, take
        out those a sync found gone."""
        if self.state is None or not self.several:
            return
        for i in range(len(self.clients)):
            usable = self.state.usable(i)
            if usable and not self.router.up[i]:
                self.router.bring_back(i)
                self.lost[i] = asyncio.Event()
                self.records.add("vllm/servers_back_count", 1)
            elif not usable and self.router.up[i]:
                self._take_out(i, "it is not synced to the current policy (a weight sync found it gone)",
                               tell_trainer=False)

    # ------------------------------------------------------------------------------ losing one
    def _failure_hook(self, i: int) -> Callable[[str], bool]:
        def failed(problem: str) -> bool:
            was_up = self.router.up[i]
            out = self.router.failed(i, problem)  # raises when it was the last server
            if out and was_up:
                self._server_lost(i)
            return out
        return failed

    def _answer_hook(self, i: int) -> Callable[[], None]:
        return lambda: self.router.answered(i)

    def _take_out(self, i: int, reason: str, tell_trainer: bool = True) -> None:
        if not self.router.up[i]:
            return
        self.router.take_out(i, reason)  # raises when it was the last server
        self._server_lost(i, tell_trainer)

    def _server_lost(self, i: int, tell_trainer: bool = True) -> None:
        if tell_trainer and self.state is not None:
            self.state.take_out(i)
        self.lost[i].set()
        self.records.add("vllm/servers_lost_count", 1)

    async def watch_health(self) -> None:
        """Every ``HEALTH_POLL_S``: each server's ``/health`` (a failing one is taken out after
        ``down_after_s``), servers brought back, the gate resized to the servers up."""
        while True:
            self.refresh()
            await asyncio.gather(*(self._check_health(i) for i in range(len(self.clients)) if self.router.up[i]))
            await self._resize_gate()
            await asyncio.sleep(HEALTH_POLL_S)

    async def _check_health(self, i: int) -> None:
        client = self.clients[i]
        try:
            timeout = aiohttp.ClientTimeout(total=_HEALTH_TIMEOUT_S)
            async with client.control_session.get(f"{client.base_url}/health", timeout=timeout) as r:
                problem = None if r.status == 200 else f"/health answered HTTP {r.status}"
        except (TimeoutError, aiohttp.ClientError) as e:
            problem = f"/health: {e!r}"
        if problem is None:
            self.router.answered(i)
        else:
            self._failure_hook(i)(problem)

    async def _resize_gate(self) -> None:
        if self.several:
            up = sum(cap.limit for cap, up in zip(self.caps, self.router.up, strict=True) if up)
            await self.gate.set_cap(min(self.gate.ceiling, max(up, 1)))

    def background(self) -> list[Coroutine[Any, Any, None]]:
        """What must run beside the rollouts: the health watch, with several servers."""
        return [self.watch_health()] if self.several else []

    # ------------------------------------------------------------------------------ load
    async def observe_load(self, telemetry: LoopTelemetry) -> None:
        """Read every server's ``/metrics``, adjust its cap and the router to it, record the metrics."""
        up = [i for i in range(len(self.clients)) if self.router.up[i]]
        loads = await asyncio.gather(*(self.clients[i].load() for i in up))
        for i, load in zip(up, loads, strict=True):
            await self.caps[i].observe(load)
            self.router.observe(i, load, self.caps[i].limit)
        if not self.several:
            telemetry.record_load(loads[0], self.gate)
            return
        await self._resize_gate()
        read = [load for load in loads if load is not None]
        total = ServerLoad(kv_cache_usage=sum(r.kv_cache_usage for r in read) / len(read),
                           running=sum(r.running for r in read), waiting=sum(r.waiting for r in read),
                           preemptions=sum(r.preemptions for r in read)) if read else None
        telemetry.record_load(total, self.gate)
        self._record_servers(dict(zip(up, loads, strict=True)))

    def _record_servers(self, loads: dict[int, ServerLoad | None]) -> None:
        records = self.records
        records.add("vllm/servers_up", sum(self.router.up))
        for i in range(len(self.clients)):
            records.add(f"vllm/{i}/up", float(self.router.up[i]))
            records.add(f"vllm/{i}/in_flight", self.router.in_flight[i])
            records.add(f"vllm/{i}/concurrency_cap", self.caps[i].limit)
            load = loads.get(i)
            if load is not None:
                records.add(f"vllm/{i}/kv_cache_usage_frac", load.kv_cache_usage)
                records.add(f"vllm/{i}/running_requests", load.running)
                records.add(f"vllm/{i}/queued_requests", load.waiting)
