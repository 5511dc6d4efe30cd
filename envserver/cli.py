"""``toolgym serve``: host environment classes on the env server.

Usage::

    toolgym serve environments.counter:IncrementEnv
    toolgym serve counter wordle calc=environments.calculator:CalculatorEnv --port 8765 --token s3cret

A spec is ``module:Class`` (hosted under the class name), ``NAME=module:Class``, or the short name
of a bundled environment (the keys of ``environments.BUNDLED``: ``counter``, ``wordle``...).
``--token`` defaults to the ``TOOLGYM_TOKEN`` environment variable.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
from typing import Any

from transformers import HfArgumentParser

from envserver.config import ServerConfig, token_from_env
from envserver.registry import parse_specs
from envserver.server import EnvServer
from sdk.exceptions import ToolgymError
from sdk.loading import parse_env_kwargs


def build_parser() -> HfArgumentParser:
    """The ``toolgym serve`` parser: the specs, ``--log_level``, and one flag per ``ServerConfig`` field.

    The flags are generated from the fields as ``toolgym train``'s are from ``AsyncGRPOConfig``: each
    flag's default and help are its field's. Flags take underscores (``--max_sessions``) and accept
    dashes (``--max-sessions``); a boolean flag alone means true (``--inline_sync``).
    """
    parser = HfArgumentParser(
        # DataClassType is NewType("DataClassType", Any) in transformers: no class passes as one without a cast.
        ServerConfig,  # type: ignore[arg-type]
        prog="toolgym serve", allow_abbrev=False,
        description="Host environment classes on the env server.",
    )
    parser.add_argument("specs", nargs="+", metavar="[NAME=]MODULE:Class",
                        help="environment to host; repeat to host several under different names")
    parser.add_argument("--log_level", "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--env_kwargs", "--env-kwargs", default=None, metavar="JSON",
                        help="constructor arguments per hosted name, a JSON object: "
                             "'{\"GuessEnv\": {\"high\": 100}}' makes every GuessEnv session GuessEnv(high=100)")
    return parser


def parse_config(argv: list[str]) -> tuple[list[str], ServerConfig, str]:
    """``toolgym serve ARGV...`` -> (specs, config, log level); ``--token`` defaults to ``$TOOLGYM_TOKEN``.

    Raises:
        ServerConfigError: a setting ``ServerConfig`` refuses.
    """
    return _settings(vars(build_parser().parse_args(argv)))


def _settings(args: dict[str, Any]) -> tuple[list[str], ServerConfig, str]:
    settings = {f.name: args[f.name] for f in dataclasses.fields(ServerConfig)}
    if settings["token"] is None:  # an empty --token "" stays empty: ServerConfig refuses it
        settings["token"] = token_from_env()
    return args["specs"], ServerConfig(**settings), args["log_level"]


def main(argv: list[str]) -> int:
    """Run ``toolgym serve ARGV...`` in the foreground until SIGTERM/SIGINT; returns the exit status."""
    try:
        args = vars(build_parser().parse_args(argv))
        names, config, log_level = _settings(args)
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
        env_kwargs = args["env_kwargs"]
        specs = parse_specs(names, parse_env_kwargs(env_kwargs) if env_kwargs is not None else None)
    except ToolgymError as exc:  # a bad spec or setting, an environment refusing to load (no sandbox...)
        print(f"toolgym serve: {exc}", file=sys.stderr)
        return 2
    server = EnvServer(specs, config, log_level=log_level)
    # The import-time heap (transformers, fastapi: ~100k objects) never dies; without this every
    # full collection rescans it and stalls all sessions for ~50 ms.
    gc.collect()
    gc.freeze()
    # Sessions are long-lived objects that die by reference counting, not as cycles; with the default
    # thresholds (700, 10, 10) opening 1,024 sessions ran ~50 young and several full collections over
    # them. Collecting every 50k net allocations instead cut the open time (bench/envserver/README.md).
    gc.set_threshold(50_000, 10, 10)
    log = logging.getLogger("envserver")
    log.info("hosting %s on %s:%d (auth %s)", ", ".join(specs), config.host, config.port,
             "on" if config.token else "off")
    if config.no_auth:
        log.warning("--no_auth: %s:%d accepts every client without a token; anyone who reaches it can run the "
                    "hosted environments", config.host, config.port)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
