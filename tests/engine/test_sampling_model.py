"""Logprobs and logit processing on the real model (float32, CPU): prompt and sample
logprobs equal transformers' log_softmax, and greedy decoding with penalties and
logit_bias equals a teacher-forced reference, on the engine and the local PC."""

from __future__ import annotations

import pytest
import torch
from kv_checks import check_invariants
from sampling_ref import reference_process

from engine import Engine, EngineConfig, SamplingParams, TokenLogprob
from engine.local import LocalPC
from tests.conftest import hf_greedy

pytestmark = pytest.mark.model

TEXT = (
    "The history of computing is a story of machines that got faster and cheaper. "
    "Early computers filled rooms and used vacuum tubes; later, transistors and "
    "integrated circuits shrank them onto a single chip. The history of computing is a "
    "story of machines that got faster and cheaper."
)
K = 3
TOL = 1e-4
CPU32 = dict(device="cpu", dtype="float32")


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits of every position of `ids`."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def check_entry(lp: TokenLogprob, token: int, row: torch.Tensor, k: int) -> None:
    """One entry against a reference log_softmax row: logprob, top-k values, rank."""
    assert lp.token_id == token
    assert abs(lp.logprob - float(row[token])) < TOL
    assert [v for _, v in lp.top] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
    above = int((row > row[token] + TOL).sum())  # surely above; near-ties may go either way
    assert above + 1 <= lp.rank <= int((row >= row[token] - TOL).sum())


def check_prompt_logprobs(got: list, ids: list[int], logprobs: torch.Tensor) -> None:
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        check_entry(got[p], ids[p], logprobs[p - 1], K)


def check_sample_logprobs(got: list, prompt: list[int], out: list[int], logprobs) -> None:
    assert len(got) == len(out)
    for j, token in enumerate(out):
        check_entry(got[j], token, logprobs[len(prompt) - 1 + j], K)


@pytest.fixture(scope="module")
def ids(loaded) -> list[int]:
    return loaded.encode(TEXT)


ASKED = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=K, prompt_logprobs=K)


def test_engine_logprobs_match_transformers_chunked_and_with_a_cached_prefix(loaded, hf_model, ids):
    # 16 tokens a step: the prompt is prefilled in several chunks
    config = EngineConfig(**CPU32, block_size=16, max_num_batched_tokens=16)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    with Engine(config, loaded=loaded) as engine:
        engine.generate([ids], plain)  # caches the prompt's full blocks
        handle = engine.submit(ids, ASKED)
        for _ in handle:  # each pushed token's entry is there when its count is
            assert len(handle.token_logprobs) >= handle.num_tokens
        out = handle.result()
        [again] = engine.generate([ids], plain)
        stats = engine.stats()
    assert len(ids) > 2 * config.max_num_batched_tokens
    assert out.num_cached_tokens == 0  # no prefix hit for a prompt-logprobs request
    assert again.num_cached_tokens == len(ids) // 16 * 16  # its blocks serve others
    assert handle.token_logprobs == out.logprobs
    logprobs = torch.log_softmax(hf_logits(hf_model, ids + out.token_ids), dim=-1)
    check_prompt_logprobs(out.prompt_logprobs, ids, logprobs)
    check_sample_logprobs(out.logprobs, ids, out.token_ids, logprobs)
    assert all(lp.rank == 1 for lp in out.logprobs)  # greedy: the argmax
    assert stats.kv.used_blocks == 0


def test_local_pc_logprobs_match_transformers_one_token_chunks(loaded, hf_model, ids, monkeypatch):
    # one-token prompt chunks: prompt positions run as decode rows
    monkeypatch.setattr("engine.local.PREFILL_CHUNK", 1)
    prompt = ids[:12]
    with LocalPC(loaded, n_ctx=128) as local:
        [out] = local.generate([prompt], ASKED)
    logprobs = torch.log_softmax(hf_logits(hf_model, prompt + out.token_ids), dim=-1)
    check_prompt_logprobs(out.prompt_logprobs, prompt, logprobs)
    check_sample_logprobs(out.logprobs, prompt, out.token_ids, logprobs)


