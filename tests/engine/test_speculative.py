"""Speculative decoding without a model: the n-gram proposer, the acceptance rule, the
rollback of rejected drafts in the KV cache, and the sampled output distribution.

Stand-ins (unit tests only): `FakeBigramModel` is a small-vocabulary model whose
next-token logits depend only on the previous token; `FakeBigramRunner` scores a step with
it and hands the logits to the real `verify_batch`; `FakeScriptedRunner` accepts as many
drafts as a test script says. The engine core, scheduler, KV cache, proposer and
acceptance rule under test are the real ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kv_checks import check_invariants

from engine import speculative
from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore, Request
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheManager
from engine.metrics import RequestMetrics
from engine.sampler import draw, filter_logits, make_generator
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.speculative import (
    NgramProposer,
    SpecDecodeStats,
    Speculation,
    accept_greedy,
    accept_sampled,
    draft_limit,
    verify_batch,
)

EOS = 2


class FakeTokenizer:
    """Stand-in tokenizer: token i decodes to "<i>"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakeBigramModel:
    """Stand-in model over a small vocabulary: logits of the next token are a fixed random
    row per previous token (seeded), peaked enough that drafts are sometimes right."""

    def __init__(self, vocab: int = 4, seed: int = 0, scale: float = 2.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(vocab, vocab, generator=g) * scale

    def logits(self, prev: list[int]) -> torch.Tensor:
        return self.table[torch.tensor(prev) % self.vocab]


class FakeBigramRunner:
    """Stand-in model runner: one logits row per sampled position (every position of a
    verification), from `FakeBigramModel`, sampled by the real `verify_batch`."""

    def __init__(self, model: FakeBigramModel) -> None:
        self.model = model

    def execute(self, entries, block_tables, generators):
        prev, rows = [], []
        for i, (seq, n) in enumerate(entries):
            drafts = seq.spec_token_ids
            if seq.num_computed_tokens + n == seq.num_tokens + len(drafts):
                prev += [seq.token_ids[-1], *drafts]
                rows += [i] * (len(drafts) + 1)
        if not rows:
            return {}
        return verify_batch(self.model.logits(prev), entries, rows, generators)


class FakeScriptedRunner:
    """Stand-in model runner: a verification accepts as many drafts as the next entry of
    `script` says (popped from its end), then adds its token; a plain entry samples
    `token`. Checks that every
    scheduled request holds blocks for what it computes."""

    def __init__(self, block_size: int, token: int = 7) -> None:
        self.block_size, self.token = block_size, token
        self.script: list[tuple[int, int]] = []  # (drafts accepted, the token after them)

    def execute(self, entries, block_tables, generators):
        out = {}
        for i, (seq, n) in enumerate(entries):
            held = len(block_tables[seq.request_id]) * self.block_size
            assert held >= seq.num_computed_tokens + n, "scheduled without enough blocks"
            drafts = seq.spec_token_ids
            if drafts:
                assert n == 1 + len(drafts)
                accepted, token = self.script.pop() if self.script else (0, self.token)
                out[i] = drafts[: min(accepted, len(drafts))] + [token]
            elif seq.num_computed_tokens + n == seq.num_tokens:
                out[i] = self.token
        return out


def make_core(runner, num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 64,
              budget: int = 512, speculation: Speculation | None = None,
              caching: bool = True) -> EngineCore:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return EngineCore(runner, kv, Scheduler(kv, max_num_seqs, budget), FakeTokenizer(),
                      frozenset({EOS}), max_model_len=10_000, speculation=speculation)


def add(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> Request:
    seq = Sequence(rid, prompt, params, RequestMetrics(0.0))
    request = Request(seq, IncrementalDetokenizer(core.tokenizer), make_generator(params))
    core.add(request)
    return request


def run(core: EngineCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step until done; request id -> output tokens."""
    outs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_work:
            break
        for u in core.step():
            if u.output is not None:
                outs[u.output.request_id] = u.output.token_ids
    assert not core.has_work
    return outs


def chi_square_p(observed: Counter, expected: dict, n: int) -> float:
    """Pearson's chi-square test of `observed` counts against `expected` probabilities
    (cells expected below 5 merged into one); the p-value."""
    cells, small_o, small_e = [], 0, 0.0
    for key, p in expected.items():
        if p * n < 5:
            small_o, small_e = small_o + observed.get(key, 0), small_e + p * n
        else:
            cells.append((observed.get(key, 0), p * n))
    if small_e > 0:
        cells.append((small_o, small_e))
    assert sum(observed.values()) == n and set(observed) <= set(expected)
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


# ---- the proposer ------------------------------------------------------------------------
def test_proposer_takes_the_latest_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 6, 3, 4]
    # [3, 4] (n=2) ends at 3 and 8; [6, 3, 4] (n=3) never came before: the latest n=2 wins
    assert NgramProposer(3, 1, 3).propose(tokens) == [7, 8, 6]
    assert NgramProposer(3, 1, 3).propose(tokens, limit=1) == [7]
    assert NgramProposer(3, 3, 3).propose(tokens) == []  # no earlier 3-gram match
    assert NgramProposer(3, 2, 2).propose([5, 6, 7, 8]) == []
    assert NgramProposer(3, 1, 1).propose([5]) == []


def test_the_incremental_index_proposes_as_a_fresh_one():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()
    grown = NgramProposer(4, 1, 3)
    for end in range(1, len(tokens) + 1, 3):  # tokens arrive a few at a time
        assert grown.propose(tokens[:end]) == NgramProposer(4, 1, 3).propose(tokens[:end])


def test_drafts_stop_at_max_tokens():
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=5), RequestMetrics(0.0))
    seq.output_token_ids = [4, 5]
    assert draft_limit(seq, 10_000) == 2  # 3 tokens left: 2 drafts and the sampled one
    assert draft_limit(seq, 7) == 1  # the context allows 2 more tokens


def test_config_names_the_wrong_field():
    with pytest.raises(ValueError, match="speculative must be None or one of"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1 and <= 16"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_max must be >= 3"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    assert Speculation.from_config(EngineConfig()) is None  # off by default
    assert Speculation.from_config(EngineConfig(speculative="ngram")) == Speculation(4, 2, 4)


def test_stats_words_acceptance_as_vllm():
    s = SpecDecodeStats()
    assert s.acceptance_rate is None and s.mean_accepted_length is None
    s.observe(4, 3)
    s.observe(4, 0)
    assert s.acceptance_rate == 3 / 8
    assert s.mean_accepted_length == 1 + 3 / 2


# ---- the acceptance rule -----------------------------------------------------------------
def test_greedy_accepts_the_matching_prefix_then_the_argmax():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6], [5, 6, 8]) == [5, 6, 8]  # all accepted: a bonus token
    assert accept_greedy([5], [4, 1]) == [4]


def resample_with_the_draft(probs, drafts, p_drafts, generator):
    """A deliberately wrong rule: on a rejection, draw from p without removing the draft."""
    for j in range(len(drafts)):
        if float(torch.rand((), generator=generator)) >= p_drafts[j]:
            return [*drafts[:j], draw(probs[j], generator)]
    return [*drafts, draw(probs[len(drafts)], generator)]


def accept_by_sqrt(probs, drafts, p_drafts, generator):
    """A deliberately wrong rule: accept with probability sqrt(p(x)), a subtler bias."""
    return accept_sampled(probs, drafts, [math.sqrt(p) for p in p_drafts], generator)


@pytest.mark.parametrize(("rule", "exact"), [(accept_sampled, True),
                                             (resample_with_the_draft, False),
                                             (accept_by_sqrt, False)])
def test_the_acceptance_rule_keeps_the_target_distribution(rule, exact):
    """The first token out of a verification of one draft is distributed as p0, whatever
    the draft: chi-square over 6 tokens with 6,000 draws. The wrong rules fail the same
    test by a wide margin, so it cannot pass by luck."""
    probs = torch.softmax(torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.0, -1.0],
                                        [0.3, 0.1, 0.0, 0.0, 0.5, 0.2]]), dim=-1)
    g = torch.Generator().manual_seed(1234)
    n, counts = 6000, Counter()
    for i in range(n):
        draft = i % 3  # drafts of high, middle and low probability
        counts[rule(probs, [draft], [float(probs[0, draft])], g)[0]] += 1
    p = chi_square_p(counts, dict(enumerate(probs[0].tolist())), n)
    assert (p > 1e-3) if exact else (p < 1e-9), p


# ---- through the engine core -------------------------------------------------------------
PROMPT = [0, 1, 3, 0, 1, 2, 0, 1]
SAMPLED = SamplingParams(max_tokens=4, temperature=0.8, top_k=3, ignore_eos=True)


def sampled_outputs(speculation: Speculation | None, n: int,
                    seed0: int = 0) -> tuple[dict[str, list[int]], SpecDecodeStats]:
    """Outputs of `n` seeded requests (seeds from `seed0`) and the drafting counters."""
    core = make_core(FakeBigramRunner(FakeBigramModel()), num_blocks=4096,
                     max_num_seqs=512, budget=8192, speculation=speculation)
    for i in range(n):
        add(core, f"r{i}", PROMPT, dataclasses.replace(SAMPLED, seed=seed0 + i))
    outs = run(core)
    assert core.kv.stats().used_blocks == 0
    return outs, core.spec_decode


def expected_joint(model: FakeBigramModel, params: SamplingParams, prev: int,
                   length: int) -> dict[tuple[int, ...], float]:
    """Exact probability of every output of `length` tokens after `prev`."""
    rows = [torch.softmax(filter_logits(model.table[t], params), -1).tolist()
            for t in range(model.vocab)]
    out = {(): 1.0}
    for _ in range(length):
        out = {seq + (t,): p * rows[seq[-1] if seq else prev][t]
               for seq, p in out.items() for t in range(model.vocab)}
    return {k: v for k, v in out.items() if v > 0}


@pytest.mark.parametrize("rule", [accept_sampled, resample_with_the_draft])
def test_sampled_outputs_match_the_target_distribution(rule, monkeypatch):
    """3,000 seeded requests of 4 tokens over a 4-token vocabulary at temperature 0.8,
    top-k 3, with n-gram drafts (~5,500 verifications, ~900 drafts accepted): the joint
    distribution of the 4 tokens is the bigram chain's (chi-square over 81 outputs). The
    same test with a wrong rule (a rejection resampling p with the draft kept) fails with
    p ~ 1e-97."""
    monkeypatch.setattr(speculative, "accept_sampled", rule)
    n = 3000
    outs, spec_decode = sampled_outputs(Speculation(3, 1, 2), n)
    assert spec_decode.num_draft_tokens > spec_decode.num_drafts > 4000  # drafts of several tokens
    assert spec_decode.num_draft_tokens - spec_decode.num_accepted_tokens > spec_decode.num_accepted_tokens > 400
    expected = expected_joint(FakeBigramModel(), SAMPLED, PROMPT[-1], SAMPLED.max_tokens)
    p = chi_square_p(Counter(tuple(o) for o in outs.values()), expected, n)
    assert (p > 1e-3) if rule is accept_sampled else (p < 1e-9), p


def test_seeded_requests_are_reproducible_and_batch_independent():
    (a, spec_decode), (b, _) = (sampled_outputs(Speculation(3, 1, 2), 40) for _ in range(2))
    assert a == b and spec_decode.num_accepted_tokens > 0
    alone, _ = sampled_outputs(Speculation(3, 1, 2), 1, seed0=7)  # request 7, by itself
    assert alone["r0"] == a["r7"]


def test_greedy_output_is_identical_with_and_without_speculation():
    def greedy(speculation):
        core = make_core(FakeBigramRunner(FakeBigramModel(vocab=6, seed=5)), speculation=speculation,
                         budget=24)
        prompts = [PROMPT, [1, 2, 1, 2, 1], [5, 5, 5, 4], [3] * 20, [0, 3, 1, 4, 1, 5]]
        for i, p in enumerate(prompts):
            add(core, f"r{i}", p, SamplingParams(max_tokens=12 + i))
        return run(core), core

    plain, _ = greedy(None)
    spec_out, core = greedy(Speculation(4, 1, 3))
    assert spec_out == plain
    assert core.spec_decode.num_accepted_tokens > 0
    assert core.spec_decode.num_draft_tokens > core.spec_decode.num_accepted_tokens  # some rolled back
    assert any(s.num_accepted_tokens for s in core.steps)
    assert core.kv.stats().used_blocks == 0


# ---- scheduling drafts ---------------------------------------------------------------------
def decoding_core(budget: int, num_blocks: int, block_size: int = 4) -> EngineCore:
    """Requests a and b, prefilled: each has sampled token 12 after [11, 12, ... 18, 11],
    so its suffix [11, 12] proposes the 4 drafts [13, 14, 15, 16]."""
    core = make_core(FakeScriptedRunner(block_size, token=12), num_blocks, block_size,
                     budget=100, speculation=Speculation(4, 1, 2))
    for rid in ("a", "b"):
        add(core, rid, [11, 12, 13, 14, 15, 16, 17, 18, 11], SamplingParams(max_tokens=20))
    core.step()
    core.scheduler.max_num_batched_tokens = budget
    assert all(core.requests[r].seq.spec_token_ids == [13, 14, 15, 16] for r in ("a", "b"))
    return core


def test_drafts_are_trimmed_to_the_token_budget():
    core = decoding_core(budget=7, num_blocks=64)
    batch = core.schedule()
    assert [(s.request_id, n) for s, n in batch.entries] == [("a", 5), ("b", 2)]
    assert core.requests["b"].seq.spec_token_ids == [13]


def test_drafts_are_dropped_rather_than_preempt_anyone():
    core = decoding_core(budget=100, num_blocks=7)  # 3 blocks each, 1 free: a's drafts
    batch = core.schedule()
    assert batch.num_preempted == 0
    assert [n for _, n in batch.entries] == [5, 1]  # a's drafts fit; b's did not
    assert core.requests["b"].seq.spec_token_ids == []
    check_invariants(core.kv)


def test_rollback_frees_the_blocks_of_rejected_drafts():
    core = decoding_core(budget=100, num_blocks=64, block_size=2)
    a, b = (core.requests[r].seq for r in ("a", "b"))
    assert a.num_computed_tokens == 9 and len(core.kv.block_tables["a"]) == 5
    core.runner.script = [(1, 8), (0, 9)]  # a accepts none, b one (popped from the end)
    core.step()  # each verified 4 drafts at positions 10..13: 7 blocks, then rolled back
    assert a.output_token_ids == [12, 9] and a.num_computed_tokens == 10
    assert len(core.kv.block_tables["a"]) == 5  # the blocks of 10 verified tokens
    assert b.output_token_ids == [12, 13, 8] and b.num_computed_tokens == 11
    assert len(core.kv.block_tables["b"]) == 6
    check_invariants(core.kv)
    assert (core.spec_decode.num_drafts, core.spec_decode.num_draft_tokens,
            core.spec_decode.num_accepted_tokens) == (2, 8, 1)
    step = core.steps[-1]
    assert (step.num_decode_tokens, step.num_draft_tokens, step.num_accepted_tokens,
            step.num_prefill_tokens) == (2, 8, 1, 0)


# ---- random propose / accept / reject / rollback / cancel sequences -----------------------
class SpecKVMachine(RuleBasedStateMachine):
    """Drives the real core, scheduler and KV cache with drafts proposed by the n-gram
    proposer or injected at random, verified with random acceptances (a scripted runner),
    and cancels; after every rule no block leaks and every ref count is right."""

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(8, 24),
                budget=st.integers(2, 16), caching=st.booleans())
    def setup(self, block_size, num_blocks, budget, caching):
        self.runner = FakeScriptedRunner(block_size)
        self.core = make_core(self.runner, num_blocks, block_size, max_num_seqs=3,
                              budget=budget, speculation=Speculation(3, 1, 2), caching=caching)
        self.capacity = num_blocks * block_size
        self.n = 0

    @rule(prefix=st.sampled_from([[], [1, 3, 1, 3, 5, 6], [4] * 8]),
          tail=st.lists(st.integers(3, 6), min_size=1, max_size=9),
          max_tokens=st.integers(1, 8))
    def submit(self, prefix, tail, max_tokens):
        prompt = prefix + tail
        if len(prompt) + max_tokens <= self.capacity:  # the engine refuses larger ones
            add(self.core, f"r{self.n}", prompt, SamplingParams(max_tokens=max_tokens))
            self.n += 1

    @rule(which=st.integers(0, 2), drafts=st.lists(st.integers(3, 9), min_size=1, max_size=3))
    def propose(self, which, drafts):
        running = [s for s in self.core.scheduler.running if s.num_remaining == 1]
        if running:
            seq = running[which % len(running)]
            seq.spec_token_ids = drafts[: max(draft_limit(seq, 10_000), 0)]

    @rule(script=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([3, 4, 7, EOS])),
                          max_size=4))
    def step(self, script):
        self.runner.script = list(script)
        self.core.step()

    @rule(which=st.integers(0, 5))
    def cancel(self, which):
        if self.core.requests:
            self.core.abort(list(self.core.requests)[which % len(self.core.requests)])

    @invariant()
    def blocks_hold_only_verified_tokens(self):
        kv = self.core.kv
        check_invariants(kv)
        bs = kv.block_size
        for seq in self.core.scheduler.running:
            table = kv.block_tables.get(seq.request_id, [])
            # rolled back: exactly the blocks of the verified tokens (drafts only in-step)
            assert len(table) == kv.blocks_needed(seq.num_computed_tokens)
            for i, bid in enumerate(table):
                blk = kv.blocks[bid]
                if blk.token_ids is not None and i < kv._num_hashed.get(seq.request_id, 0):
                    assert (i + 1) * bs <= seq.num_computed_tokens
                    assert blk.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])

    def teardown(self):
        if not hasattr(self, "core"):
            return
        run(self.core, max_steps=5000)
        s = self.core.kv.stats()
        assert s.used_blocks == 0 and not self.core.kv.block_tables
        assert s.free_blocks + s.cached_blocks == s.num_blocks


SpecKVMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                           deadline=None)
test_speculative_kv_state_machine = SpecKVMachine.TestCase
