"""Continuous batching without a model: the real `EngineCore` step with small pools.

`FakeRunner` stands in for the model runner and `FakeTokenizer` for the tokenizer (unit
tests only): the runner samples token 7 for every request whose last token was computed,
and the tokenizer spells token i as "<i>".
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_checks import check_invariants

from engine.config import SamplingParams
from engine.core import EngineCore, Request
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheManager
from engine.metrics import RequestMetrics
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status

EOS = 2


class FakeTokenizer:
    """Stand-in tokenizer: token i decodes to "<i>"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakeRunner:
    """Stand-in model runner: checks every scheduled request holds blocks for what it
    computes, and samples `token` where a request's last token was computed."""

    def __init__(self, token: int = 7, fail: bool = False) -> None:
        self.token, self.fail = token, fail
        self.block_size = 1  # set by make_core

    def execute(self, entries, block_tables, generators):
        if self.fail:
            raise RuntimeError("fake device lost")
        out = {}
        for i, (seq, n) in enumerate(entries):
            held = len(block_tables[seq.request_id]) * self.block_size
            assert held >= seq.num_computed_tokens + n, "scheduled without enough blocks"
            if seq.num_computed_tokens + n == seq.num_tokens:
                out[i] = self.token
        return out


def make_core(num_blocks: int, block_size: int, max_num_seqs: int = 4, budget: int = 100,
              caching: bool = True, runner: FakeRunner | None = None) -> EngineCore:
    kv = KVCacheManager(num_blocks, block_size, caching)
    runner = runner or FakeRunner()
    runner.block_size = block_size
    return EngineCore(runner, kv, Scheduler(kv, max_num_seqs, budget),
                      FakeTokenizer(), frozenset({EOS}), max_model_len=10_000)


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 4,
        **params) -> Request:
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   RequestMetrics(0.0))
    request = Request(seq, IncrementalDetokenizer(core.tokenizer))
    core.add(request)
    return request


def entries(batch) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in batch.entries]


def test_token_budget_chunks_a_long_prompt_while_others_decode():
    core = make_core(num_blocks=20, block_size=4, budget=8)
    add(core, "short", [1, 3, 4])
    b = core.schedule()
    assert entries(b) == [("short", 3)]
    core.update(b, core.execute(b))
    add(core, "long", list(range(100, 120)))
    b = core.schedule()
    assert entries(b) == [("short", 1), ("long", 7)]
    assert b.num_tokens == 8
    core.update(b, core.execute(b))
    b = core.schedule()
    assert entries(b) == [("short", 1), ("long", 7)]


def test_max_num_seqs_limits_the_running_batch():
    core = make_core(num_blocks=20, block_size=4, max_num_seqs=2)
    for i in range(3):
        add(core, f"r{i}", [1, 3])
    b = core.schedule()
    assert [s.request_id for s, _ in b.entries] == ["r0", "r1"]
    assert [s.request_id for s in core.scheduler.waiting] == ["r2"]


def test_min_admit_slots_admits_waiting_requests_in_waves():
    core = make_core(num_blocks=40, block_size=4, max_num_seqs=3)
    core.scheduler.min_admit_slots = 2
    for i, max_tokens in enumerate([1, 3, 5, 2, 2]):
        add(core, f"r{i}", [1, 3], max_tokens)
    running = []
    for _ in range(5):
        b = core.schedule()
        running.append([s.request_id for s, _ in b.entries])
        core.update(b, core.execute(b))
    # r0 ends after step 1 (one slot free: r3 waits), r1 after step 3: r3 and r4 together
    assert running == [["r0", "r1", "r2"], ["r1", "r2"], ["r1", "r2"], ["r2", "r3", "r4"],
                       ["r2", "r3", "r4"]]


