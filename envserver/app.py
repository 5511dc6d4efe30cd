"""The FastAPI application: routes, lifespan (thread pool, reaper) and auth, built from a config.

Routes (all behind the bearer token when one is set):

* ``GET /health``: liveness and readiness with capacity figures; 200 when a new session would be
  admitted (a free slot or room in the queue), 503 when full or draining.
* ``GET /metrics``: Prometheus text exposition.
* ``GET /v1/envs``: the hosted environments with their tool schemas.
* ``WS /v1/ws/{env}?v=1[&session=ID]``: one session (see ``docs/protocol.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from envserver.auth import BearerAuth
from envserver.config import ServerConfig
from envserver.connection import Connection
from envserver.interop import InteropFaces
from envserver.metrics import ServerMetrics
from envserver.pool import InlinePolicy, SyncPool
from envserver.registry import EnvSpec
from envserver.sessions import SessionTable
from sdk import protocol


def create_app(specs: dict[str, EnvSpec], config: ServerConfig) -> FastAPI:
    """Build the server's ASGI app for ``specs`` (name -> ``EnvSpec``) under ``config``.

    The session table is ``app.state.table``; its thread pools and reaper live as long as the app's
    lifespan.
    """
    metrics = ServerMetrics()
    policy = InlinePolicy(config.inline_threshold) if config.inline_threshold > 0 else None
    # One pool per environment class: one class's slow tools cannot take another's threads.
    pools = None if config.inline_sync else {
        name: SyncPool(config.threads, name=f"toolgym-{name}", policy=policy) for name in specs}
    table = SessionTable(config, specs, metrics, pools)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(table.reap_forever(), name="toolgym-reaper")
        try:
            yield
        finally:
            reaper.cancel()
            await table.evict_all()
            for pool in (pools or {}).values():
                pool.shutdown()

    app = FastAPI(title="toolgym env server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.table = table
    app.add_middleware(_SessionSockets, table=table)
    app.add_middleware(InteropFaces, table=table)  # OpenEnv and MCP faces (docs/interop.md)
    if config.token is not None:  # added last, so it runs first: in front of the session sockets too
        app.add_middleware(BearerAuth, token=config.token)
    description = {name: spec.describe() for name, spec in specs.items()}

    @app.get("/health")
    async def health() -> JSONResponse:
        body = health_body(table)
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get(protocol.ENVS_PATH)
    async def environments() -> dict[str, Any]:
        return {"protocol": protocol.PROTOCOL_VERSION, "environments": description}

    return app


class _SessionSockets:
    """ASGI middleware that hands ``WS /v1/ws/{env}`` straight to a ``Connection``.

    Session sockets skip the router and the exception middlewares (a ``Connection`` turns every
    failure into a typed frame itself); everything else goes on to the app.
    """

    _PREFIX = protocol.WS_PATH.split("{", 1)[0]

    def __init__(self, app: ASGIApp, table: SessionTable) -> None:
        self.app = app
        self.table = table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "websocket" and path.startswith(self._PREFIX):
            await Connection(scope, receive, send, self.table).serve(path[len(self._PREFIX):])
        else:
            await self.app(scope, receive, send)


def health_body(table: SessionTable) -> dict[str, Any]:
    """Liveness, readiness and capacity figures of a server."""
    config = table.config
    admits = len(table) < config.max_sessions or table.waiting < config.max_waiting
    return {
        "status": "draining" if table.draining else "ok",
        "live": True,
        "ready": admits and not table.draining,
        "sessions": len(table),
        "max_sessions": config.max_sessions,
        "waiting": table.waiting,
        "max_waiting": config.max_waiting,
        "environments": list(table.specs),
        "protocol": protocol.PROTOCOL_VERSION,
        "limits": {k: v for k, v in dataclasses.asdict(config).items() if k not in ("host", "port", "token")},
    }
