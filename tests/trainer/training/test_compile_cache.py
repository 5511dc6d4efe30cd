"""The persistent compile cache (``trainer/training/compile_cache.py``): where it lives, how it is keyed
by versions, and two runs preparing it at once. CPU-visible logic; the warm second run on a GPU is in
``test_compile_cuda.py``."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config

from trainer.training import compile_cache
from trainer.training.compile_cache import (
    CACHE_ENV,
    MANIFEST,
    cache_key,
    cache_versions,
    prepare_cache_dir,
    resolve_cache_root,
    use_compile_cache,
)

VERSIONS = {"layout": "1", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "driver": "580.159.04",
            "gpu": "sm90"}


@pytest.fixture(autouse=True)
def _restore_cache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """use_compile_cache sets process-wide variables; every test gets them back as they were."""
    for name in (CACHE_ENV, "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING",
                 "XDG_CACHE_HOME"):
        monkeypatch.setenv(name, "")  # remembers the original value (or its absence) for the teardown
        monkeypatch.delenv(name)


def test_the_root_is_the_config_then_the_variable_then_the_user_cache(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_root(None) == tmp_path / "xdg" / "toolgym" / "compile"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "from-env"))
    assert resolve_cache_root(None) == tmp_path / "from-env"
    assert resolve_cache_root(str(tmp_path / "from-config")) == tmp_path / "from-config"
    assert resolve_cache_root(" OFF ") is None
    monkeypatch.setenv(CACHE_ENV, "off")
    assert resolve_cache_root(None) is None
    assert resolve_cache_root(str(tmp_path / "config-wins")) == tmp_path / "config-wins"


def test_the_key_changes_with_every_version() -> None:
    assert cache_key(VERSIONS) == cache_key(dict(VERSIONS))
    keys = {cache_key({**VERSIONS, name: "other"}) for name in VERSIONS}
    assert len(keys) == len(VERSIONS) and cache_key(VERSIONS) not in keys
    assert cache_key(VERSIONS).startswith("torch2.11.0_cu130-triton3.6.0-sm90-")
    here = cache_versions()
    assert set(here) == set(VERSIONS) and here["torch"] == torch.__version__


def test_a_second_run_reuses_the_folder_and_another_version_gets_its_own(tmp_path: Path) -> None:
    folder = prepare_cache_dir(tmp_path, VERSIONS)
    assert folder.parent == tmp_path
    assert json.loads((folder / MANIFEST).read_text()) == VERSIONS
    assert (folder / "inductor").is_dir() and (folder / "triton").is_dir()
    (folder / "triton" / "kernel.cubin").write_bytes(b"compiled")
    assert prepare_cache_dir(tmp_path, VERSIONS) == folder  # a resume, another rank, the next run
    assert (folder / "triton" / "kernel.cubin").read_bytes() == b"compiled"
    newer = prepare_cache_dir(tmp_path, {**VERSIONS, "triton": "3.7.0"})  # rebuilt, not loaded
    assert newer != folder and not (newer / "triton" / "kernel.cubin").exists()
    assert (folder / "triton" / "kernel.cubin").exists()  # the other version's cache is left alone


@pytest.mark.parametrize("manifest", [None, "{not json", json.dumps({**VERSIONS, "driver": "1"})],
                         ids=["missing", "unreadable", "another version"])
def test_a_folder_without_a_valid_manifest_is_replaced(tmp_path: Path, manifest: str | None) -> None:
    folder = tmp_path / cache_key(VERSIONS)
    (folder / "triton").mkdir(parents=True)
    (folder / "triton" / "half-written").write_bytes(b"?")
    if manifest is not None:
        (folder / MANIFEST).write_text(manifest)
    assert prepare_cache_dir(tmp_path, VERSIONS) == folder
    assert json.loads((folder / MANIFEST).read_text()) == VERSIONS
    assert not (folder / "triton" / "half-written").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".lock", folder.name])


def _prepare_at_once(root: str, barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    barrier.wait()
    out.put(str(prepare_cache_dir(Path(root), VERSIONS)))


def test_runs_that_start_at_once_share_one_folder(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    runs = 6
    barrier, out = ctx.Barrier(runs), ctx.Queue()
    procs = [ctx.Process(target=_prepare_at_once, args=(str(tmp_path), barrier, out)) for _ in range(runs)]
    for p in procs:
        p.start()
    folders = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert folders == {str(tmp_path / cache_key(VERSIONS))}
    assert json.loads((tmp_path / cache_key(VERSIONS) / MANIFEST).read_text()) == VERSIONS
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".lock", cache_key(VERSIONS)])  # nothing half-made


def test_use_points_torch_and_triton_at_the_folder(tmp_path: Path) -> None:
    folder = use_compile_cache(str(tmp_path))
    assert folder is not None and folder.parent == tmp_path
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(folder / "inductor")  # what inductor reads


def test_an_unwritable_root_is_reported_and_the_run_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    with caplog.at_level("WARNING", logger=compile_cache.__name__):
        assert use_compile_cache(str(tmp_path / "a-file" / "cache")) is None
    assert "compile cache disabled" in caplog.text and "writable folder" in caplog.text
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_off_disables_torch_caches_and_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not monkeypatch.setattr: its undo deletes the name, which torch's config module then hides for good.
    before = inductor_config.force_disable_caches
    inductor_config.force_disable_caches = False
    try:
        assert use_compile_cache("off") is None
        assert inductor_config.force_disable_caches
    finally:
        inductor_config.force_disable_caches = before
    scratch = Path(os.environ["TRITON_CACHE_DIR"])
    assert scratch.is_dir() and scratch.name.startswith("toolgym-triton-")
