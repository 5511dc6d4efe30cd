"""An MCP server for the MCP tests, built with the ``mcp`` package's ``MCPServer``.

    .venv/bin/python tests/sdk/mcp_server.py                      # stdio
    .venv/bin/python tests/sdk/mcp_server.py --http 8773          # streamable HTTP at /mcp

Tools: ``increment(step)`` (a counter kept by the process), ``fail(message)`` (raises), ``slow(seconds)``,
``crash()`` (the process exits at once), ``whoami()`` (the process id, the working folder, and which of
``TOOLGYM_TOKEN`` and ``MCP_TEST_VALUE`` it sees).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from mcp.server.mcpserver import MCPServer

server = MCPServer("toolgym-test")
counter = 0


@server.tool()
def increment(step: int) -> int:
    """Increment the counter.

    Args:
        step: Value to add.
    """
    global counter
    counter += step
    return counter


@server.tool()
def fail(message: str) -> str:
    """Raise ValueError(message)."""
    raise ValueError(message)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "slept"


@server.tool()
def crash() -> str:
    """Exit the process at once."""
    os._exit(3)


@server.tool()
def whoami() -> str:
    """The process id, the working folder and the test variables this process sees."""
    return json.dumps({"pid": os.getpid(), "cwd": os.getcwd(),
                       "env": {k: os.environ[k] for k in ("TOOLGYM_TOKEN", "MCP_TEST_VALUE") if k in os.environ}})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int)
    args = parser.parse_args()
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run()
