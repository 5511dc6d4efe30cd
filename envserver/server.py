"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests, benches).

SIGTERM (or SIGINT) drains first: new sessions and new episodes are refused with
``server_draining``, open sessions get ``drain_timeout`` seconds to finish, the rest are evicted
with a ``bye`` frame, and only then does uvicorn close the listener and exit.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import TracebackType

import uvicorn

from envserver._bodies import BodyRoutes
from envserver._websocket import WebSocketProtocol
from envserver.app import create_app
from envserver.config import ServerConfig
from envserver.registry import EnvSpec
from envserver.sessions import SessionTable

logger = logging.getLogger("envserver.server")


class EnvServer(uvicorn.Server):
    """A uvicorn server for the env server app whose shutdown drains sessions first."""

    def __init__(self, specs: dict[str, EnvSpec], config: ServerConfig, log_level: str = "warning") -> None:
        self.env_config = config
        app = create_app(specs, config)
        self.table: SessionTable = app.state.table
        uvicorn_config = uvicorn.Config(
            app, host=config.host, port=config.port, log_level=log_level, access_log=False,
            # Our own lean RFC 6455 protocol, and uvicorn's httptools protocol with a fast path to it
            # (bodies on the interop faces' POST routes only: envserver/_bodies.py).
            http=BodyRoutes, ws=WebSocketProtocol,
            ws_max_size=config.hard_frame_limit, ws_ping_interval=20.0, ws_ping_timeout=20.0,
            timeout_graceful_shutdown=5, backlog=4096, lifespan="on",
            proxy_headers=False,  # nothing reads the client address; saves a middleware per request
        )
        uvicorn_config.env_config = config  # type: ignore[attr-defined]  # the wire limits (_websocket.limits_of)
        super().__init__(uvicorn_config)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain sessions (unless forced), then let uvicorn close connections and exit."""
        if not self.force_exit:
            logger.info("draining %d session(s) for up to %g s", len(self.table), self.env_config.drain_timeout)
            await self.table.drain()
        await super().shutdown(sockets)

    @property
    def bound_port(self) -> int:
        """The TCP port actually bound (useful with ``port=0``); valid once ``started``."""
        return int(self.servers[0].sockets[0].getsockname()[1])


class ServerThread:
    """An env server on a background thread, for tests and benchmarks: ``with ServerThread(...) as s:``.

    Args:
        specs: Environments to host, name -> ``EnvSpec``.
        config: Server settings; ``port=0`` (the default here) picks a free port.
        start_timeout: Seconds to wait for the server to listen.
    """

    def __init__(self, specs: dict[str, EnvSpec], config: ServerConfig | None = None,
                 start_timeout: float = 10.0) -> None:
        self.server = EnvServer(specs, config or ServerConfig(port=0))
        self._thread = threading.Thread(target=self.server.run, name="toolgym-envserver", daemon=True)
        self._start_timeout = start_timeout

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.server.env_config.host}:{self.server.bound_port}"

    @property
    def table(self) -> SessionTable:
        """The live session table (read it only for assertions: it belongs to the server's loop)."""
        return self.server.table

    def start(self) -> ServerThread:
        """Start serving and wait until the socket listens (no-op when already started)."""
        if self._thread.is_alive():
            return self
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("env server did not start; see its log")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down like SIGTERM does (drain, then exit) and join the thread."""
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
