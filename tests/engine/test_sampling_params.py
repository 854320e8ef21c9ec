"""logit_bias, penalties, min_p and logprobs without a model: the batched sampler equals a
plain per-row reference (tests/sampling_ref.py) on random mixed batches."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from sampling_ref import (
    reference_draw,
    reference_filter,
    reference_penalize,
    reference_process,
)

from engine.config import SamplingParams, check_vocab
from engine.metrics import RequestMetrics
from engine.runner import ModelRunner
from engine.sampler import (
    filter_batch,
    make_generator,
    process_logits,
    sample,
    token_histories,
    token_logprobs,
)
from engine.sequence import Sequence

VOCAB = 64


def random_params(rng: random.Random, seed: int) -> SamplingParams:
    """A row that sets each parameter or leaves it off, at random."""
    pick = rng.random
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 5, 20]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.6]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]) if pick() < 0.5 else 0.0,
        frequency_penalty=rng.choice([0.0, 0.3, 2.0]) if pick() < 0.5 else 0.0,
        repetition_penalty=rng.choice([1.0, 1.2, 0.8]) if pick() < 0.5 else 1.0,
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(3)}
        if pick() < 0.4
        else {},
        seed=seed,
    )


def random_batch(seed: int, rows: int = 12):
    """Logits, params and (prompt, output) histories of a random mixed batch."""
    rng = random.Random(seed)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    params = [random_params(rng, seed * 100 + r) for r in range(rows)]
    histories = [
        (
            [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))],
            [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))],
        )
        for _ in range(rows)
    ]
    return logits, params, histories


@pytest.mark.parametrize("seed", range(6))
def test_processed_logits_equal_the_reference(seed: int) -> None:
    logits, params, histories = random_batch(seed)
    processed = process_logits(logits, params, histories)
    filtered = filter_batch(processed, params)
    for r, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        want = reference_penalize(logits[r], p, prompt, output)
        torch.testing.assert_close(processed[r], want, rtol=1e-6, atol=1e-5)
        want = reference_filter(want, p)
        assert torch.equal(torch.isfinite(filtered[r]), torch.isfinite(want)), r
        kept = torch.isfinite(want)
        torch.testing.assert_close(filtered[r][kept], want[kept], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_and_seeded_choices_equal_the_reference(seed: int) -> None:
    logits, params, histories = random_batch(seed)
    gens = [make_generator(p) for p in params]
    ref_gens = [torch.Generator().manual_seed(p.seed) for p in params]
    for _ in range(5):  # one draw per step from each request's own generator
        chosen = sample(process_logits(logits, params, histories), params, gens)
        for r, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
            want = reference_process(logits[r], p, prompt, output)
            if p.greedy:
                assert chosen[r] == int(want.argmax()), r
            else:
                assert chosen[r] == reference_draw(want, ref_gens[r]), r


def test_rows_without_the_new_parameters_are_untouched() -> None:
    logits, params, histories = random_batch(7)
    plain = [
        SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p) for p in params
    ]
    assert process_logits(logits, plain, histories) is logits
    mixed = [plain[0], SamplingParams(presence_penalty=1.0), *plain[2:]]
    out = process_logits(logits, mixed, histories)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2:], logits[2:])
    assert not torch.equal(out[1], logits[1])


def test_penalties_follow_vllm_definitions() -> None:
    row = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    hist = [([0], [1, 2, 2])]  # token 0 in the prompt only, 1 once and 2 twice in the output
    rep = process_logits(row, [SamplingParams(repetition_penalty=2.0)], hist)
    assert rep.tolist() == [[1.0, -4.0, 0.5, 3.0]]  # prompt and output tokens, by sign
    freq = process_logits(row, [SamplingParams(frequency_penalty=0.5)], hist)
    assert freq.tolist() == [[2.0, -2.5, 0.0, 3.0]]  # output tokens only, per occurrence
    presence = process_logits(row, [SamplingParams(presence_penalty=0.5)], hist)
    assert presence.tolist() == [[2.0, -2.5, 0.5, 3.0]]  # output tokens only, once
    bias = process_logits(row, [SamplingParams(logit_bias={0: -100, 3: 1.5})], hist)
    assert bias.tolist() == [[-98.0, -2.0, 1.0, 4.5]]


def test_min_p_drops_tokens_below_a_share_of_the_top_probability() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = filter_batch(probs.log()[None], [SamplingParams(temperature=1.0, min_p=0.25)])
    assert torch.isfinite(x[0]).tolist() == [True, True, True, False]  # 0.05 < 0.125


def test_a_logit_bias_steers_greedy_decoding() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0]])
    p = SamplingParams(logit_bias={2: 10.0})
    assert sample(process_logits(logits, [p], [([], [])]), [p], [None]) == [2]


def test_allowed_token_ids_confine_greedy_and_sampled_choices() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0, 4.0], [1.0, 5.0, 2.0, 4.0]])
    only = SamplingParams(allowed_token_ids=[0, 2])
    plain = SamplingParams()
    x = process_logits(logits, [only, plain], [([], []), ([], [])])
    assert x[0].tolist() == [1.0, float("-inf"), 2.0, float("-inf")]
    assert x[1].tolist() == logits[1].tolist()  # a row without them is left as it was
    assert sample(x, [only, plain], [None, None]) == [2, 1]
    hot = SamplingParams(temperature=5.0, allowed_token_ids=[3], seed=1)
    gen = torch.Generator().manual_seed(1)
    picks = {sample(process_logits(logits[:1], [hot], [([], [])]), [hot], [gen])[0]
             for _ in range(20)}
    assert picks == {3}


def test_bad_words_bar_their_last_token_after_the_tokens_before_it() -> None:
    """vLLM's bad words on an output: [2] always; [1, 3] once the output ends in 1;
    [0, 1, 2] only after 0, 1."""
    logits = torch.zeros(3, 4)
    p = SamplingParams(bad_words_token_ids=[[2], [1, 3], [0, 1, 2]])
    x = process_logits(logits, [p, p, SamplingParams()], [([], [0, 1]), ([], [3]), ([], [1])])
    inf = float("-inf")
    assert x.tolist() == [[0.0, 0.0, inf, inf], [0.0, 0.0, inf, 0.0], [0.0] * 4]
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[]])


def test_logprobs_are_the_raw_log_softmax_with_top_k_and_rank() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(9))
    tokens, ks = [3, 10, 0, 63, 7], [0, 1, 5, 20, 3]
    out = token_logprobs(logits, tokens, ks)
    ref = torch.log_softmax(logits.float(), dim=-1)
    for r, lp in enumerate(out):
        assert lp.token_id == tokens[r]
        assert lp.logprob == pytest.approx(float(ref[r, tokens[r]]), abs=1e-6)
        assert lp.rank == 1 + int((ref[r] > ref[r, tokens[r]]).sum())
        order = torch.argsort(ref[r], descending=True)[: ks[r]].tolist()
        assert [t for t, _ in lp.top] == order
        assert [v for _, v in lp.top] == pytest.approx(ref[r, order].tolist(), abs=1e-6)
    assert out[0].top == () and len(out[3].top) == 20


def test_bfloat16_logits_give_float32_logprobs() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(10))
    out = token_logprobs(logits.bfloat16(), [1, 2], [2, 2])
    ref = torch.log_softmax(logits.bfloat16().float(), dim=-1)
    assert out[1].logprob == pytest.approx(float(ref[1, 2]), abs=1e-6)


def seq(rid: str, prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    s = Sequence(rid, prompt, params, RequestMetrics(0.0))
    s.output_token_ids.extend(output)
    return s


def test_the_runner_samples_processed_logits_and_records_raw_logprobs() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(11)) * 3
    params = [
        SamplingParams(logprobs=2, repetition_penalty=1.5, logit_bias={5: 4.0}),
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=3, logprobs=0, frequency_penalty=1.0),
    ]
    seqs = [seq(f"r{i}", [1, 2, 3], [4, 5, 5], p) for i, p in enumerate(params)]
    entries = [(s, 1) for s in seqs]
    runner = SimpleNamespace(speculative=False)
    gens = {"r2": make_generator(params[2])}
    out = ModelRunner.sample_rows(runner, logits, entries, [0, 1, 2], gens)
    ref = reference_process(logits[0], params[0], [1, 2, 3], [4, 5, 5])
    assert out[0] == int(ref.argmax()) and out[1] == int(logits[1].argmax())
    ref2 = reference_process(logits[2], params[2], [1, 2, 3], [4, 5, 5])
    assert out[2] == reference_draw(ref2, torch.Generator().manual_seed(3))
    raw = torch.log_softmax(logits, dim=-1)
    assert [lp.token_id for lp in seqs[0].logprobs] == [out[0]]
    assert seqs[0].logprobs[0].logprob == pytest.approx(float(raw[0, out[0]]), abs=1e-6)
    assert len(seqs[0].logprobs[0].top) == 2 and seqs[2].logprobs[0].top == ()
    assert seqs[1].logprobs == []


def test_a_verification_penalises_each_row_after_the_drafts_before_it() -> None:
    # one request verifying drafts [7, 8]: row j follows the output and drafts[:j]
    p = SamplingParams(frequency_penalty=2.0, presence_penalty=1.0, logprobs=1)
    s = seq("v", [1, 2], [3], p)
    s.spec_token_ids = [7, 8]
    assert token_histories([s, s, s]) == [([1, 2], [3]), ([1, 2], [3, 7]), ([1, 2], [3, 7, 8])]
    logits = torch.zeros(3, VOCAB)
    logits[0, 7] = logits[1, 8] = 5.0  # the drafts win even after their penalty
    logits[2, 7] = logits[2, 9] = 4.0  # 7 is penalised as a draft before it: 9 wins
    runner = SimpleNamespace(speculative=True)
    out = ModelRunner.sample_rows(runner, logits, [(s, 3)], [0, 0, 0], {})
    assert out == {0: [7, 8, 9]}
    assert [lp.token_id for lp in s.logprobs] == [7, 8, 9]
    assert s.logprobs[2].rank == 2  # in the raw logits 7 ties with 9 (vLLM ranks ties above)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(presence_penalty=3), "presence_penalty must be in [-2, 2], got 3"),
        (dict(frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(logit_bias={-1: 1.0}), "logit_bias: token ids must be integers >= 0"),
        (dict(logit_bias={5: 101}), "logit_bias[5] must be in [-100, 100]"),
        (dict(min_p=1.5), "min_p must be in [0, 1]"),
        (dict(logprobs=21), "logprobs must be >= 0 and <= 20"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be >= 0"),
    ],
)
def test_bad_values_name_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(message)


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    check_vocab(SamplingParams(logit_bias={49151: 1.0}), 49152)
    with pytest.raises(ValueError) as info:
        check_vocab(SamplingParams(logit_bias={99999: 1.0}), 49152)
    assert str(info.value) == ("logit_bias: token id 99999 is out of range (vocabulary of 49152)")
    check_vocab(SamplingParams(allowed_token_ids=[0, 49151]), 49152)
    with pytest.raises(ValueError, match=r"^allowed_token_ids: token id 49152 is out of range"):
        check_vocab(SamplingParams(allowed_token_ids=[5, 49152]), 49152)
    with pytest.raises(ValueError, match=r"^bad_words_token_ids: token id 60000 is out of"):
        check_vocab(SamplingParams(bad_words_token_ids=[[1], [2, 60000]]), 49152)
