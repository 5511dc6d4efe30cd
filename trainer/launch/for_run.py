"""The servers a run starts for itself: ``launch_vllm`` and ``launch_envserver`` of ``AsyncGRPOConfig``.

``AsyncGRPOTrainer.train()`` (and so ``toolgym train``, which only builds the trainer) calls
:func:`launch_servers` inside its ``try``/``finally``, on an ``ExitStack`` that closes after the rollout
worker has stopped: the servers are stopped on every way out of ``train()`` (its end, an exception,
Ctrl-C), and the trainer's ``environment_factory`` is given back as it was::

    AsyncGRPOTrainer(model="tiny", environment_factory=CounterEnv,
                     args=AsyncGRPOConfig(..., launch_vllm=True, launch_envserver=True)).train()

``launch_envserver`` hosts the factory on an env server in a child process, so the factory must be
importable there: a class of a module (``module:Class``), or a class of the script run as ``__main__``,
imported from the script's file as multiprocessing's spawn does (the script's training must then sit
under ``if __name__ == "__main__":``); ``functools.partial(Class, **kwargs)`` with JSON arguments (what
``toolgym train --env_kwargs`` makes) passes them to the server. :func:`check_launches` refuses anything
else when the trainer is built, before a model is loaded.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from sdk import remote_factory
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError
from trainer.launch.envserver import EnvServerProcess
from trainer.launch.threads import share_cores_with_local_vllm
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig

__all__ = ["HostedClass", "check_launches", "hosted_classes", "launch_servers"]

logger = logging.getLogger(__name__)

INSIDE_LAUNCHED_ENVSERVER = "TOOLGYM_INSIDE_LAUNCHED_ENVSERVER"
"""Set in a launched env server's environment: a script imported there that trains again is refused."""


class LaunchingTrainer(Protocol):
    """What :func:`launch_servers` reads and sets on the trainer."""

    args: AsyncGRPOConfig
    model_id: str
    environment_factory: Any


@dataclass
class HostedClass:
    """An environment class as an env server child process imports it.

    Attributes:
        spec: ``module:Qualname``.
        kwargs: Constructor arguments (JSON), from a ``functools.partial``.
        import_root: A folder the child must find the module in (the script's, a package's parent).
    """

    spec: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    import_root: str | None = None


def _refuse(what: str, why: str) -> ConfigError:
    return ConfigError(f"launch_envserver=True: {what} {why}. The env server it starts is a child process that "
                       "imports the environment by name: give its class (module:Class), or functools.partial(Class, "
                       "**json_kwargs), or set launch_envserver=False to run it in the rollout worker")


def _module_and_root(cls: type) -> tuple[str, str | None]:
    """The name a child process imports ``cls``'s module by, and the folder it is found in."""
    module = sys.modules.get(cls.__module__)
    if cls.__module__ == "__main__" and module is not None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.name:  # python -m package.script: the child imports it by that name
            return str(spec.name), None
        file = getattr(module, "__file__", None)
        if file is None:
            raise _refuse(f"{cls.__qualname__}, defined in an interactive session,", "cannot be imported: put it "
                          "in a module (my_envs.py) and import it from there")
        path = Path(file).resolve()
        if not path.stem.isidentifier():
            raise _refuse(f"{cls.__qualname__}, defined in the script {path.name},",
                          "is imported from that file, whose name must be a Python identifier: rename the script")
        return path.stem, str(path.parent)
    file = getattr(module, "__file__", None)
    if file is None:
        return cls.__module__, None  # a namespace package or builtin: found the way the parent found it
    path = Path(file).resolve()
    if path.stem == "__init__":
        path = path.parent
    return cls.__module__, str(path.parents[len(cls.__module__.split(".")) - 1])


def _hosted(factory: Any, where: str) -> HostedClass:
    kwargs: dict[str, Any] = {}
    if isinstance(factory, functools.partial):
        if factory.args:
            raise _refuse(f"{where} binds positional arguments {factory.args!r:.80},",
                          "which cannot reach the env server: bind keyword arguments only")
        try:
            kwargs = json.loads(json.dumps(factory.keywords))
        except (TypeError, ValueError) as exc:
            raise _refuse(f"{where}'s keyword arguments", f"must be JSON to reach the env server ({exc})") from None
        factory = factory.func
    if not inspect.isclass(factory):
        raise _refuse(f"{where} ({factory!r:.80})", "is not a class (a function, lambda or instance)")
    if "<locals>" in factory.__qualname__:
        raise _refuse(f"{where} ({factory.__qualname__}, defined inside a function)",
                      "cannot be imported: define it at module level")
    module, root = _module_and_root(factory)
    found: Any = sys.modules.get(factory.__module__)
    for part in factory.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not factory:
        raise _refuse(f"{where} ({factory.__module__}.{factory.__qualname__})", "is not found under that name "
                      "in its module")
    return HostedClass(f"{module}:{factory.__qualname__}", kwargs, root)


