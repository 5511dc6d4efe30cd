"""Crash-safe checkpoints: a checkpoint directory exists whole or not at all.

The base ``Trainer`` writes ``checkpoint-N`` file by file in place, and the trainer adds
``rollout_state.json`` after it: a process killed mid-save (SIGKILL, OOM) or a disk that fills up
half way leaves a ``checkpoint-N`` that ``resume_from_checkpoint=True`` picks as the newest and
cannot load, or one without its rollout state, whose resume would replay prompts from the start.

:class:`StagedCheckpoints` makes the save atomic: everything is written under a staging run
directory (``<output_dir>/.checkpoint-staging/checkpoint-N``, a name ``get_last_checkpoint`` and the
rotation ignore), then renamed into place in one ``os.rename`` on the same filesystem, and only then
are old checkpoints rotated out (``save_total_limit``). A save that fails (``ENOSPC``...) removes its
staging files, leaves every earlier checkpoint untouched and raises
:class:`~trainer.exceptions.CheckpointSaveError` naming the newest usable checkpoint. Only a kill
during the rename itself is not covered (it is one system call), nor power loss (no fsync).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from trainer.exceptions import CheckpointSaveError

STAGING_DIR = ".checkpoint-staging"
ROLLOUT_STATE = "rollout_state.json"


class StagedCheckpoints:
    """Redirects the base ``Trainer``'s checkpoint writes to a staging directory, then publishes them.

    Args:
        barrier: Waits for every process (``accelerator.wait_for_everyone``): all ranks write their
            RNG state into the staging directory before rank 0 renames it.
        is_main: Whether this process publishes (rank 0).
    """

    def __init__(self, barrier: Callable[[], None], is_main: bool) -> None:
        self.barrier = barrier
        self.is_main = is_main
        self.staging_root: Path | None = None  # set while a save is under way

    def output_dir(self, run_dir: str) -> str:
        """The run directory the base ``Trainer`` writes into: the staging one during a save."""
        return str(self.staging_root) if self.staging_root is not None else run_dir

    @contextmanager
    def saving(self, run_dir: str | os.PathLike[str], state: TrainerState, rollout_state: dict[str, Any] | None,
               save_total_limit: int | None) -> Iterator[None]:
        """Run the base save inside this block; on success ``checkpoint-<step>`` appears whole.

        The base save names the best checkpoint (``metric_for_best_model``) inside the run directory it
        wrote into, the staging one, and only if that folder holds it: the block names its published
        place instead (in ``state`` and in the saved ``trainer_state.json``), and rotation spares it.

        Args:
            run_dir: The real run directory (``output_dir``).
            state: The base ``Trainer``'s state (its ``global_step`` is the step being saved).
            rollout_state: What ``rollout_state.json`` records (rank 0), or ``None`` to write none.
            save_total_limit: The rotation limit, applied once the new checkpoint is in place.

        Raises:
            CheckpointSaveError: the save failed (disk full, permissions...); earlier checkpoints
                are intact and the message names the newest one.
        """
        run = Path(run_dir)
        staging = run / STAGING_DIR
        name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        self.barrier()
        if self.is_main:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
            staging.mkdir(parents=True, exist_ok=True)
        self.barrier()
        self.staging_root = staging
        try:
            yield
            self.barrier()
            if self.is_main:
                if rollout_state is not None:
                    (staging / name / ROLLOUT_STATE).write_text(json.dumps(rollout_state, indent=2))
                if _name_published_best(state, run) and (staging / name / TRAINER_STATE_NAME).exists():
                    state.save_to_json(str(staging / name / TRAINER_STATE_NAME))
                _publish(staging / name, run / name)
                rotate_checkpoints(output_dir=str(run), save_total_limit=save_total_limit,
                                   best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
        except Exception as exc:  # ENOSPC arrives as OSError, or wrapped by safetensors / torch.save
            if self.is_main:
                shutil.rmtree(staging, ignore_errors=True)  # frees the space the partial save took
            previous = get_last_checkpoint(str(run)) if run.is_dir() else None
            raise CheckpointSaveError(
                f"saving {name} into {run} failed ({type(exc).__name__}: {exc}); nothing of it was kept, "
                f"and the newest usable checkpoint is {previous or 'none (no checkpoint was saved before)'}"
            ) from exc
        finally:
            self.staging_root = None
        if self.is_main:
            shutil.rmtree(staging, ignore_errors=True)


def _name_published_best(state: TrainerState, run: Path) -> bool:
    """Point ``state.best_model_checkpoint`` at the best step's published folder; whether it changed."""
    if not state.best_global_step:
        return False
    best = run / f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}"
    if state.best_global_step != state.global_step and not best.exists():
        return False  # rotated out, or saved by an earlier run: transformers' own rule keeps what it had
    changed = state.best_model_checkpoint != str(best)
    state.best_model_checkpoint = str(best)
    return changed


def _publish(source: Path, target: Path) -> None:
    """Rename the finished checkpoint into place (replacing one of the same step: a resumed run)."""
    if target.exists():
        old = target.with_name(f".{target.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(source, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(source, target)
