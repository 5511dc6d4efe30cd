"""Prometheus metrics of one server, in a registry of its own (so several servers can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's counters, gauges and histograms; label children are cached for the hot path."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_open = Gauge(
            "toolgym_sessions_open", "Sessions alive now (attached or resumable)", ["env"], registry=r
        )
        self.sessions_waiting = Gauge("toolgym_sessions_waiting", "New sessions queued for a free slot", registry=r)
        self.sessions_total = Counter("toolgym_sessions", "Sessions opened", ["env"], registry=r)
        self.sessions_evicted = Counter(
            "toolgym_sessions_evicted", "Sessions the server ended itself (idle, expired, drain)", ["env", "reason"],
            registry=r,
        )
        self.sessions_resumed = Counter("toolgym_sessions_resumed", "Sessions resumed by id", ["env"], registry=r)
        self.sessions_rejected = Counter(
            "toolgym_sessions_rejected", "New sessions refused (server_full, server_draining)", ["reason"], registry=r
        )
        self.requests = Counter(
            "toolgym_requests", "Requests by environment, op, tool and outcome", ["env", "op", "tool", "outcome"],
            registry=r,
        )
        self.latency = Histogram(
            "toolgym_request_seconds", "Request latency by environment, op and tool", ["env", "op", "tool"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.frame_errors = Counter(
            "toolgym_frame_errors", "Frames refused before dispatch, by code", ["code"], registry=r
        )
        self._children: dict[tuple[str, ...], tuple[Counter, Histogram]] = {}
        self._session_children: dict[str, tuple[Gauge, Counter]] = {}

    def session_opened(self, env: str) -> None:
        """Count a new session of ``env``."""
        open_now, total = self._session_metrics(env)
        open_now.inc()
        total.inc()

    def session_ended(self, env: str, reason: str) -> None:
        """Count the end of a session; any ``reason`` but ``closed`` is an eviction."""
        self._session_metrics(env)[0].dec()
        if reason != "closed":
            self.sessions_evicted.labels(env, reason).inc()

    def _session_metrics(self, env: str) -> tuple[Gauge, Counter]:
        children = self._session_children.get(env)
        if children is None:
            children = self._session_children[env] = (self.sessions_open.labels(env), self.sessions_total.labels(env))
        return children

    def request(self, env: str, op: str, tool: str, outcome: str, seconds: float) -> None:
        """Count one request and record its latency (``tool`` is ``""`` for non-call ops)."""
        key = (env, op, tool, outcome)
        children = self._children.get(key)
        if children is None:
            children = (self.requests.labels(env, op, tool, outcome), self.latency.labels(env, op, tool))
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
