"""The persistent compile cache: what compiling and kernel tuning produce is kept on disk and reused.

A compiled training step is built from torch's FX graph and AOTAutograd caches and inductor's
generated kernels (``TORCHINDUCTOR_CACHE_DIR``), and from Triton's compiled kernels and autotuning
results (``TRITON_CACHE_DIR``; ``fla``'s Gated DeltaNet kernels cache their autotuning there too).
torch keeps its caches in a temporary folder by default; :func:`use_compile_cache` points both at
one documented folder that outlives the run, so the second run of the same shapes on a machine (a
resume, another rank, the next experiment) starts warm: measured on one H200, each row bucket's
compilation drops from 8-11 s to about 1 s (``bench/packing/README.md``).

Where (``AsyncGRPOConfig.compile_cache_dir``, else the ``TOOLGYM_COMPILE_CACHE`` variable, else
``$XDG_CACHE_HOME/toolgym/compile``, i.e. ``~/.cache/toolgym/compile``)::

    <root>/.lock                     held while a run prepares its folder
    <root>/<key>/toolgym-cache.json  the versions that wrote this folder
    <root>/<key>/inductor/           TORCHINDUCTOR_CACHE_DIR
    <root>/<key>/triton/             TRITON_CACHE_DIR (kernels, autotuning results)

``<key>`` names the torch, Triton, CUDA and driver versions and the GPU's compute capability
(:func:`cache_versions`): another version gets its own folder and compiles from scratch instead of
loading artifacts it cannot run. Two runs starting at once are safe: a folder is created and
checked under an exclusive lock on ``<root>/.lock``, and torch and Triton write every entry
atomically (a temporary file renamed into place), so concurrent runs and the ranks of one run share
the folder. A folder whose manifest is missing or unreadable (a crash while it was made) is
replaced. A root that cannot be written is reported and the run goes on with torch's defaults.
``"off"`` turns the cache off: torch's caches are disabled and Triton writes to a temporary folder,
so every run compiles and tunes from scratch (for measuring a cold start).
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["CACHE_ENV", "cache_versions", "default_cache_root", "prepare_cache_dir", "resolve_cache_root",
           "use_compile_cache"]

logger = logging.getLogger(__name__)

CACHE_ENV = "TOOLGYM_COMPILE_CACHE"
"""The variable that moves the cache (a folder) or turns it off (``off``) when the config does not say."""
OFF = "off"
MANIFEST = "toolgym-cache.json"
LAYOUT = 1
"""This module's folder layout; a change of layout is a new key, like a new torch."""


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/toolgym/compile`` (``~/.cache/toolgym/compile`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "toolgym" / "compile"


def resolve_cache_root(configured: str | None) -> Path | None:
    """The cache's root folder, or ``None`` when it is off.

    Args:
        configured: ``AsyncGRPOConfig.compile_cache_dir``: a folder, ``"off"``, or ``None`` to defer
            to the ``TOOLGYM_COMPILE_CACHE`` variable and then to :func:`default_cache_root`.
    """
    value = configured if configured is not None else os.environ.get(CACHE_ENV) or None
    if value is None:
        return default_cache_root()
    if value.strip().lower() == OFF:
        return None
    return Path(value).expanduser()


def _driver_version() -> str:
    """The NVIDIA kernel driver's version (``/proc/driver/nvidia/version``), else ``"none"``."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "none"
    found = re.search(r"\b(\d+\.\d+(?:\.\d+)?)\b", text)
    return found.group(1) if found else "none"


def cache_versions() -> dict[str, str]:
    """What a cached artifact depends on: torch, Triton, CUDA, the driver and the GPU's compute capability."""
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = "none"
    gpu = "none"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"sm{major}{minor}"
    return {"layout": str(LAYOUT), "torch": torch.__version__, "triton": triton_version,
            "cuda": str(torch.version.cuda or "none"), "driver": _driver_version(), "gpu": gpu}


def cache_key(versions: Mapping[str, str]) -> str:
    """A folder name for ``versions``: readable, with a hash of all of them (so no two collide)."""
    digest = hashlib.sha256(json.dumps(dict(versions), sort_keys=True).encode()).hexdigest()[:12]
    readable = f"torch{versions.get('torch')}-triton{versions.get('triton')}-{versions.get('gpu')}"
    return f"{re.sub(r'[^A-Za-z0-9.-]+', '_', readable)}-{digest}"


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    """An exclusive lock on ``root/.lock`` (between processes; released if the holder dies)."""
    with open(root / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _manifest_matches(folder: Path, versions: Mapping[str, str]) -> bool:
    try:
        return bool(json.loads((folder / MANIFEST).read_text()) == dict(versions))
    except (OSError, ValueError):
        return False


def prepare_cache_dir(root: Path, versions: Mapping[str, str]) -> Path:
    """The folder of ``versions`` under ``root``, created (or replaced when its manifest does not
    match) under the root's lock; returns it.

    Raises:
        OSError: ``root`` cannot be created or written.
    """
    root.mkdir(parents=True, exist_ok=True)
    folder = root / cache_key(versions)
    with _locked(root):
        if folder.exists() and not _manifest_matches(folder, versions):
            stale = folder.with_name(f"{folder.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
            logger.warning("compile cache %s has no valid manifest (a run stopped while creating it?): "
                           "replacing it", folder)
            folder.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        if not folder.exists():
            tmp = folder.with_name(f"{folder.name}.new-{os.getpid()}")
            tmp.mkdir()
            (tmp / MANIFEST).write_text(json.dumps(dict(versions), sort_keys=True, indent=1))
            tmp.rename(folder)  # whole, with its manifest: no run sees a half-made folder
    for sub in ("inductor", "triton"):
        (folder / sub).mkdir(exist_ok=True)
    return folder


def _point_caches_at(inductor: str, triton: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
    os.environ["TRITON_CACHE_DIR"] = triton
    # Triton autotuners that do not ask for it themselves keep their results too (fla's do already).
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def use_compile_cache(configured: str | None) -> Path | None:
    """Point torch's and Triton's caches at the persistent folder for this software; returns it
    (``None``: the cache is off, or its root could not be written and torch's defaults apply).

    Call it before the first compilation of the process (it sets ``TORCHINDUCTOR_CACHE_DIR`` and
    ``TRITON_CACHE_DIR``, which compile workers inherit). Every rank calls it and gets the same folder.

    Args:
        configured: ``AsyncGRPOConfig.compile_cache_dir`` (see :func:`resolve_cache_root`).
    """
    root = resolve_cache_root(configured)
    if root is None:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
        scratch = tempfile.mkdtemp(prefix="toolgym-triton-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        _point_caches_at(os.path.join(scratch, "inductor"), scratch)
        logger.info("compile cache off: every compilation and kernel tuning starts from scratch")
        return None
    try:
        folder = prepare_cache_dir(root, cache_versions())
    except OSError as e:
        logger.warning("compile cache disabled: cannot write %s (%s); compilations are not kept between runs. "
                       "Set compile_cache_dir or %s to a writable folder, or to 'off'", root, e, CACHE_ENV)
        return None
    _point_caches_at(str(folder / "inductor"), str(folder / "triton"))
    logger.info("compile cache: %s", folder)
    return folder
