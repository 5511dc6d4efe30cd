"""Bearer-token auth on every route: HTTP and WebSocket refuse a missing or wrong token."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.envserver.servers import http_get, make_server, ws_url

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secured():
    srv = make_server(token=TOKEN)
    yield srv
    srv.stop()


@pytest.mark.parametrize("route", ["/health", "/metrics", "/v1/envs", "/docs", "/nope"])
@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_http_routes_refuse_missing_or_wrong_token(secured, route, token):
    status, body = http_get(secured.url + route, token=token)
    assert status == 401
    assert json.loads(body)["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("route", ["/health", "/metrics", "/v1/envs"])
def test_http_routes_accept_the_token(secured, route):
    assert http_get(secured.url + route, token=TOKEN)[0] == 200


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_websocket_refuses_missing_or_wrong_token_before_any_session(secured, headers):
    async def scenario():
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(ws_url(secured, "counter"), additional_headers=headers)
        return refused.value.response.status_code

    assert asyncio.run(scenario()) == 401
    assert json.loads(http_get(secured.url + "/health", token=TOKEN)[1])["sessions"] == 0


def test_websocket_accepts_the_token(secured):
    async def scenario():
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with websockets.connect(ws_url(secured, "counter"), additional_headers=headers) as ws:
            hello = json.loads(await ws.recv())
            await ws.send(json.dumps({"id": 1, "op": "close"}))
            await ws.recv()
        return hello

    assert asyncio.run(scenario())["op"] == "hello"
