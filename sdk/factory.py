"""``remote_factory``: a picklable ``environment_factory`` that makes ``RemoteEnvironment``s.

It is pickled into the trainer's rollout worker and called there, once per environment instance;
with several URLs the instances are spread round-robin over the replicas (each process starts at
its own offset), and each keeps its session on its replica.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from sdk._http import normalize_url
from sdk.remote import RemoteEnvironment


class RemoteFactory:
    """Zero-argument callable making a ``RemoteEnvironment`` per call; picklable (plain attributes).

    Attributes:
        urls: The replicas' base URLs.
        env_name: The hosted environment's name.
        token: Bearer token, or ``None``.
        options: Keyword options passed to every ``RemoteEnvironment`` (timeouts).
    """

    def __init__(self, urls: Sequence[str], env_name: str, token: str | None, options: dict[str, Any]) -> None:
        if not urls:
            raise ValueError("remote_factory needs at least one server URL")
        self.urls = [normalize_url(u) for u in urls]
        self.env_name = env_name
        self.token = token
        self.options = dict(options)
        self._made = 0

    def __call__(self) -> RemoteEnvironment:
        """A new, not yet connected, ``RemoteEnvironment`` on the next replica."""
        index = (self._made + os.getpid()) % len(self.urls)
        self._made += 1
        others = self.urls[index + 1:] + self.urls[:index]
        return RemoteEnvironment(self.urls[index], self.env_name, token=self.token, fallback_urls=others,
                                 **self.options)

    def __repr__(self) -> str:
        return f"remote_factory({self.urls!r}, {self.env_name!r})"


def remote_factory(url_or_urls: str | Sequence[str], env_name: str, token: str | None = None,
                   **opts: Any) -> RemoteFactory:
    """A picklable zero-argument factory of ``RemoteEnvironment``s, usable as ``environment_factory``.

    Args:
        url_or_urls: One server URL or several replicas' URLs (``http://host:port``).
        env_name: The hosted environment's name (as given to ``toolgym serve``).
        token: Bearer token; defaults to the ``TOOLGYM_TOKEN`` environment variable.
        **opts: ``RemoteEnvironment`` options: ``connect_timeout``, ``open_timeout``,
            ``request_timeout``.

    Returns:
        The factory. Nothing connects until an environment's first awaited call.
    """
    urls = [url_or_urls] if isinstance(url_or_urls, str) else list(url_or_urls)
    return RemoteFactory(urls, env_name, token or os.environ.get("TOOLGYM_TOKEN") or None, opts)
