"""``toolgym serve``: host environment classes on the env server.

Usage::

    toolgym serve environments.counter:IncrementEnv
    toolgym serve counter wordle calc=environments.calculator:CalculatorEnv --port 8765 --token s3cret

A spec is ``module:Class`` (hosted under the class name), ``NAME=module:Class``, or the short name
of a bundled environment (``counter``, ``wordle``, ``calculator``, ``python``, ``gridworld``).
``--token`` defaults to the ``TOOLGYM_TOKEN`` environment variable.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from envserver.config import ServerConfig, token_from_env
from envserver.registry import parse_specs
from envserver.server import EnvServer
from sdk.exceptions import ToolgymError


def build_parser() -> argparse.ArgumentParser:
    """The ``toolgym serve`` argument parser; defaults come from ``ServerConfig``.

    Flags are spelled with underscores like every ``toolgym`` subcommand's (``--max_sessions``); the
    dashed spelling (``--max-sessions``) is accepted too.
    """
    d = ServerConfig()
    p = argparse.ArgumentParser(prog="toolgym serve", description="Host environment classes on the env server.")
    p.add_argument("specs", nargs="+", metavar="[NAME=]MODULE:Class",
                   help="environment to host; repeat to host several under different names")
    p.add_argument("--host", default=d.host, help=f"interface to bind (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"TCP port, 0 for any free one (default {d.port})")
    p.add_argument("--token", default=None, help="bearer token required on every route (default: $TOOLGYM_TOKEN)")
    p.add_argument("--max_sessions", "--max-sessions", type=int, default=d.max_sessions, help="sessions alive at once")
    p.add_argument("--max_waiting", "--max-waiting", type=int, default=d.max_waiting,
                   help="bound of the new-session wait queue")
    p.add_argument("--queue_timeout", "--queue-timeout", type=float, default=d.queue_timeout,
                   help="seconds a new session may wait")
    p.add_argument("--idle_timeout", "--idle-timeout", type=float, default=d.idle_timeout,
                   help="seconds before an idle session is reaped")
    p.add_argument("--resume_grace", "--resume-grace", type=float, default=d.resume_grace,
                   help="seconds a dropped session stays resumable")
    p.add_argument("--call_timeout", "--call-timeout", type=float, default=d.call_timeout,
                   help="per-request deadline in seconds")
    p.add_argument("--max_frame_bytes", "--max-frame-bytes", type=int, default=d.max_frame_bytes,
                   help="largest frame accepted")
    p.add_argument("--threads", type=int, default=d.threads, help="thread pool size for sync environment methods")
    p.add_argument("--inline_sync", "--inline-sync", action="store_true",
                   help="run sync methods on the event loop (only for environments whose methods are all cheap)")
    p.add_argument("--inline_threshold", "--inline-threshold", type=float, default=d.inline_threshold,
                   help="sync methods that always finish faster than this (seconds, e.g. 0.001) run on the "
                        "event loop; 0 (default) keeps them all in the thread pool")
    p.add_argument("--drain_timeout", "--drain-timeout", type=float, default=d.drain_timeout,
                   help="seconds to drain on SIGTERM")
    p.add_argument("--max_head_bytes", "--max-head-bytes", type=int, default=d.max_head_bytes,
                   help="largest HTTP request head; larger ones get 431")
    p.add_argument("--head_timeout", "--head-timeout", type=float, default=d.head_timeout,
                   help="seconds a connection may take to send a complete request head")
    p.add_argument("--max_buffered_bytes", "--max-buffered-bytes", type=int, default=d.max_buffered_bytes,
                   help="bytes of received messages queued per connection before reading pauses")
    p.add_argument("--fragment_timeout", "--fragment-timeout", type=float, default=d.fragment_timeout,
                   help="seconds a fragmented WebSocket message may take to arrive whole")
    p.add_argument("--log_level", "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str]) -> int:
    """Run ``toolgym serve ARGV...`` in the foreground until SIGTERM/SIGINT; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        specs = parse_specs(args.specs)
        config = ServerConfig(
            host=args.host, port=args.port, token=args.token or token_from_env(),
            max_sessions=args.max_sessions, max_waiting=args.max_waiting, queue_timeout=args.queue_timeout,
            idle_timeout=args.idle_timeout, resume_grace=args.resume_grace, call_timeout=args.call_timeout,
            max_frame_bytes=args.max_frame_bytes, threads=args.threads, inline_sync=args.inline_sync,
            inline_threshold=args.inline_threshold, drain_timeout=args.drain_timeout,
            max_head_bytes=args.max_head_bytes, head_timeout=args.head_timeout,
            max_buffered_bytes=args.max_buffered_bytes, fragment_timeout=args.fragment_timeout,
        )
    except ToolgymError as exc:  # a bad spec or setting, an environment refusing to load (no sandbox...)
        print(f"toolgym serve: {exc}", file=sys.stderr)
        return 2
    server = EnvServer(specs, config, log_level=args.log_level)
    # The import-time heap (transformers, fastapi: ~100k objects) never dies; without this every
    # full collection rescans it and stalls all sessions for ~50 ms.
    gc.collect()
    gc.freeze()
    # Sessions are long-lived objects that die by reference counting, not as cycles; with the default
    # thresholds (700, 10, 10) opening 1,024 sessions ran ~50 young and several full collections over
    # them. Collecting every 50k net allocations instead cut the open time (bench/envserver/README.md).
    gc.set_threshold(50_000, 10, 10)
    logging.getLogger("envserver").info(
        "hosting %s on %s:%d (auth %s)", ", ".join(specs), config.host, config.port,
        "on" if config.token else "off",
    )
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