def test_a_last_waiting_request_is_admitted_without_a_full_wave():
    core = make_core(num_blocks=40, block_size=4, max_num_seqs=3)
    core.scheduler.min_admit_slots = 2
    for i, max_tokens in enumerate([1, 4, 4, 2]):
        add(core, f"r{i}", [1, 3], max_tokens)
    core.step()  # r0 ends; only r3 waits, and one free slot fits all that wait
    assert [s.request_id for s, _ in core.schedule().entries] == ["r1", "r2", "r3"]


def test_preempts_the_newest_when_blocks_run_out():
    core = make_core(num_blocks=5, block_size=2)
    a = add(core, "a", [1, 3, 4, 5], 10).seq
    b_ = add(core, "b", [5, 6, 7, 8], 10).seq
    core.step()  # a: 2 blocks + b: 2 blocks, both now hold 5 tokens
    batch = core.schedule()  # a needs a 3rd block: 1 free; b needs one too -> b preempted
    assert batch.num_preempted == 1
    assert entries(batch) == [("a", 1)]
    assert b_.status is Status.WAITING and b_.num_computed_tokens == 0
    assert core.scheduler.waiting[0] is b_
    assert "b" not in core.kv.block_tables and a.status is Status.RUNNING
    check_invariants(core.kv)


