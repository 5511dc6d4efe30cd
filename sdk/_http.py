"""URL helpers and the one plain-HTTP call the client makes: reading the hosted tool schemas."""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request
from typing import Any, cast

from sdk import protocol
from sdk.exceptions import (
    AuthenticationError,
    ServerUnavailableError,
    UnknownEnvironmentError,
)


def normalize_url(url: str) -> str:
    """``http://host:port`` from ``http(s)://``, ``ws(s)://`` or bare ``host:port``, no trailing slash."""
    url = url.rstrip("/")
    if url.startswith("ws://"):
        return "http://" + url[5:]
    if url.startswith("wss://"):
        return "https://" + url[6:]
    return url if url.startswith(("http://", "https://")) else "http://" + url


def ws_url(url: str, env_name: str) -> str:
    """The WebSocket URL of ``env_name``'s sessions on the server at ``url`` (without the query)."""
    return "ws" + normalize_url(url)[4:] + protocol.WS_PATH.format(env=env_name)


@functools.cache
def fetch_description(url: str, env_name: str, token: str | None, timeout: float) -> dict[str, Any]:
    """``{"tools": [...], "has_reward": bool}`` of a hosted environment, fetched once per process.

    Raises:
        ServerUnavailableError: the server did not answer within ``timeout`` seconds.
        AuthenticationError: the token is missing or wrong.
        UnknownEnvironmentError: the server hosts no environment of that name.
    """
    request = urllib.request.Request(normalize_url(url) + protocol.ENVS_PATH)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http only)
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise AuthenticationError(protocol.ErrorCode.UNAUTHORIZED, f"{url} refused the bearer token") from exc
        raise ServerUnavailableError(f"{url}{protocol.ENVS_PATH} answered HTTP {exc.code}") from exc
    except (OSError, ValueError) as exc:
        raise ServerUnavailableError(f"could not read {url}{protocol.ENVS_PATH}: {exc}") from exc
    environments = body.get("environments", {})
    if env_name not in environments:
        raise UnknownEnvironmentError(
            protocol.ErrorCode.UNKNOWN_ENVIRONMENT,
            f"{url} hosts no environment {env_name!r} (hosted: {', '.join(environments) or 'none'})",
        )
    return cast("dict[str, Any]", environments[env_name])