def hosted_classes(environment_factory: Any) -> dict[str, HostedClass]:
    """Name -> how an env server imports it, for ``environment_factory`` (one factory, or a dict of them).

    A single class is hosted under its class name, a dict's under its keys.

    Raises:
        ConfigError: a factory a child process cannot import (module docstring), or no factory at all.
    """
    if environment_factory is None:
        raise ConfigError("launch_envserver=True needs an environment_factory to host: give the environment's "
                          "class (environment_factory=MyEnv), or set launch_envserver=False")
    if isinstance(environment_factory, dict):
        return {str(name): _hosted(f, f"environment_factory[{name!r}]") for name, f in environment_factory.items()}
    hosted = _hosted(environment_factory, "environment_factory")
    return {hosted.spec.rpartition(":")[2].rpartition(".")[2]: hosted}


def check_launches(args: AsyncGRPOConfig, environment_factory: Any) -> None:
    """Refuse, when the trainer is built, a launch that cannot work (:class:`ConfigError` saying what to do)."""
    if not (args.launch_vllm or args.launch_envserver):
        return
    if args.world_size > 1:
        raise ConfigError(f"launch_vllm / launch_envserver start servers for one training process, and this run "
                          f"has {args.world_size}: start them once yourself (toolgym vllm MODEL, toolgym serve "
                          "module:Class) and pass vllm_server_base_url / remote_factory(URL, NAME)")
    if args.launch_envserver:
        if os.environ.get(INSIDE_LAUNCHED_ENVSERVER):
            raise ConfigError("this script was imported by the env server that launch_envserver started for it, "
                              "and it trains again on import: put the training under "
                              "if __name__ == '__main__':")
        hosted_classes(environment_factory)


def _say(args: AsyncGRPOConfig, message: str) -> None:
    """A launch's news: a console line beside the progress table, else a log record."""
    if args.progress == "table":
        print(message, flush=True)
    else:
        logger.info(message)


def _start_envserver(stack: ExitStack, args: AsyncGRPOConfig, environment_factory: Any) -> Any:
    """Host ``environment_factory`` on a new env server (stopped by ``stack``); returns the remote factory."""
    hosted = hosted_classes(environment_factory)
    roots = [h.import_root for h in hosted.values() if h.import_root]
    path = os.pathsep.join(dict.fromkeys([*roots, *filter(None, [os.environ.get("PYTHONPATH")])]))
    kwargs = {name: h.kwargs for name, h in hosted.items() if h.kwargs}
    server = stack.enter_context(EnvServerProcess(
        [f"{name}={h.spec}" for name, h in hosted.items()],
        args=["--env_kwargs", json.dumps(kwargs)] if kwargs else [],
        env={INSIDE_LAUNCHED_ENVSERVER: "1", **({"PYTHONPATH": path} if path else {})}))
    _say(args, f"env server ready at {server.url} hosting {', '.join(hosted)}")
    remote = {name: remote_factory(server.url, name) for name in hosted}
    return remote if isinstance(environment_factory, dict) else next(iter(remote.values()))


def launch_servers(trainer: LaunchingTrainer, stack: ExitStack) -> None:
    """Start what ``trainer.args`` asks for, each stopped when ``stack`` closes.

    ``launch_envserver``: ``trainer.environment_factory`` becomes the hosted environment's remote factory
    (given back when ``stack`` closes). ``launch_vllm``: a server on ``trainer.model_id``, and
    ``trainer.args.vllm_server_base_url`` (the trainer's own copy of the config) set to it. Then a CPU
    trainer beside a local vLLM CPU server takes half the cores (:mod:`trainer.launch.threads`), until
    ``stack`` closes.
    """
    args = trainer.args
    if args.launch_envserver:  # first: a class that fails to import fails in seconds, before vLLM's minutes
        original = trainer.environment_factory
        stack.callback(setattr, trainer, "environment_factory", original)
        trainer.environment_factory = _start_envserver(stack, args, original)
    if args.launch_vllm:
        server = stack.enter_context(VLLMServer(VLLMServerConfig(
            model=trainer.model_id, max_model_len=args.vllm_max_model_len, dtype=args.dtype)))
        args.vllm_server_base_url = server.base_url
        _say(args, f"vLLM server ready at {server.base_url} ({server.ready_s:.0f} s)")
    threads_before = torch.get_num_threads()
    threads = share_cores_with_local_vllm(args.vllm_server_base_url, args.device.type)
    if threads is not None:
        stack.callback(torch.set_num_threads, threads_before)
        _say(args, f"training on {threads} CPU thread(s): a vLLM CPU server shares this machine")
