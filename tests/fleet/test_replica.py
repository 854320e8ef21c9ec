"""One replica against hand-worked step counts, and its decode stretches against the
same run stepped one step at a time."""

from __future__ import annotations

import pytest
from fleet_fakes import fake_cost, fake_layout

from fleet import replica as replica_mod
from fleet.replica import Replica, SimRequest
from fleet.sim import FleetConfig, simulate, synthetic_tokens
from fleet.trace import LengthMix, Trace, TraceRequest, steady


def one(req: TraceRequest, rid: int = 0) -> SimRequest:
    return SimRequest(rid, req, f"r{rid}", synthetic_tokens(req, rid))


def test_one_request_takes_one_prefill_step_then_one_step_per_token() -> None:
    lay = fake_layout()
    r = Replica(0, lay)
    s = one(TraceRequest(0.0, 100, 5))
    r.add(s, 0.0)
    r.run_until(1e9)
    cost = fake_cost()
    prefill = cost.step_seconds(1, 100, 0, 100)
    decode = cost.step_seconds(1, 0, 1, 0)  # the fake has no context term
    assert s.first_token == pytest.approx(prefill)
    assert s.finish == pytest.approx(prefill + 4 * decode)
    assert s.tpot == pytest.approx(decode)
    assert r.stats.steps == 5 and r.stats.output_tokens == 5
    assert r.kv.stats().used_blocks == 0, "a finished request's blocks are freed"


@pytest.mark.parametrize("wake_ms, prefill_steps", [(0.0, 2), (0.5, 1)])
def test_arrivals_within_the_wake_up_share_an_idle_replicas_first_step(
        wake_ms: float, prefill_steps: int) -> None:
    r = Replica(0, fake_layout(wake_s=wake_ms / 1e3))
    reqs = [one(TraceRequest(t, 50, 1), i) for i, t in enumerate((0.0, 1e-4, 3e-4))]
    for s in reqs:
        r.add(s, s.req.arrival)
    r.run_until(1e9)
    # one token each: the first prompt's step and one for the two arriving during it, or
    # one step for all three
    assert r.stats.steps == prefill_steps
    last = max(s.req.arrival for s in reqs)
    if wake_ms:  # the step starts a wake-up after the last arrival, with every prompt
        both = fake_cost().step_seconds(3, 150, 0, 150)
        assert [s.first_token for s in reqs] == pytest.approx([last + wake_ms / 1e3 + both] * 3)
    else:  # the first prompt's step starts as it arrives; the others wait for it
        assert reqs[0].first_token == pytest.approx(fake_cost().step_seconds(1, 50, 0, 50))
        assert reqs[1].first_token > reqs[0].first_token


def test_a_wake_up_below_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="wake_s"):
        fake_layout(wake_s=-1e-3)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    r = Replica(0, fake_layout(max_num_batched_tokens=128))
    s = one(TraceRequest(0.0, 300, 2))
    r.add(s, 0.0)
    r.run_until(1e9)
    assert r.stats.steps == 3 + 1  # 128 + 128 + 44 prompt tokens, then one decode step


def test_a_shared_prefix_is_a_cache_hit_for_the_next_request() -> None:
    r = Replica(0, fake_layout())
    a = one(TraceRequest(0.0, 400, 4, prefix_id=3, prefix_tokens=320), 0)
    b = one(TraceRequest(5.0, 400, 4, prefix_id=3, prefix_tokens=320), 1)
    r.add(a, 0.0)
    r.add(b, 5.0)
    r.run_until(1e9)
    assert a.cached_tokens == 0
    assert b.cached_tokens == 320  # 20 full blocks of the shared 320 tokens
    assert r.kv.prefix_hits == 320


def test_a_small_pool_preempts_and_every_request_still_finishes() -> None:
    lay = fake_layout(num_blocks=40, max_num_seqs=8)  # 640 token slots
    trace = Trace(tuple(TraceRequest(0.0, 60, 100) for _ in range(8)), 1.0)
    res = simulate(trace, FleetConfig(lay))
    assert all(s.finish is not None for s in res.requests)
    assert sum(s.preemptions for s in res.requests) > 0
    assert res.replicas[0].kv.stats().used_blocks == 0


def test_a_request_larger_than_the_pool_is_dropped_not_lost() -> None:
    lay = fake_layout(num_blocks=4)
    trace = Trace((TraceRequest(0.0, 10, 10), TraceRequest(0.0, 100, 10)), 1.0)
    res = simulate(trace, FleetConfig(lay))
    assert [s.dropped for s in res.requests] == [None, "larger than the KV pool"]
    assert res.requests[0].finish is not None


@pytest.mark.parametrize("num_blocks", [4096, 300])
def test_decode_stretches_give_the_same_run_as_single_steps(num_blocks: int,
                                                           monkeypatch) -> None:
    """The same trace with stretches and with one exact step at a time (the engine's
    scheduling, step by step): every request's first token and finish agree."""
    lay = fake_layout(num_blocks=num_blocks)
    trace = steady(600.0, 30.0, LengthMix(prompt=(20, 200), output=(5, 120)), seed=3)
    fast = simulate(trace, FleetConfig(lay))
    monkeypatch.setattr(replica_mod.Replica, "_can_stretch", lambda self: False)
    slow = simulate(trace, FleetConfig(lay))
    assert sum(r.stats.stretches for r in fast.replicas) > 0
    assert sum(r.stats.stretches for r in slow.replicas) == 0
    assert fast.replicas[0].stats.steps == slow.replicas[0].stats.steps
    for a, b in zip(fast.requests, slow.requests, strict=True):
        assert a.first_token == pytest.approx(b.first_token, abs=1e-9)
        assert a.finish == pytest.approx(b.finish, abs=1e-9)
        assert a.preemptions == b.preemptions
