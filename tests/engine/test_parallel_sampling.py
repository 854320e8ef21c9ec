"""Parallel sampling (`SamplingParams.n`) without a model: the real core, scheduler and
KV manager with a stand-in runner that holds real, tiny KV tensors.

`SlotRunner` writes each computed token's id into its K slot and its position into its V
slot, and before a request computes anything checks that every earlier position's slot
holds that position's token: a copy on write that is missing, late or wrong fails there.
It also fails a write into a block that another sequence holds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kv_checks import check_invariants
from test_scheduler import EOS, FakeTokenizer, entries

from engine.config import SamplingParams, candidate_params
from engine.core import EngineCore, Request, copy_blocks, make_request
from engine.kv_cache import KVCacheManager
from engine.models.attention import packed_caches
from engine.scheduler import Scheduler
from engine.sequence import Status

VOCAB = (3, 40)  # sampled tokens: never EOS


class SlotRunner:
    """Stand-in model runner over real KV tensors (see the module's notes). Samples 7 for a
    greedy request, else a token drawn from the request's own generator."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv, bs = kv, kv.block_size
        shape = (1, kv.num_blocks + 1, bs, 1)
        self.kv_caches = [(torch.full(shape, -1.0), torch.full(shape, -1.0))]
        self.num_writes = 0

    def execute(self, entries, block_tables, generators):
        k, v = self.kv_caches[0]
        bs, out = self.kv.block_size, {}
        for i, (seq, n) in enumerate(entries):
            table = block_tables[seq.request_id]
            start = seq.num_computed_tokens
            assert len(table) * bs >= start + n, "scheduled without enough blocks"
            for p in range(start):
                b, o = table[p // bs], p % bs
                assert (k[0, b, o, 0], v[0, b, o, 0]) == (seq.token_at(p), p), "stale K/V"
            for p in range(start, start + n):
                b, o = table[p // bs], p % bs
                assert self.kv.blocks[b].ref_count == 1, "a write into a shared block"
                k[0, b, o, 0], v[0, b, o, 0] = seq.token_at(p), p
                self.num_writes += 1
            if start + n == seq.num_tokens:
                out[i] = self.sample(seq, generators)
        forks = [s for i in sorted(out) for s in entries[i][0].siblings]
        for k, sib in enumerate(forks):  # the fork: the same last row, each one's generator
            out[len(entries) + k] = self.sample(sib, generators)
        return out

    @staticmethod
    def sample(seq, generators):
        g = generators.get(seq.request_id)
        return 7 if g is None else int(torch.randint(*VOCAB, (1,), generator=g))


def make_core(num_blocks: int, block_size: int, max_num_seqs: int = 8, budget: int = 100,
              caching: bool = True) -> EngineCore:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return EngineCore(SlotRunner(kv), kv, Scheduler(kv, max_num_seqs, budget),
                      FakeTokenizer(), frozenset({EOS}), max_model_len=10_000)


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 4,
        **params) -> Request:
    request = make_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                           0.0, core.tokenizer)
    core.add(request)
    return request


def run(core: EngineCore, max_steps: int = 10_000) -> dict[str, object]:
    """Step until done; request id -> its final output."""
    outs = {}
    for _ in range(max_steps):
        if not core.has_work:
            break
        for u in core.step():
            if u.request_output is not None:
                outs[u.request_output.request_id] = u.request_output
        check_invariants(core.kv)
    assert not core.has_work
    return outs


def expected_tokens(seed: int, count: int) -> list[int]:
    """What `SlotRunner` samples for a request seeded `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(*VOCAB, (1,), generator=g)) for _ in range(count)]


def test_the_prompt_is_prefilled_once_then_forked_with_its_tail_copied_on_write():
    core = make_core(num_blocks=12, block_size=4)
    add(core, "r", list(range(10, 20)), max_tokens=3, n=3)  # 10 tokens: 2 full blocks
    b = core.schedule()
    assert entries(b) == [("r#0", 10)] and b.copies == []  # the whole prompt, once
    updates = core.update(b, core.execute(b))
    assert sorted(u.index for u in updates) == [0, 1, 2]  # every candidate's first token
    tables = core.kv.block_tables
    assert tables["r#0"] == tables["r#1"] == tables["r#2"]  # the fork: all 3 blocks shared
    assert [core.kv.blocks[x].ref_count for x in tables["r#0"]] == [3, 3, 3]
    assert core.kv.stats().used_blocks == 3
    b = core.schedule()  # each candidate's first write goes into a tail of its own
    assert entries(b) == [("r#0", 1), ("r#1", 1), ("r#2", 1)]
    shared = tables["r#0"][:2]
    assert tables["r#1"][:2] == tables["r#2"][:2] == shared
    assert [core.kv.blocks[x].ref_count for x in shared] == [3, 3]
    assert len(b.copies) == 2 and len({tables[f"r#{i}"][2] for i in range(3)}) == 3
    assert core.kv.stats().used_blocks == 5  # 2 shared + 3 tails
    core.update(b, core.execute(b))
    out = run(core)["r"]
    assert [c.token_ids for c in out.candidates] == [[7, 7, 7]] * 3
    assert [c.request_id for c in out.candidates] == ["r#0", "r#1", "r#2"]
    assert out.request_id == "r" and out.token_ids == [7, 7, 7]
    assert core.runner.num_writes == 10 + 3 * 2  # the prompt once, then each one's tokens
    assert core.kv.stats().used_blocks == 0 and core.requests == {}
    assert core.num_finished == 1 and core.num_output_tokens == 9


def test_candidates_count_against_max_num_seqs():
    core = make_core(num_blocks=40, block_size=4, max_num_seqs=4)
    add(core, "a", [1, 3, 4, 5, 6], n=3)
    add(core, "b", [1, 3, 4, 8, 8], n=2)
    add(core, "c", [9, 9])
    b = core.schedule()
    assert entries(b) == [("a#0", 5)]  # b's 2 candidates do not fit beside a's 3 (FCFS)
    core.update(b, core.execute(b))
    assert entries(core.schedule()) == [("a#0", 1), ("a#1", 1), ("a#2", 1)]
    assert len(core.scheduler.running) == 3 and len(core.scheduler.waiting) == 2


def test_candidates_sample_with_their_own_seeds_and_stop_on_their_own():
    core = make_core(num_blocks=40, block_size=4)
    stops = [expected_tokens(100 + i, 6)[2] for i in range(3)]
    add(core, "r", [1, 3, 4, 5, 6], max_tokens=6, n=3, seed=100, temperature=1.0,
        stop_token_ids=[stops[1]])
    updates = []
    while core.has_work:
        updates += core.step()
    ends = [u for u in updates if u.output is not None]
    assert sorted(u.index for u in ends) == [0, 1, 2]
    assert [u.request_output is not None for u in ends] == [False, False, True]
    out = ends[-1].request_output
    for i, cand in enumerate(out.candidates):
        want = expected_tokens(100 + i, 6)
        if stops[1] in want:
            want = want[: want.index(stops[1]) + 1]
        assert cand.token_ids == want  # candidate i is the single request seeded 100 + i
    assert candidate_params(SamplingParams(seed=100, n=3), 2).seed == 102


def test_cancel_ends_every_candidate_and_frees_every_block():
    core = make_core(num_blocks=20, block_size=4)
    add(core, "early", list(range(10, 30)), n=3, max_tokens=8)
    core.step()  # the prefill only: the others wait to fork
    update = core.abort("early")
    assert [c.finish_reason for c in update.request_output.candidates] == ["cancelled"] * 3
    assert core.kv.stats().used_blocks == 0 and not core.has_work
    add(core, "late", list(range(10, 30)), n=3, max_tokens=8)
    for _ in range(3):
        core.step()
    assert core.kv.stats().used_blocks > 0
    update = core.abort("late")
    assert len(update.request_output.candidates) == 3 and core.requests == {}
    assert core.kv.stats().used_blocks == 0 and not core.kv.shared_tails
    assert core.candidates == {} and core.generators == {}
    check_invariants(core.kv)


def test_a_preempted_candidate_recomputes_from_the_shared_prompt():
    core = make_core(num_blocks=7, block_size=4)
    add(core, "r", list(range(10, 19)), max_tokens=8, n=3)  # 9 tokens: 2 full blocks
    core.step()
    core.step()  # forked: 2 shared blocks + 3 tails
    for _ in range(4):  # the candidates need new blocks: the newest is preempted
        core.step()
    assert core.scheduler.num_preemptions >= 1
    out = run(core)["r"]
    assert [c.token_ids for c in out.candidates] == [[7] * 8] * 3
    preempted = [c for c in out.candidates if c.num_preemptions]
    assert preempted and all(c.num_cached_tokens >= 8 for c in preempted)  # a hit
    assert core.kv.stats().used_blocks == 0


def test_a_prompt_cached_to_its_last_token_computes_that_token_once_for_all():
    core = make_core(num_blocks=20, block_size=4)
    prompt = list(range(10, 19))  # 9 tokens: the first 8 are two full blocks
    add(core, "warm", prompt, max_tokens=1)
    run(core)
    add(core, "r", prompt, max_tokens=3, n=3)
    b = core.schedule()
    assert entries(b) == [("r#0", 1)] and b.copies == []
    core.update(b, core.execute(b))
    b = core.schedule()
    assert entries(b) == [("r#0", 1), ("r#1", 1), ("r#2", 1)]
    core.update(b, core.execute(b))
    out = run(core)["r"]
    assert [c.num_cached_tokens for c in out.candidates] == [8] * 3
    assert [c.token_ids for c in out.candidates] == [[7, 7, 7]] * 3


@pytest.mark.parametrize("length", [1, 2, 5, 8, 9])
def test_any_prompt_length_forks_and_frees_everything(length):
    core = make_core(num_blocks=20, block_size=4, budget=3, caching=False)
    add(core, "r", list(range(10, 10 + length)), max_tokens=5, n=4)
    out = run(core)["r"]
    assert [c.token_ids for c in out.candidates] == [[7] * 5] * 4
    assert core.kv.stats().used_blocks == 0


@pytest.mark.parametrize("pooled", [False, True])  # True: packed views of one pool
def test_copy_blocks_copies_every_layers_k_and_v_and_nothing_else(pooled):
    caches = [(torch.randn(3, 6, 4, 8), torch.randn(3, 6, 4, 8)) for _ in range(2)]
    if pooled:  # as the runner holds packed caches: K and V views of one tensor per layer
        caches = [packed_caches(torch.randn(2 * 3 * 6 * 16 * 8), 3, 6, 16, 8) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [(1, 4), (2, 0)])
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        for t, t0 in ((k, k0), (v, v0)):
            assert torch.equal(t[:, 4], t0[:, 1]) and torch.equal(t[:, 0], t0[:, 2])
            assert torch.equal(t[:, [1, 2, 3, 5]], t0[:, [1, 2, 3, 5]])


# ---- random submit / fork / write / cancel / preempt / finish sequences ---------------------
class ParallelKVMachine(RuleBasedStateMachine):
    """Drives the real core with n-candidate requests, random steps (forks and writes happen
    in them), cancels and forced preemptions of single candidates. After every rule the
    reference counts are exact (every block's count is the number of tables holding it);
    the runner checks every write lands in a block of its own and every K/V read is right;
    at the end no block is leaked and every candidate has its own seed's tokens."""

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(8, 24),
                budget=st.integers(1, 16), caching=st.booleans())
    def setup(self, block_size, num_blocks, budget, caching):
        self.core = make_core(num_blocks, block_size, max_num_seqs=6, budget=budget,
                              caching=caching)
        self.capacity = num_blocks * block_size
        self.n = 0
        self.seeds: dict[str, int] = {}
        self.outputs: dict[str, object] = {}

    @rule(prefix=st.sampled_from([[], [1, 3, 1, 3, 5, 6], [4] * 8]),
          tail=st.lists(st.integers(3, 6), min_size=0, max_size=9),
          max_tokens=st.integers(1, 8), n=st.integers(1, 4), sampled=st.booleans())
    def submit(self, prefix, tail, max_tokens, n, sampled):
        prompt = (prefix + tail) or [5]
        if len(prompt) + max_tokens > self.capacity:  # the engine refuses larger ones
            return
        rid = f"r{self.n}"
        self.n += 1
        params = {"temperature": 1.0, "seed": self.n} if sampled else {}
        add(self.core, rid, prompt, max_tokens, n=n, **params)
        if sampled:
            self.seeds[rid] = self.n

    @rule(steps=st.integers(1, 3))
    def step(self, steps):
        for _ in range(steps):
            self.collect(self.core.step())

    @rule(which=st.integers(0, 5))
    def cancel(self, which):
        if self.core.requests:
            rid = list(self.core.requests)[which % len(self.core.requests)]
            self.collect([self.core.abort(rid)])

    @rule(which=st.integers(0, 5))
    def preempt(self, which):
        running = self.core.scheduler.running
        if running:
            self.core.scheduler._preempt(running[which % len(running)])

    def collect(self, updates):
        for u in updates:
            if u.request_output is not None:
                assert u.request_output.request_id not in self.outputs
                self.outputs[u.request_output.request_id] = u.request_output

    @invariant()
    def reference_counts_are_exact(self):
        kv = self.core.kv
        check_invariants(kv)
        for rid, index in kv.shared_tails.items():
            assert kv.blocks[kv.block_tables[rid][index]].ref_count >= 1
        for seq in self.core.scheduler.running:
            assert seq.status is Status.RUNNING and not (seq.siblings and seq.output_token_ids)

    def teardown(self):
        if not hasattr(self, "core"):
            return
        self.collect([u for _ in range(10_000) if self.core.has_work for u in self.core.step()])
        core, kv = self.core, self.core.kv
        assert not core.has_work and core.requests == {} and core.candidates == {}
        s = kv.stats()
        assert s.used_blocks == 0 and not kv.block_tables and not kv.shared_tails
        assert s.free_blocks + s.cached_blocks == kv.num_blocks
        for rid, out in self.outputs.items():
            for i, cand in enumerate(out.answers):
                if rid in self.seeds:
                    want = expected_tokens(self.seeds[rid] + i, len(cand.token_ids))
                    assert cand.token_ids == want
                else:
                    assert set(cand.token_ids) <= {7}


TestParallelKV = ParallelKVMachine.TestCase
TestParallelKV.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_fork_rows_follow_the_entries_order_whatever_the_rows_order():
    from engine.runner import fork_rows

    a = make_request("a", [1, 2, 3], SamplingParams(n=3), 0.0, FakeTokenizer())
    b = make_request("b", [4, 5], SamplingParams(n=2), 0.0, FakeTokenizer())
    plain = make_request("c", [6], SamplingParams(), 0.0, FakeTokenizer())
    entries_ = [(a.seq, 3), (plain.seq, 1), (b.seq, 2)]
    # the rows put entry 2 first, as a backend may order its rows
    rows = fork_rows(entries_, sampled=[2, 0, 1])
    assert [(r, s.request_id) for r, s in rows] == [(1, "a#1"), (1, "a#2"), (0, "b#1")]