def test_a_request_asking_for_prompt_logprobs_takes_no_prefix_hit_but_caches():
    core = make_core(num_blocks=20, block_size=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    add(core, "a", prompt, 1)
    core.step()  # "a" ends; its full blocks stay cached
    b_ = add(core, "b", prompt, 1, prompt_logprobs=1).seq
    queries = core.kv.prefix_queries
    batch = core.schedule()
    assert entries(batch) == [("b", 13)] and b_.num_cached_tokens == 0
    assert core.kv.prefix_queries == queries  # a skipped lookup is not a query
    core.update(batch, core.execute(batch))
    c = add(core, "c", prompt, 1).seq
    core.schedule()
    assert c.num_cached_tokens == 12  # others still hit the blocks
    check_invariants(core.kv)


def test_requests_with_sampling_extras_are_preempted_and_aborted_without_leaks():
    core = make_core(num_blocks=5, block_size=2)
    extras = dict(prompt_logprobs=2, logprobs=2, presence_penalty=1.0, logit_bias={3: 5.0})
    add(core, "a", [1, 3, 4, 5], 10, **extras)
    b_ = add(core, "b", [5, 6, 7, 8], 10, **extras).seq
    core.step()
    assert core.schedule().num_preempted == 1 and b_.status is Status.WAITING
    check_invariants(core.kv)
    assert core.abort("a").output.finish_reason == "cancelled"
    assert core.abort("b").output.prompt_logprobs == [None]  # the stand-in records none
    assert core.kv.stats().used_blocks == 0
    check_invariants(core.kv)


def test_step_streams_text_and_finishing_is_one_removal():
    core = make_core(num_blocks=8, block_size=4)
    add(core, "a", [1, 3, 4], max_tokens=2)
    [first] = core.step()
    assert (first.delta, first.num_tokens, first.output) == ("<7>", 1, None)
    assert list(core.requests) == ["a"]
    [last] = core.step()
    assert last.output is not None and last.output.finish_reason == "length"
    assert last.output.token_ids == [7, 7] and last.output.text == "<7><7>"
    assert core.requests == {} and core.kv.stats().used_blocks == 0
    assert core.num_finished == 1 and core.num_output_tokens == 2 and core.num_steps == 2
    assert [s.num_prefill_tokens for s in core.steps] == [3, 0]
    assert [s.num_decode_tokens for s in core.steps] == [0, 1]


def test_eos_stops_a_request():
    core = make_core(num_blocks=8, block_size=4, runner=FakeRunner(token=EOS))
    add(core, "a", [1, 3], max_tokens=10)
    [update] = core.step()
    assert update.output is not None and update.output.finish_reason == "stop"


def test_abort_frees_blocks_and_ends_as_cancelled():
    core = make_core(num_blocks=8, block_size=4, max_num_seqs=1)
    add(core, "a", [1, 3, 4, 5, 6], max_tokens=10)
    add(core, "queued", [9, 9], max_tokens=10)
    core.step()
    update = core.abort("a")
    assert update is not None and update.output.finish_reason == "cancelled"
    assert core.abort("a") is None  # already gone
    assert core.abort("queued").output.token_ids == []
    assert core.requests == {} and not core.has_work
    assert core.kv.stats().used_blocks == 0
    check_invariants(core.kv)


def test_a_failed_execute_fails_only_its_step_and_keeps_serving():
    runner = FakeRunner(fail=True)
    core = make_core(num_blocks=8, block_size=4, runner=runner)
    add(core, "a", [1, 3, 4])
    updates = core.step()
    assert [u.output.finish_reason for u in updates] == ["error"]
    assert "fake device lost" in updates[0].output.error
    assert core.kv.stats().used_blocks == 0 and core.requests == {}
    runner.fail = False
    add(core, "b", [1, 3, 4], max_tokens=1)
    [done] = core.step()
    assert done.output.finish_reason == "length"


def test_duplicate_request_ids_are_refused():
    core = make_core(num_blocks=8, block_size=4)
    add(core, "a", [1, 3])
    with pytest.raises(AssertionError):
        add(core, "a", [1, 3])


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
    core = make_core(num_blocks, block_size, max_num_seqs=3, budget=budget, caching=caching)
    prefixes = [[], [1, 3, 4, 5, 6, 8], [1, 3, 4, 9, 9], [40] * 8]
    capacity = num_blocks * block_size
    finished: list[str] = []
    for i, (op, p, tail, max_tokens) in enumerate(ops):
        if op == "submit":
            prompt = prefixes[p] + [100 + i + j for j in range(tail)]
            if len(prompt) + max_tokens <= capacity:  # the engine rejects larger ones
                add(core, f"r{i}", prompt, max_tokens)
        elif op == "cancel" and core.requests:
            rid = list(core.requests)[p % len(core.requests)]
            finished.append(core.abort(rid).output.request_id)
        else:
            finished += [u.output.request_id for u in core.step() if u.output]
        check_invariants(core.kv)
        assert len(core.scheduler.running) <= 3
    # drain: everything finishes and every block comes back
    for _ in range(2000):
        if not core.has_work:
            break
        finished += [u.output.request_id for u in core.step() if u.output]
        check_invariants(core.kv)
    assert not core.has_work and core.requests == {}
    assert len(finished) == len(set(finished)) == core.num_finished
    s = core.kv.stats()
    assert s.used_blocks == 0 and not core.kv.block_tables
    assert s.free_blocks + s.cached_blocks == num_blocks


def test_long_context_prefill_chunks_shrink_so_a_step_stays_short():
    from engine.scheduler import MIN_PREFILL_CHUNK, prefill_chunk_cap

    kv = KVCacheManager(400, 16, False)
    runner = FakeRunner()
    runner.block_size = 16
    core = EngineCore(runner, kv, Scheduler(kv, 4, 512, max_prefill_attention=64 * 1024),
                      FakeTokenizer(), frozenset({EOS}), max_model_len=10_000)
    add(core, "long", list(range(10, 5010)), max_tokens=1)
    chunks = []
    while core.has_work:
        b = core.schedule()
        chunks += [n for _, n in b.entries]
        core.update(b, core.execute(b))
    assert sum(chunks) == 5000  # the whole prompt; its one output token comes with the last chunk
    done = 0
    for n in chunks:
        # every chunk within the cap for the context it attends to, and never below the floor
        assert n <= max(prefill_chunk_cap(done, 64 * 1024), MIN_PREFILL_CHUNK)
        done += n
    assert chunks[0] == 512 and chunks[1] == 128 and chunks[-2] >= MIN_PREFILL_CHUNK
    assert min(chunks[:-1]) < 512 // 4  # long contexts really get shorter chunks
    assert prefill_chunk_cap(0, None) is None
