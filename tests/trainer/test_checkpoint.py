"""``StagedCheckpoints``: a checkpoint appears whole or not at all (the full-disk and SIGKILL runs
on the real stack are in test_faults.py; these check the protocol itself, in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import TrainerState
from transformers.trainer_utils import get_last_checkpoint

from trainer.checkpoint import ROLLOUT_STATE, STAGING_DIR, StagedCheckpoints
from trainer.exceptions import CheckpointSaveError


def _save(checkpoints: StagedCheckpoints, run: Path, step: int, fail: BaseException | None = None) -> None:
    """What the base Trainer does inside the block: write files under the run dir it is given."""
    with checkpoints.saving(run, TrainerState(global_step=step), {"first_untrained_position": step},
                            save_total_limit=2):
        folder = Path(checkpoints.output_dir(str(run))) / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        if fail is not None:
            raise fail
        (folder / "trainer_state.json").write_text("{}")


def test_a_save_is_published_whole_with_its_rollout_state_and_rotated_after(tmp_path: Path) -> None:
    checkpoints = StagedCheckpoints(barrier=lambda: None, is_main=True)
    for step in (1, 2, 3):
        _save(checkpoints, tmp_path, step)
        assert checkpoints.output_dir(str(tmp_path)) == str(tmp_path), "the redirect ends with the save"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]  # save_total_limit=2
    assert json.loads((tmp_path / "checkpoint-3" / ROLLOUT_STATE).read_text()) == {"first_untrained_position": 3}
    assert {p.name for p in (tmp_path / "checkpoint-3").iterdir()} == {
        "model.safetensors", "trainer_state.json", ROLLOUT_STATE}


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), RuntimeError("writer failed")])
def test_a_failed_save_leaves_nothing_and_names_the_last_good_checkpoint(tmp_path: Path, failure: Exception) -> None:
    checkpoints = StagedCheckpoints(barrier=lambda: None, is_main=True)
    _save(checkpoints, tmp_path, 1)
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint-2 .* failed .*newest usable checkpoint is "
                                                  r".*checkpoint-1") as info:
        _save(checkpoints, tmp_path, 2, fail=failure)
    assert info.value.__cause__ is failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"], "no partial checkpoint, no staging"
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-1")


def test_a_save_killed_half_way_is_invisible_and_cleared_by_the_next(tmp_path: Path) -> None:
    checkpoints = StagedCheckpoints(barrier=lambda: None, is_main=True)
    _save(checkpoints, tmp_path, 1)
    with pytest.raises(KeyboardInterrupt):  # not caught: stands for the process dying mid-save
        _save(checkpoints, tmp_path, 2, fail=KeyboardInterrupt())
    assert (tmp_path / STAGING_DIR / "checkpoint-2").is_dir(), "the half-written save stays in staging"
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-1"), "resume picks the whole one"
    _save(checkpoints, tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2"]


def test_the_best_checkpoint_is_named_where_it_is_published_and_spared_by_the_rotation(tmp_path: Path) -> None:
    checkpoints = StagedCheckpoints(barrier=lambda: None, is_main=True)
    state = TrainerState(best_global_step=1)
    for step in (1, 2, 3):
        state.global_step = step
        with checkpoints.saving(tmp_path, state, None, save_total_limit=2):
            staged = Path(checkpoints.output_dir(str(tmp_path)))
            folder = staged / f"checkpoint-{step}"
            folder.mkdir(parents=True)
            best = staged / "checkpoint-1"
            if best.exists():  # transformers' rule: the best folder under the run dir it writes into
                state.best_model_checkpoint = str(best)
            state.save_to_json(str(folder / "trainer_state.json"))
        assert state.best_model_checkpoint == str(tmp_path / "checkpoint-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-3"]  # the best is kept
    saved = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    assert saved["best_model_checkpoint"] == str(tmp_path / "checkpoint-1")
