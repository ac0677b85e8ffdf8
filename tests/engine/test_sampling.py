"""Sampler: greedy, filters, seeded reproducibility, batch independence, logprobs."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.runner.sampling import Sampler, filtered_probs, make_generator
from splitserve.ipc.messages import SamplingParams

V = 8
NUM_DRAWS = 4000


def _logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def _draw_many(
    logits_row: torch.Tensor, params: SamplingParams, n: int = NUM_DRAWS
) -> torch.Tensor:
    """``n`` draws for one row, batched as ``n`` copies of the row (one generator for all)."""
    logits = logits_row.expand(n, -1).contiguous()
    torch.manual_seed(1234)
    ids, _ = Sampler().sample(logits, [params] * n, [None] * n)
    return ids


def test_greedy_is_argmax_and_logprob_is_log_softmax() -> None:
    logits = _logits(5, 50)
    params = [SamplingParams(temperature=0.0)] * 5
    ids, logprobs = Sampler().sample(logits, params, [None] * 5)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected)


def test_top_k_one_is_greedy_even_with_high_temperature() -> None:
    logits = _logits(4, 50)
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    gens = [make_generator(i) for i in range(4)]
    ids, _ = Sampler().sample(logits, params, gens)
    assert torch.equal(ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = _logits(6, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    ids, logprobs = Sampler().sample(logits, params, [make_generator(i) for i in range(6)])
    argmax = logits.argmax(-1)
    assert torch.equal(ids[1::2], argmax[1::2])
    expected = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected)


def test_logprob_uses_raw_logits_not_tempered_or_filtered() -> None:
    logits = _logits(3, 50)
    params = [
        SamplingParams(temperature=0.3, top_k=5, top_p=0.8, min_p=0.05, seed=i) for i in range(3)
    ]
    ids, logprobs = Sampler().sample(logits, params, [make_generator(i) for i in range(3)])
    expected = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected)


def _seq(logits: torch.Tensor, params: SamplingParams, seed: int, steps: int = 20) -> list[int]:
    gen = make_generator(seed)
    return [int(Sampler().sample(logits, [params], [gen])[0][0]) for _ in range(steps)]


def test_same_seed_same_tokens() -> None:
    logits = _logits(1, 100)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    assert _seq(logits, params, 7) == _seq(logits, params, 7)
    assert _seq(logits, params, 7) != _seq(logits, params, 8)  # 20 draws over 100 tokens


def test_seeded_row_is_independent_of_the_batch() -> None:
    vocab = 200
    row = _logits(1, vocab, seed=3)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=42)
    alone = _seq(row, params, 42)

    others = _logits(4, vocab, seed=9)
    other_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0.5, top_p=0.5),
        SamplingParams(temperature=1.0),
    ]
    gen = make_generator(42)
    other_gens = [None, make_generator(1), None, make_generator(2)]
    in_batch = []
    for _ in range(20):
        logits = torch.cat([others[:2], row, others[2:]])
        batch_params = other_params[:2] + [params] + other_params[2:]
        ids, _ = Sampler().sample(logits, batch_params, other_gens[:2] + [gen] + other_gens[2:])
        in_batch.append(int(ids[2]))
    assert in_batch == alone


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=1.0, top_k=3), 3),
        (SamplingParams(temperature=2.0, top_k=2, top_p=1.0), 2),
    ],
)
def test_top_k_never_picks_outside_top_k(params: SamplingParams, allowed: int) -> None:
    row = _logits(1)[0]
    ids = _draw_many(row, params)
    top = set(row.topk(allowed).indices.tolist())
    assert set(ids.tolist()) == top  # every allowed token shows up in 4000 draws, nothing else


def test_top_p_keeps_smallest_nucleus() -> None:
    row = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.05, 0.03, 0.02]))
    # mass before: 0, .5, .75, .9, .95 -> top_p=0.8 keeps tokens 0, 1, 2
    ids = _draw_many(row, SamplingParams(temperature=1.0, top_p=0.8))
    assert set(ids.tolist()) == {0, 1, 2}


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    row = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    # threshold 0.3 * 0.4 = 0.12 keeps tokens 0, 1, 2
    ids = _draw_many(row, SamplingParams(temperature=1.0, min_p=0.3))
    assert set(ids.tolist()) == {0, 1, 2}


def test_filters_with_neighbours_in_batch() -> None:
    """A row's filters do not leak onto rows with filters off (one sort serves the batch)."""
    logits = _logits(2, 50)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)]
    probs = filtered_probs(logits, params)
    assert int((probs[0] > 0).sum()) == 2
    assert int((probs[1] > 0).sum()) == 50


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(temperature: float) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    n = 20000
    ids = _draw_many(row, SamplingParams(temperature=temperature), n)
    observed = torch.bincount(ids, minlength=row.numel()).double()
    expected = torch.softmax(row.double() / temperature, -1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 30.0  # 5 dof: p < 1e-5 of a false alarm


def test_make_generator_none_without_seed() -> None:
    assert make_generator(None) is None
    gen = make_generator(3)
    assert isinstance(gen, torch.Generator) and gen.initial_seed() == 3


def test_rejects_mismatched_params() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(_logits(2), [SamplingParams()], [None])
