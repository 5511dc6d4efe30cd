"""Turn a rollout's sampling requests into training sequences (docs/multiturn.md).

Each turn's prompt is the whole conversation re-rendered by the chat template, so it normally
starts with every token held so far (the previous prompt plus what the model generated): the
turn then *extends* the current sequence, the new prompt tokens (tool results, the template's
glue) entering as untrained context. When the template renders history differently (it drops
earlier reasoning, re-tokenizes a message differently...), the prompt does not start with the held
tokens and the turn *forks* a new sequence whose context is its whole prompt. Every generated token
is trained in exactly one sequence; a fork only costs forwarded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.records import TrainingSequence, TurnRecord


@dataclass
class ReconcileStats:
    """What reconciliation did (``rollout/fork_frac``, ``rollout/drift_tokens_*``).

    Attributes:
        transitions: Turn-to-turn transitions (turns - 1).
        forks: Transitions that started a new sequence.
        drift_tokens: Per transition, the held tokens a fork re-rendered (0 for an extension).
    """

    transitions: int = 0
    forks: int = 0
    drift_tokens: list[int] = field(default_factory=list)


class _Builder:
    """The sequence being assembled."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[dict[int, float] | None] = []
        self.candidates: list[list[int] | None] = []

    def context(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.tops += [None] * len(ids)
        self.candidates += [None] * len(ids)

    def generated(self, turn: TurnRecord) -> None:
        n = len(turn.output_ids)
        if turn.output_log_probs and len(turn.output_log_probs) != n:
            raise ValueError(f"turn has {n} output tokens but {len(turn.output_log_probs)} log-probs")
        mask = turn.output_mask if turn.output_mask is not None else [1] * n
        if any(mask) and not turn.output_log_probs:
            raise ValueError("a turn whose tokens are trained needs output_log_probs")
        self.ids += turn.output_ids
        self.mask += list(mask)
        self.logprobs += list(turn.output_log_probs) if turn.output_log_probs else [0.0] * n
        self.tops += list(turn.output_sampler_logprobs) if turn.output_sampler_logprobs else [None] * n
        self.candidates += list(turn.output_sampling_mask) if turn.output_sampling_mask else [None] * n

    def build(self) -> TrainingSequence | None:
        if not any(self.mask):
            return None
        has_candidates = any(c is not None for c in self.candidates)
        return TrainingSequence(
            input_ids=self.ids, loss_mask=self.mask, sampler_logprobs=self.logprobs,
            sampler_top_logprobs=self.tops, sampling_masks=self.candidates if has_candidates else None,
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reconcile_turns(turns: list[TurnRecord]) -> tuple[list[TrainingSequence], ReconcileStats]:
    """Build the training sequences of one rollout from its turns, in order.

    Returns:
        The sequences (those with at least one trained token) and the reconciliation stats.
    """
    stats = ReconcileStats()
    sequences: list[TrainingSequence] = []
    current: _Builder | None = None
    for turn in turns:
        if current is None:
            current = _Builder()
            current.context(list(turn.prompt_ids))
        else:
            stats.transitions += 1
            held = current.ids
            if turn.prompt_ids[: len(held)] == held:
                stats.drift_tokens.append(0)
                current.context(list(turn.prompt_ids[len(held):]))
            else:
                stats.forks += 1
                stats.drift_tokens.append(len(held) - _common_prefix(held, turn.prompt_ids))
                done = current.build()
                if done is not None:
                    sequences.append(done)
                current = _Builder()
                current.context(list(turn.prompt_ids))
        current.generated(turn)
    if current is not None:
        done = current.build()
        if done is not None:
            sequences.append(done)
    return sequences, stats
