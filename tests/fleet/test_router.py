"""Routing on a trace where users share long system prompts."""

from __future__ import annotations

import pytest
from fleet_fakes import fake_layout

from engine.metrics import percentile
from fleet.report import summary
from fleet.router import Router, prefix_key
from fleet.sim import FleetConfig, simulate
from fleet.trace import LengthMix, steady

# eight products, each with a 1,024-token system prompt, then a short question
SHARED = LengthMix(prompt=(20, 120), output=(20, 120), shared_prefix_tokens=1024,
                   num_prefixes=8)


def run(policy: str):
    # the pool holds ~3 system prompts' blocks beside the running requests: spreading all
    # eight prompts over every replica evicts them, keeping each on one replica does not
    lay = fake_layout(num_blocks=400, max_num_seqs=16)
    trace = steady(1600.0, 120.0, SHARED, seed=5)
    return simulate(trace, FleetConfig(lay, replicas=4, router=policy))


def test_prefix_aware_routing_hits_the_cache_more_and_answers_sooner() -> None:
    rr, pa = run("round_robin"), run("prefix_aware")
    s_rr, s_pa = summary(rr), summary(pa)
    assert s_pa["prefix_hit_rate"] > s_rr["prefix_hit_rate"] + 0.1
    ttft = [percentile([r.ttft for r in res.finished], 50) for res in (rr, pa)]
    assert ttft[1] < ttft[0]
    assert s_pa["finished"] == s_rr["finished"] == len(rr.requests)


def test_least_outstanding_balances_better_than_round_robin_on_mixed_lengths() -> None:
    lay = fake_layout()
    trace = steady(2000.0, 120.0, LengthMix(prompt=(20, 400), output=(5, 400)), seed=6)
    p99 = {}
    for policy in ("round_robin", "least_outstanding"):
        res = simulate(trace, FleetConfig(lay, replicas=3, router=policy))
        p99[policy] = percentile([r.e2e for r in res.finished], 99)
    assert p99["least_outstanding"] <= p99["round_robin"]


def test_the_prefix_key_is_the_chained_hash_of_the_first_blocks() -> None:
    a = [7] * 64 + [1] * 10
    b = [7] * 64 + [2] * 10
    assert prefix_key(a, 16) == prefix_key(b, 16)  # the first 4 blocks agree
    assert prefix_key([7] * 48 + [3] * 16, 16) != prefix_key(a, 16)
    assert prefix_key([1] * 10, 16) is None


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="router: one of"):
        Router("random")
