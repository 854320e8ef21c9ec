"""engine.sampler without a model: greedy is argmax, temperature / top-k / top-p narrow the
choice, and a seed gives the same draws whatever else shares the batch."""

from __future__ import annotations

import math

import torch

from engine.config import SamplingParams
from engine.sampler import filter_batch, filter_logits, make_generator, sample

# token probabilities 0.15, 0.5, 0.05, 0.3: ranked 1 > 3 > 0 > 2 (not in index order, so
# top-p's sort and scatter back are exercised)
PROBS = (0.15, 0.5, 0.05, 0.3)
LOGITS = torch.tensor([math.log(p) for p in PROBS])


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 300) -> list[int]:
    """`n` draws of one row with one generator, as the engine makes them step after step."""
    g = make_generator(params)
    return [sample(logits[None], [params], [g])[0] for _ in range(n)]


def kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens left with a finite logit after filtering."""
    return set(torch.isfinite(filter_logits(logits, params)).nonzero().flatten().tolist())


def test_greedy_rows_are_the_argmax_and_need_no_generator() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams()] * 6
    assert make_generator(params[0]) is None
    assert sample(logits, params, [None] * 6) == logits.argmax(dim=-1).tolist()


def test_a_greedy_row_stays_the_argmax_beside_sampled_rows() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=0), SamplingParams()]
    out = sample(logits, params, [make_generator(p) for p in params])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_temperature_divides_the_logits() -> None:
    logits = torch.randn(20, generator=torch.Generator().manual_seed(2))
    got = filter_logits(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(got, logits / 2.0)


def test_a_low_temperature_always_picks_the_top_token_a_high_one_spreads() -> None:
    assert set(draws(LOGITS, SamplingParams(temperature=0.01, seed=0))) == {1}
    assert set(draws(LOGITS, SamplingParams(temperature=1.0, seed=0))) == {0, 1, 2, 3}


def test_top_k_keeps_the_k_most_likely_tokens() -> None:
    assert kept(LOGITS, SamplingParams(temperature=1.0, top_k=2)) == {1, 3}
    assert kept(LOGITS, SamplingParams(temperature=1.0, top_k=3)) == {0, 1, 3}
    assert kept(LOGITS, SamplingParams(temperature=1.0, top_k=0)) == {0, 1, 2, 3}  # off
    assert set(draws(LOGITS, SamplingParams(temperature=1.0, top_k=2, seed=0))) == {1, 3}


def test_top_p_keeps_the_smallest_set_that_reaches_p() -> None:
    # ranked probabilities 0.5, 0.3, 0.15, 0.05: cumulative 0.5, 0.8, 0.95, 1.0
    cases = {0.45: {1}, 0.7: {1, 3}, 0.9: {0, 1, 3}, 0.99: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for top_p, want in cases.items():
        assert kept(LOGITS, SamplingParams(temperature=1.0, top_p=top_p)) == want, top_p
    assert set(draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.7, seed=0))) == {1, 3}


def test_top_k_applies_before_top_p() -> None:
    # top-k 2 leaves 0.5 and 0.3, renormalised to 0.625 / 0.375: top-p 0.6 keeps one
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.6)
    assert kept(LOGITS, params) == {1}
    assert kept(LOGITS, SamplingParams(temperature=1.0, top_p=0.6)) == {1, 3}


def test_the_same_seed_gives_the_same_draws_another_seed_others() -> None:
    logits = torch.zeros(100)  # uniform: every draw is up to the generator
    a = draws(logits, SamplingParams(temperature=1.0, seed=7), n=50)
    b = draws(logits, SamplingParams(temperature=1.0, seed=7), n=50)
    c = draws(logits, SamplingParams(temperature=1.0, seed=8), n=50)
    assert a == b and a != c


def test_a_seeded_row_draws_the_same_alone_or_in_a_batch() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13, 14)]
    alone = [draws(logits[i], params[i], n=20) for i in range(4)]
    gens = [make_generator(p) for p in params]
    batched = [sample(logits, params, gens) for _ in range(20)]
    assert [[step[i] for step in batched] for i in range(4)] == alone


def test_an_unseeded_sampled_request_gets_its_own_generator() -> None:
    g = make_generator(SamplingParams(temperature=1.0))
    assert isinstance(g, torch.Generator) and g.device.type == "cpu"


MIXED = [SamplingParams(), SamplingParams(temperature=1.0, top_k=2, seed=1),
         SamplingParams(temperature=1.0, top_p=0.7, seed=2),
         SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=3)]


def test_filter_batch_equals_filter_logits_row_by_row() -> None:
    logits = torch.randn(len(MIXED), 50, generator=torch.Generator().manual_seed(4))
    batched = filter_batch(logits, MIXED)
    for i, p in enumerate(MIXED):
        torch.testing.assert_close(batched[i], filter_logits(logits[i], p))


def test_each_row_of_a_mixed_batch_keeps_its_own_parameters() -> None:
    rows = torch.stack([LOGITS, LOGITS, LOGITS, LOGITS])
    gens = [make_generator(p) for p in MIXED]
    seen: list[set[int]] = [set(), set(), set(), set()]
    for _ in range(300):
        for i, tok in enumerate(sample(rows, MIXED, gens)):
            seen[i].add(tok)
    # greedy: the argmax; top-k 2: the two most likely; top-p 0.7: {1, 3} (0.5 + 0.3);
    # temperature 0.7 sharpens to ~0.59/0.28/0.11/0.02 (tokens 1, 3, 0, 2): top-k 3 drops
    # token 2, and top-p 0.9 keeps the other three (0.60 + 0.29 < 0.9 before token 0)
    assert seen == [{1}, {1, 3}, {1, 3}, {0, 1, 3}]


def test_a_seeded_row_draws_the_same_beside_any_other_rows() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=21)
    alone = draws(logits, p, n=30)
    g = make_generator(p)
    others = [SamplingParams(), SamplingParams(temperature=1.0, top_k=5, seed=1)]
    other_gens = [None, make_generator(others[1])]
    mixed = []
    for step in range(30):
        noise = torch.randn(2, 100, generator=torch.Generator().manual_seed(step))
        batch = torch.cat([noise, logits[None]])  # the seeded row last, others vary
        mixed.append(sample(batch, [*others, p], [*other_gens, g])[2])
    assert mixed == alone


def test_a_vanishing_temperature_is_greedy_not_an_overflow():
    assert SamplingParams(temperature=5e-324).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
