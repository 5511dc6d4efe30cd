"""A reverse proxy on loopback that forwards every request to a server and records each one, in order."""

from __future__ import annotations

import http.client
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class CountingProxy(ThreadingHTTPServer):
    """Forwards to ``upstream`` (``http://host:port``); :attr:`requests` lists ``(method, path)`` as they
    arrived, the path without its query."""

    daemon_threads = True
    # The rollout worker opens many connections at once and the accept loop shares the trainer's process (and
    # its GIL): socketserver's backlog of 5 can overflow, and a connection the kernel gives up on in the queue
    # reaches the client as a reset, the likely cause of one "Connection reset by peer" on a weight sync in a
    # full run with a busy core (the kernel's ListenOverflows counter grows during the suite).
    request_queue_size = 1024

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        """The proxy's URL, to give clients instead of the server's."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that closed its keep-alive connection (the worker stopping) is no error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]

    def count(self, method: str, path: str, before: tuple[str, str] | None = None) -> int:
        """How many ``method path`` requests arrived (only those before the first ``before`` one)."""
        with self.lock:
            seen = list(self.requests)
        if before is not None and before in seen:
            seen = seen[:seen.index(before)]
        return seen.count((method, path))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect
    server: CountingProxy

    def _forward(self) -> None:
        with self.server.lock:
            self.server.requests.append((self.command, self.path.split("?", 1)[0]))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=600)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
        finally:
            upstream.close()
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _forward

    def log_message(self, format: str, *args: object) -> None:  # quiet: the test reads requests instead
        pass


@contextmanager
def counting_proxy(upstream: str) -> Iterator[CountingProxy]:
    """A :class:`CountingProxy` serving on a thread for the ``with`` block."""
    proxy = CountingProxy(upstream)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()
