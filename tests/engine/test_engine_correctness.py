"""Float32 greedy outputs of our engine equal transformers' `generate`, token for token."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.models.attention import AttentionMetadata, PrefillChunk
from engine.models.loaded import LoadedModel
from tests.conftest import TEST_DEVICE, hf_greedy

pytestmark = pytest.mark.model

TEXT = (
    "The history of computing is a story of machines that got faster and cheaper. "
    "Early computers filled rooms and used vacuum tubes; later, transistors and "
    "integrated circuits shrank them onto a single chip. Memory grew from kilobytes to "
    "gigabytes, and networks tied machines together across continents. Today a phone "
    "holds more power than the computers that sent people to the moon."
)
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    ids = loaded.encode(TEXT)
    lengths = [5, 37, 12, 70, 1, 23]
    return [ids[i : i + n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


def run_engine(loaded: LoadedModel, prompts, **cfg) -> list:
    config = EngineConfig(device="cpu", dtype="float32", **cfg)
    with Engine(config, loaded=loaded) as engine:
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
        return engine.generate(prompts, params), engine.stats()


def test_batch_matches_transformers(loaded, prompts, reference):
    outs, stats = run_engine(loaded, prompts)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert stats.kv.used_blocks == 0  # nothing leaked


def test_chunked_prefill_matches(loaded, prompts, reference):
    outs, stats = run_engine(loaded, prompts, max_num_batched_tokens=16)
    assert [o.token_ids for o in outs] == reference
    # the 70-token prompt needed several chunks: some step mixed prefill and decode
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats.recent_steps)


def test_preemption_matches(loaded, prompts, reference):
    # 12 blocks of 8 tokens = 96 slots: the 70-token prompt plus others cannot all fit
    outs, stats = run_engine(loaded, prompts, block_size=8, num_kv_blocks=12)
    assert stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert stats.kv.used_blocks == 0


def test_prefix_cache_hit_matches(loaded, prompts, hf_model):
    shared = loaded.encode(TEXT)[:48]
    tails = [[504, 3575], [2988, 314, 42], [7042]]
    batch = [shared + t for t in tails]
    ref = [hf_greedy(hf_model, p, MAX_NEW) for p in batch]
    config = EngineConfig(device="cpu", dtype="float32", block_size=16)
    with Engine(config, loaded=loaded) as engine:
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
        first = engine.generate(batch[:1], params)
        rest = engine.generate(batch[1:], params)
        stats = engine.stats()
    assert [o.token_ids for o in first + rest] == ref
    assert all(o.num_cached_tokens == 48 for o in rest)
    assert stats.kv.prefix_hits >= 96


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_random_models_match(kind, tiny_models):
    from transformers import AutoModelForCausalLM

    folder = tiny_models[kind]
    loaded = LoadedModel.load(str(folder), device=TEST_DEVICE, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf = hf.to(TEST_DEVICE)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    ref = [hf_greedy(hf, p, 16) for p in prompts]
    config = EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=4,
                          max_num_batched_tokens=20, num_kv_blocks=64)
    with Engine(config, loaded=loaded) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref


def test_prefill_logits_match_transformers(loaded, hf_model, prompts):
    ids = prompts[3]
    n = len(ids)
    model = loaded.model
    arch = model.arch
    shape = (arch.num_kv_heads, 8, 16, arch.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n, n, None)])
    ours = model.forward(torch.tensor(ids), torch.arange(n), meta, caches, torch.arange(n))
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


# ---- speculative decoding: the same tokens, drafts or not ---------------------------------
# n-grams from one token up, so short prompts get drafts too (many of them rejected)
SPEC = dict(speculative="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
            prompt_lookup_max=3)


@pytest.mark.parametrize(("case", "cfg"), [
    ("chunked prefill", dict(max_num_batched_tokens=16, num_kv_blocks=64)),
    ("preemption", dict(block_size=8, num_kv_blocks=12)),
])
def test_speculative_greedy_matches_transformers(loaded, prompts, reference, case, cfg):
    outs, stats = run_engine(loaded, prompts, **cfg, **SPEC)
    assert [o.token_ids for o in outs] == reference
    spec_decode = stats.spec_decode
    assert spec_decode.num_draft_tokens > spec_decode.num_accepted_tokens > 0  # accepted and rolled back
    assert sum(o.num_accepted_tokens for o in outs) == spec_decode.num_accepted_tokens
    for o in outs:  # by draft position: each accepted draft once, later ones no more often
        assert sum(o.accepted_per_position) == o.num_accepted_tokens
        assert list(o.accepted_per_position) == sorted(o.accepted_per_position, reverse=True)
        assert len(o.accepted_per_position) <= SPEC["num_speculative_tokens"]
    assert stats.kv.used_blocks == 0
    if case == "preemption":
        assert stats.num_preemptions > 0
    else:  # a step verified drafts while a long prompt was still prefilled in chunks
        assert any(s.num_draft_tokens and s.num_prefill_tokens for s in stats.recent_steps)


def test_speculative_prefix_cache_hit_matches(loaded, hf_model):
    shared = loaded.encode(TEXT)[:48]
    batch = [shared + t for t in ([504, 3575], [2988, 314, 42])]
    ref = [hf_greedy(hf_model, p, MAX_NEW) for p in batch]
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
                          **SPEC)
    with Engine(config, loaded=loaded) as engine:
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
        first = engine.generate(batch[:1], params)
        second = engine.generate(batch[1:], params)
        stats = engine.stats()
    assert [o.token_ids for o in first + second] == ref
    assert second[0].num_cached_tokens == 48 and stats.spec_decode.num_accepted_tokens > 0


def test_speculative_local_pc_matches_and_seeds_repeat(loaded, prompts, reference):
    from engine.local import LocalPC

    with LocalPC(loaded, n_ctx=256, **SPEC) as local:
        outs = local.generate(prompts[1:2], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True)
        again = [local.generate(prompts[3:4], sampled)[0].token_ids for _ in range(2)]
        stats = local.stats()
    assert [o.token_ids for o in outs] == reference[1:2]
    assert again[0] == again[1]
    assert stats.spec_decode.num_draft_tokens > stats.spec_decode.num_accepted_tokens > 0


# ---- parallel sampling: n candidates of one prompt ---------------------------------------
N_CASES = [
    ("plain", {}),
    ("chunked prefill", dict(max_num_batched_tokens=16, num_kv_blocks=64)),
    ("preemption", dict(block_size=8, num_kv_blocks=16)),
    ("speculation", dict(num_kv_blocks=64, **SPEC)),
]


@pytest.mark.parametrize(("case", "cfg"), N_CASES, ids=[c for c, _ in N_CASES])
def test_every_greedy_candidate_equals_the_single_answer(loaded, prompts, reference, case,
                                                         cfg):
    picked = [1, 3]  # 37 tokens (a partial last block to copy on write) and 70
    config = EngineConfig(device="cpu", dtype="float32", **cfg)
    with Engine(config, loaded=loaded) as engine:
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, n=4)
        outs = engine.generate([prompts[i] for i in picked], params)
        stats = engine.stats()
    for i, out in zip(picked, outs, strict=True):
        assert [c.token_ids for c in out.candidates] == [reference[i]] * 4
        assert out.token_ids == reference[i]
    assert stats.kv.used_blocks == 0
    if case == "preemption":
        assert stats.num_preemptions > 0
    if case == "speculation":
        assert stats.spec_decode.num_accepted_tokens > 0


def test_candidates_after_a_prefix_cache_hit_equal_the_single_answer(loaded, hf_model):
    ids = loaded.encode(TEXT)
    # 37 tokens: the hit covers 32, the fork copies the tail; 33: the hit is all but the
    # last token, so each candidate takes it
    batch = [ids[:37], ids[:33]]
    ref = [hf_greedy(hf_model, p, MAX_NEW) for p in batch]
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64)
    with Engine(config, loaded=loaded) as engine:
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
        engine.generate(batch, params)
        outs = engine.generate(batch, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, n=4))
    for out, want in zip(outs, ref, strict=True):
        assert [c.token_ids for c in out.candidates] == [want] * 4
        assert all(c.num_cached_tokens == 32 for c in out.candidates)


def test_seeded_candidate_i_equals_the_single_request_with_seed_plus_i(loaded, prompts):
    from engine.local import LocalPC

    sampled = dict(max_tokens=12, temperature=0.9, ignore_eos=True)
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64)
    with Engine(config, loaded=loaded) as engine:
        runs = [engine.generate(prompts[1:2], SamplingParams(n=3, seed=11, **sampled))[0]
                for _ in range(2)]
        singles = [engine.generate(prompts[1:2], SamplingParams(seed=11 + i, **sampled))[0]
                   for i in range(3)]
    texts = [[c.token_ids for c in r.candidates] for r in runs]
    assert texts[0] == texts[1] == [s.token_ids for s in singles]
    assert len({tuple(t) for t in texts[0]}) > 1  # the candidates differ
    with LocalPC(loaded, n_ctx=64) as local:
        out = local.generate(prompts[1:2], SamplingParams(n=2, seed=11, **sampled))[0]
        single = local.generate(prompts[1:2], SamplingParams(seed=12, **sampled))[0]
    assert out.candidates[1].token_ids == single.token_ids
    assert len(out.candidates) == 2 and out.candidates[0].text == out.text


def test_eight_candidates_hold_the_prompt_once(loaded):
    ids = (loaded.encode(TEXT) * 8)[:500]
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=256)
    with Engine(config, loaded=loaded) as engine:
        usage: list[float] = []
        engine.add_step_listener(lambda step: usage.append(step.kv_usage))
        out = engine.generate([ids], SamplingParams(max_tokens=64, ignore_eos=True, n=8))[0]
        steps = engine.stats().recent_steps
    peak = round(max(usage) * 256)
    assert peak <= -(-500 // 16) + 8 * -(-64 // 16) + 8  # 72: the prompt counted once
    assert [len(c.token_ids) for c in out.candidates] == [64] * 8
    # the prompt's 500 tokens are computed once; each candidate's first token comes from
    # its last row
    assert sum(s.num_prefill_tokens for s in steps) == 500
