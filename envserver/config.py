"""The env server's settings: one dataclass, every limit on by default."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from typing import Any

from envserver.exceptions import ServerConfigError


def _setting(default: object, doc: str) -> Any:
    """A field documented where declared: ``doc`` is its ``help``, shown by ``toolgym serve --help``."""
    return dataclasses.field(default=default, metadata={"help": doc})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Settings of one env server process. Every limit is on by default.

    Each field is documented where it is declared (its ``help``), and each is a ``toolgym serve``
    flag of the same name (``envserver/cli.py`` builds them from these fields).
    """

    host: str = _setting(
        "127.0.0.1", "Interface to bind. 127.0.0.1 by default: exposing the server is a deliberate act.")
    port: int = _setting(8765, "TCP port; 0 picks a free one (the bound port is then reported by the server).")
    token: str | None = _setting(
        None, "Bearer token required on every route (HTTP and WebSocket); None disables auth, which a host "
        "beyond loopback refuses unless no_auth is set. The CLI defaults it to the TOOLGYM_TOKEN environment "
        "variable; an empty token is an error, never 'auth off'.")
    no_auth: bool = _setting(
        False, "Serve a host beyond loopback (0.0.0.0, a LAN address) without a token: anyone who reaches the "
        "port can then run the hosted environments. Refused without this flag; warned about at every start.")
    max_sessions: int = _setting(
        1024, "Sessions alive at once (attached or awaiting resume). Past it, new sessions wait in a queue.")
    max_waiting: int = _setting(
        1024, "Bound of that queue; a session arriving when it is full gets server_full at once.")
    queue_timeout: float = _setting(30.0, "Seconds a queued session waits for a slot before it gets server_full.")
    idle_timeout: float = _setting(
        300.0, "Seconds without a request after which an attached session is reaped (session_evicted). "
        "A running call is never idle.")
    resume_grace: float = _setting(
        30.0, "Seconds a session whose connection dropped stays resumable by id; then it is destroyed.")
    call_timeout: float = _setting(
        60.0, "Per-request deadline in seconds for reset, call and reward; past it the request fails with "
        "call_timeout and the session stays open.")
    max_frame_bytes: int = _setting(
        1 << 20, "Largest frame answered normally; larger ones get frame_too_large. Frames over "
        "4 * max_frame_bytes close the connection (code 1009) before being read.")
    threads: int = _setting(
        32, "Size of each environment class's thread pool, which runs that class's sync methods and "
        "constructors (one pool per class: one class's slow tools never hold up another class's sessions).")
    inline_sync: bool = _setting(
        False, "Run sync environment methods on the event loop instead of the thread pool. Saves a thread "
        "hand-off per request (less CPU per call for trivial environments) but a slow or blocking sync method "
        "then stalls every session and the call deadline cannot interrupt it: only for environments whose "
        "methods are all cheap.")
    inline_threshold: float = _setting(
        0.0, "Seconds under which a sync method counts as cheap; 0 keeps every sync method in the pool. Above "
        "0, a method (or constructor) whose recent runs in the pool all took less runs on the loop instead, "
        "saving the thread hand-off; one inline run that takes longer sends it back to the pool "
        "(envserver.pool.InlinePolicy). That one run stalls the loop and cannot be cut off by call_timeout. "
        "Off by default: on a shared 2-core VM, inlined calls (like inline_sync) saw stalls of hundreds of ms "
        "under heavy load (bench/envserver).")
    drain_timeout: float = _setting(10.0, "On SIGTERM, seconds to let open sessions finish before evicting them.")
    max_head_bytes: int = _setting(
        16 << 10, "Largest HTTP request head (request line and headers) a peer may send; a larger one is "
        "answered 431 and the connection closed.")
    head_timeout: float = _setting(
        5.0, "Seconds the server waits on an HTTP peer: to send a complete request head (from when the "
        "connection opens, or from the previous response), or to read 64 KiB more of its answers (or all "
        "of them) while the server's write buffer to it is full or waits to be flushed before a close; then "
        "the connection is closed (slowloris, or a peer that never reads). A request has no body: one that "
        "declares one gets 413.")
    max_buffered_bytes: int = _setting(
        256 << 10, "Bytes of received messages a connection may hold queued for its session (requests "
        "pipelined behind a running one) before the server stops reading from its socket. With one frame "
        "being read and one being handled, a connection holds at most about this plus 2 * hard_frame_limit "
        "bytes.")
    fragment_timeout: float = _setting(
        20.0, "Seconds a fragmented WebSocket message may take from its first frame to its last; then the "
        "connection is closed (code 1008).")

    def __post_init__(self) -> None:
        for name in ("max_sessions", "threads", "max_frame_bytes", "max_head_bytes", "max_buffered_bytes"):
            if getattr(self, name) < 1:
                raise ServerConfigError(f"{name} must be >= 1, got {getattr(self, name)}; raise it")
        if self.max_waiting < 0:
            raise ServerConfigError(f"max_waiting must be >= 0, got {self.max_waiting}; 0 disables queueing")
        for name in ("queue_timeout", "idle_timeout", "resume_grace", "call_timeout", "drain_timeout",
                     "head_timeout", "fragment_timeout"):
            if getattr(self, name) <= 0:
                raise ServerConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.inline_threshold < 0:
            raise ServerConfigError(
                f"inline_threshold must be >= 0 seconds, got {self.inline_threshold}; 0 turns it off")
        if not 0 <= self.port <= 65535:
            raise ServerConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.token is not None and not self.token:
            raise ServerConfigError("token must be non-empty (an empty --token or TOOLGYM_TOKEN is a mistake, not "
                                    "'auth off'); give a secret, or leave it unset on a loopback host")
        if self.token is not None and self.no_auth:
            raise ServerConfigError("no_auth and a token contradict each other: drop one")
        if self.token is None and not self.no_auth and not self.loopback_only:
            raise ServerConfigError(
                f"host {self.host!r} listens beyond this machine and no token is set: anyone who reaches the port "
                "could run the hosted environments. Pass --token SECRET (or set TOOLGYM_TOKEN), or --no_auth to "
                "serve without authentication anyway")

    @property
    def loopback_only(self) -> bool:
        """Whether ``host`` is reachable from this machine only (``localhost`` or a loopback address)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name other than localhost: it may resolve anywhere
            return False

    @property
    def hard_frame_limit(self) -> int:
        """Frames above this many bytes close the connection before being read (1009)."""
        return 4 * self.max_frame_bytes

    @property
    def reap_interval(self) -> float:
        """How often the reaper scans the session table, in seconds."""
        return min(max(min(self.idle_timeout, self.resume_grace) / 4, 0.05), 5.0)


def token_from_env() -> str | None:
    """The ``TOOLGYM_TOKEN`` environment variable, or ``None`` when unset or empty."""
    return os.environ.get("TOOLGYM_TOKEN") or None
