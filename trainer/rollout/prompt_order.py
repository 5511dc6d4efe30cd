"""The order in which the rollout worker visits the training prompts, epoch after epoch.

A prompt's *position* counts prompts from the start of the run (epoch x epoch size + offset); it is
what the trainer's epoch progress and a checkpoint's ``rollout_state.json`` record.

* A map-style dataset (it has ``len``) is visited in a fresh permutation per epoch, seeded by
  ``seed + epoch``; a resume starts at any position without replaying the ones before it.
* A streaming dataset (``datasets.IterableDataset``, or any iterable without ``len``) is iterated
  pass after pass, calling its ``set_epoch(epoch)`` first when it has one (a shuffled stream then
  reshuffles each epoch). Its size is known once the first pass ends and is reported then, before
  any prompt of the second pass is produced, so the trainer can count epochs in distinct prompts as
  for a map-style dataset. A stream cannot be repositioned: a resumed run starts it again from its
  first prompt (as TRL's AsyncGRPOTrainer does).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from trainer.exceptions import ConfigError, RolloutWorkerError

PromptRow = tuple[int, int, dict[str, Any], int]
"""(position, row_index, row, epoch): ``row_index`` is the row's index in the dataset (its offset in
the pass for a stream)."""


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a stream (iterable without ``len``: it cannot be indexed or repositioned)."""
    return dataset is not None and not hasattr(dataset, "__len__")


def first_row_columns(dataset: Any) -> list[str]:
    """The dataset's column names (a stream built from a generator may not declare them: its first row's keys)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None and dataset is not None:
        first = next(iter(dataset), None)
        columns = list(first) if isinstance(first, dict) else []
    return list(columns or [])


def check_prompt(prompt: Any, where: str) -> None:
    """Refuse a prompt that is not a conversation (a list of ``{"role", "content"}`` messages).

    Args:
        prompt: A dataset row's ``prompt`` value.
        where: Names the row in the error, e.g. ``"train_dataset row 17"``.

    Raises:
        ConfigError: naming the row and showing the start of what it holds.
    """
    ok = (isinstance(prompt, list) and bool(prompt)
          and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))
    if not ok:
        raise ConfigError(f"{where}: 'prompt' must be conversational, a non-empty list of "
                          "{'role': ..., 'content': ...} messages, e.g. [{'role': 'user', 'content': 'What is "
                          f"2+2?'}}]; got {prompt!r:.200}")


def map_style_rows(dataset: Any, seed: int, start_position: int) -> Iterator[PromptRow]:
    """Rows of a map-style dataset from ``start_position`` on, a seeded permutation per epoch, forever."""
    n = len(dataset)
    position, order, order_epoch = start_position, [], -1
    while True:
        epoch, offset = divmod(position, n)
        if epoch != order_epoch:
            order = list(range(n))
            random.Random(seed + epoch).shuffle(order)
            order_epoch = epoch
        yield position, order[offset], dict(dataset[order[offset]]), epoch
        position += 1


def stream_rows(dataset: Any, report_epoch_size: Callable[[int], None]) -> Iterator[PromptRow]:
    """Rows of a streaming dataset, pass after pass from its first prompt, forever.

    Args:
        dataset: The stream.
        report_epoch_size: Called once, with the number of prompts of a pass, when the first pass ends.

    Raises:
        RolloutWorkerError: The stream yields no row at all.
    """
    position, epoch = 0, 0
    while True:
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        size = 0
        for size, row in enumerate(dataset, start=1):
            yield position, size - 1, dict(row), epoch
            position += 1
        if size == 0:
            raise RolloutWorkerError("train_dataset (a stream) yielded no prompt")
        if epoch == 0:
            report_epoch_size(size)
        epoch += 1
