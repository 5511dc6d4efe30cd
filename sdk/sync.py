"""A blocking facade over ``RemoteEnvironment`` for scripts and notebooks (not for async code).

    with SyncRemoteEnvironment("http://127.0.0.1:8765", "counter") as env:
        print(env.reset(target=3))
        print(env.increment(step=3))   # tools are attributes
        print(env.get_reward())
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sdk.remote import RemoteEnvironment


class SyncRemoteEnvironment:
    """A ``RemoteEnvironment`` driven by a private event loop; tools are also attributes.

    Args:
        url: Server base URL.
        env_name: Hosted environment name.
        **options: ``RemoteEnvironment`` keyword options (``token``, timeouts, ``fallback_urls``).
    """

    def __init__(self, url: str, env_name: str, **options: Any) -> None:
        self.remote = RemoteEnvironment(url, env_name, **options)
        self._runner = asyncio.Runner()

    def reset(self, **kwargs: Any) -> str | None:
        """Start a new episode; see ``RemoteEnvironment.reset``."""
        return self._runner.run(self.remote.reset(**kwargs))

    def get_reward(self) -> float | None:
        """The episode's reward; see ``RemoteEnvironment.get_reward``."""
        return self._runner.run(self.remote.get_reward())

    def call(self, tool: str, arguments: dict[str, Any] | None = None) -> str:
        """Call a tool; see ``RemoteEnvironment.call``."""
        return self._runner.run(self.remote.call(tool, arguments))

    def close(self) -> None:
        """End the session and stop the private loop (idempotent)."""
        try:
            self._runner.run(self.remote.aclose())
        finally:
            self._runner.close()

    def __getattr__(self, name: str) -> Callable[..., str]:
        remote = self.__dict__.get("remote")
        if remote is None or name.startswith("_") or name not in {s["function"]["name"] for s in remote.tool_schemas}:
            raise AttributeError(f"{type(self).__name__} has no attribute or remote tool {name!r}")
        return lambda **arguments: self.call(name, arguments)

    def __enter__(self) -> SyncRemoteEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
