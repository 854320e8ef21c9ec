"""Continuous batching without a model: hand-made outputs, small pools, block ids checked.

`FakeStep` stands in for the model runner (unit tests only): it marks scheduled tokens
computed and appends a made-up sampled token, exactly as the engine's update does.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_checks import check_invariants

from engine.config import SamplingParams
from engine.kv_cache import KVCacheManager
from engine.metrics import RequestMetrics
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status


def make_seq(rid: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), RequestMetrics(0.0))


def fake_step(sch: Scheduler, batch, token: int = 7) -> list[Sequence]:
    """Apply a step's results as the engine would; return requests that finished."""
    done = []
    for seq, n in batch.entries:
        seq.num_computed_tokens += n
        sch.kv.record_computed(seq.request_id, seq.token_ids, seq.num_computed_tokens)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(token)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sch.finish(seq)
                done.append(seq)
    return done


def test_token_budget_chunks_a_long_prompt_while_others_decode():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    sch = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    sch.add(make_seq("short", [1, 2, 3]))
    b = sch.schedule()
    assert [(s.request_id, n) for s, n in b.entries] == [("short", 3)]
    fake_step(sch, b)
    sch.add(make_seq("long", list(range(100, 120))))
    b = sch.schedule()
    assert [(s.request_id, n) for s, n in b.entries] == [("short", 1), ("long", 7)]
    assert b.num_tokens == 8
    fake_step(sch, b)
    b = sch.schedule()
    assert [(s.request_id, n) for s, n in b.entries] == [("short", 1), ("long", 7)]


def test_max_num_seqs_limits_the_running_batch():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    sch = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sch.add(make_seq(f"r{i}", [1, 2]))
    b = sch.schedule()
    assert [s.request_id for s, _ in b.entries] == ["r0", "r1"]
    assert [s.request_id for s in sch.waiting] == ["r2"]


def test_preempts_the_newest_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    sch = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b_ = make_seq("a", [1, 2, 3, 4], 10), make_seq("b", [5, 6, 7, 8], 10)
    sch.add(a)
    sch.add(b_)
    batch = sch.schedule()
    fake_step(sch, batch)  # a: 2 blocks + b: 2 blocks, both now hold 5 tokens
    batch = sch.schedule()  # a needs a 3rd block: 1 free; b needs one too -> b preempted
    assert batch.num_preempted == 1
    assert [s.request_id for s, _ in batch.entries] == ["a"]
    assert b_.status is Status.WAITING and b_.num_computed_tokens == 0
    assert sch.waiting[0] is b_
    assert "b" not in kv.block_tables
    check_invariants(kv)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["submit", "submit", "step", "step", "step", "cancel"]),
            st.integers(0, 3),  # which shared prefix
            st.integers(1, 14),  # prompt tail length
            st.integers(1, 6),  # max tokens
        ),
        min_size=1, max_size=60,
    ),
    block_size=st.integers(1, 4),
    num_blocks=st.integers(6, 16),
    budget=st.integers(1, 12),
    caching=st.booleans(),
)
def test_random_workloads_keep_invariants_and_leak_nothing(
    ops, block_size, num_blocks, budget, caching
):
    kv = KVCacheManager(num_blocks, block_size, caching)
    sch = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=budget)
    prefixes = [[], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [40] * 8]
    live: list[Sequence] = []
    capacity = num_blocks * block_size
    for i, (op, p, tail, max_tokens) in enumerate(ops):
        if op == "submit":
            prompt = prefixes[p] + [100 + i + j for j in range(tail)]
            if len(prompt) + max_tokens <= capacity:  # the engine rejects larger ones
                seq = make_seq(f"r{i}", prompt, max_tokens)
                sch.add(seq)
                live.append(seq)
        elif op == "cancel" and live:
            seq = live.pop(p % len(live))
            sch.finish(seq)
        else:
            for seq in fake_step(sch, sch.schedule()):
                live.remove(seq)
        check_invariants(kv)
        assert len(sch.running) <= 3
    # drain: everything finishes and every block comes back
    for _ in range(2000):
        if not sch.has_work:
            break
        fake_step(sch, sch.schedule())
        check_invariants(kv)
    assert not sch.has_work
    s = kv.stats()
    assert s.used_blocks == 0 and not kv.block_tables
    assert s.free_blocks + s.cached_blocks == num_blocks