def penalized(hf_model, ids: list[int]) -> SamplingParams:
    """Greedy with every logit-changing parameter; the plain first choice banned."""
    banned = int(hf_logits(hf_model, ids)[-1].argmax())
    return SamplingParams(
        max_tokens=16,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={banned: -100.0, 13: 2.0},
        logprobs=1,
    )


def check_teacher_forced(hf_model, ids: list[int], params: SamplingParams, out) -> None:
    """Each output token is the argmax of the reference processing of transformers' logits
    after the prompt and the output before it."""
    logits = hf_logits(hf_model, ids + out.token_ids)
    for j, token in enumerate(out.token_ids):
        row = reference_process(logits[len(ids) - 1 + j], params, ids, out.token_ids[:j])
        assert token == int(row.argmax()), j


def test_greedy_with_penalties_equals_a_teacher_forced_reference(loaded, hf_model, ids):
    params = penalized(hf_model, ids)
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    other = ids[5:30]
    with Engine(EngineConfig(**CPU32), loaded=loaded) as engine:  # beside a plain row
        out, beside = engine.generate([ids, other], [params, plain])
    with LocalPC(loaded, n_ctx=256) as local:
        [local_out] = local.generate([ids], params)
    check_teacher_forced(hf_model, ids, params, out)
    assert out.token_ids[0] != next(iter(params.logit_bias))
    assert local_out.token_ids == out.token_ids
    # logprobs stay raw: the model's, not the penalised distribution
    logprobs = torch.log_softmax(hf_logits(hf_model, ids), dim=-1)[-1]
    assert abs(out.logprobs[0].logprob - float(logprobs[out.token_ids[0]])) < TOL
    assert out.logprobs[0].rank > 1  # the banned token was the raw argmax
    assert beside.token_ids == hf_greedy(hf_model, other, 16)


def test_speculative_greedy_with_penalties_equals_the_reference(loaded, hf_model, ids):
    # mild penalties: the answer still copies the prompt's repeated sentence, so n-gram
    # drafts are proposed (strong ones steer it off every token it has seen)
    params = SamplingParams(
        max_tokens=16,
        ignore_eos=True,
        frequency_penalty=0.3,
        repetition_penalty=1.05,
        logit_bias={13: 1.0},
        logprobs=1,
    )
    speculative = dict(speculative="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    with Engine(EngineConfig(**CPU32, **speculative), loaded=loaded) as engine:
        [out] = engine.generate([ids], params)
        drafts = engine.stats().spec_decode.num_draft_tokens
    check_teacher_forced(hf_model, ids, params, out)
    assert drafts > 0 and len(out.logprobs) == len(out.token_ids)


def test_preempted_and_cancelled_requests_record_once_and_leak_nothing(loaded, ids):
    prompts = [ids[:5], ids[3:40], ids[:1], ids[10:60], ids[20:43]]
    params = SamplingParams(
        max_tokens=20,
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=K,
        presence_penalty=0.5,
        repetition_penalty=1.1,
    )
    with Engine(EngineConfig(**CPU32, num_kv_blocks=64), loaded=loaded) as engine:
        calm = engine.generate(prompts, params)
    # 12 blocks of 8 tokens: requests are preempted and recomputed
    config = EngineConfig(**CPU32, block_size=8, num_kv_blocks=12, max_num_batched_tokens=32)
    with Engine(config, loaded=loaded) as engine:
        tight = engine.generate(prompts, params)
        handle = engine.submit(ids, params)
        handle.cancel()
        cancelled = handle.result(timeout=120)
        stats = engine.stats()
        check_invariants(engine.kv)
    assert stats.num_preemptions > 0 and stats.kv.used_blocks == 0
    assert cancelled.finish_reason == "cancelled"
    for a, b, prompt in zip(calm, tight, prompts, strict=True):
        assert a.token_ids == b.token_ids
        assert len(b.prompt_logprobs) == len(prompt) and len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < TOL
    assert tight[2].prompt_logprobs == [None]
