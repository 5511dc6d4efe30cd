"""Chunked LM-head log-probs equal the naive full-logits computation, values and gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.training.logprobs import logprobs_from_hidden
from trainer.training.packing import PackedRow

N, D, V, K, M = 23, 16, 40, 5, 7


def random_row(seed: int, trained: int = 17) -> PackedRow:
    """A row whose trained tokens have random targets, top-k ids and (for half of them) candidate sets."""
    g = torch.Generator().manual_seed(seed)
    candidate_ids = torch.randint(0, V, (trained, M), generator=g)
    candidate_valid = torch.rand(trained, M, generator=g) < 0.7
    candidate_valid[::2] = False  # every other token: full vocabulary
    targets = torch.randint(0, V, (trained,), generator=g)
    has_set = candidate_valid.any(-1)
    targets[has_set] = candidate_ids[has_set, candidate_valid[has_set].int().argmax(-1)]  # a target is a candidate
    return dataclasses.replace(
        PackedRow.empty(),
        input_ids=torch.zeros(N, dtype=torch.long),
        pred_index=torch.randint(0, N, (trained,), generator=g),
        target_ids=targets,
        sampler_topk_ids=torch.randint(0, V, (trained, K), generator=g),
        candidate_ids=candidate_ids,
        candidate_valid=candidate_valid,
    )


def naive(hidden: torch.Tensor, head: torch.nn.Linear, row: PackedRow, temperature: float):
    logits = head(hidden).float() / temperature  # (N, V): the tensor the chunked path never builds
    z = logits[row.pred_index]  # (T, V)
    keep = torch.zeros_like(z, dtype=torch.bool)
    for t, (ids, valid) in enumerate(zip(row.candidate_ids, row.candidate_valid, strict=True)):
        keep[t, ids[valid]] = True  # a padding entry never hides a valid one of the same id
    z = z.masked_fill(~(keep | ~row.candidate_valid.any(-1, keepdim=True)), float("-inf"))
    logp = torch.log_softmax(z, -1)
    entropy = -(logp.exp() * logp.masked_fill(z == float("-inf"), 0)).sum(-1)
    return logp.gather(1, row.target_ids[:, None]).squeeze(1), logp.gather(1, row.sampler_topk_ids), entropy


@pytest.mark.parametrize("chunk_size", [1, 4, 17, 512])
def test_chunked_equals_naive(chunk_size: int) -> None:
    torch.manual_seed(0)
    row = random_row(chunk_size)
    head = torch.nn.Linear(D, V, bias=True)
    hidden = torch.randn(N, D, requires_grad=True)
    out = logprobs_from_hidden(hidden, head, row, temperature=0.8, chunk_size=chunk_size)
    ref_logp, ref_topk, ref_entropy = naive(hidden, head, row, 0.8)
    torch.testing.assert_close(out.logp, ref_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.topk_logp, ref_topk, rtol=0, atol=1e-6)  # -inf outside the candidate set
    torch.testing.assert_close(out.entropy, ref_entropy, rtol=0, atol=1e-5)
    assert not out.entropy.requires_grad

    weights = torch.randn(row.num_trained)
    finite = torch.isfinite(ref_topk)
    grads = torch.autograd.grad(weights @ out.logp + out.topk_logp[finite].sum(), [hidden, head.weight, head.bias])
    ref_grads = torch.autograd.grad(weights @ ref_logp + ref_topk[finite].sum(), [hidden, head.weight, head.bias])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_padding_of_a_shorter_candidate_set_hides_nothing() -> None:
    """Token 0 is a candidate of the first token; the padding of its shorter set is id 0 too."""
    row = dataclasses.replace(
        random_row(0, trained=2),
        target_ids=torch.tensor([0, 3]),
        candidate_ids=torch.tensor([[0, 5, 0], [3, 4, 6]]),
        candidate_valid=torch.tensor([[True, True, False], [True, True, True]]),
    )
    out = logprobs_from_hidden(torch.randn(N, D), torch.nn.Linear(D, V), row, temperature=1.0)
    assert torch.isfinite(out.logp).all()


def test_a_row_without_trained_tokens_still_reaches_the_parameters() -> None:
    head = torch.nn.Linear(D, V, bias=False)
    hidden = torch.randn(1, D, requires_grad=True)
    out = logprobs_from_hidden(hidden, head, PackedRow.empty(), temperature=1.0)
    assert out.logp.shape == (0,) and out.topk_logp.shape == (0, 0)
    out.logp.sum().backward()
    assert not hidden.grad.any() and not head.weight.grad.any()


def test_temperature_must_be_positive_and_the_head_plain() -> None:
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_hidden(torch.randn(1, D), torch.nn.Linear(D, V), PackedRow.empty(), temperature=0.0)
    wrapped_head = torch.nn.Sequential(torch.nn.Linear(D, V))  # stands for an adapter-wrapped head
    with pytest.raises(TypeError, match="plain nn.Linear"):
        logprobs_from_hidden(torch.randn(1, D), wrapped_head, PackedRow.empty(), temperature=1.0)
