"""Traces: the daily curve, the preset, and the three CSV layouts."""

from __future__ import annotations

import pytest

from fleet.trace import (
    PRESET_1000,
    DayCurve,
    LengthMix,
    connected_users,
    poisson_day,
    read_csv,
    steady,
    to_csv,
)


def test_a_seeded_trace_is_the_same_every_time_and_follows_its_curve() -> None:
    a = poisson_day(2000.0, duration_s=6 * 3600, seed=3)
    assert a.requests == poisson_day(2000.0, duration_s=6 * 3600, seed=3).requests
    assert a.requests != poisson_day(2000.0, duration_s=6 * 3600, seed=4).requests
    night = [r for r in a.requests if 3 * 3600 <= r.arrival < 5 * 3600]  # the 4 o'clock trough
    dawn = [r for r in a.requests if 0 <= r.arrival < 2 * 3600]
    assert len(night) < len(dawn)


def test_a_burst_multiplies_the_rate_while_it_lasts() -> None:
    curve = DayCurve(trough=1.0, bursts=((600.0, 600.0, 3.0),))
    t = poisson_day(1000.0, curve=curve, duration_s=1800, seed=1)
    counts = [sum(1 for r in t.requests if k * 600 <= r.arrival < (k + 1) * 600)
              for k in range(3)]
    assert counts[1] > 2.3 * counts[0] and counts[1] > 2.3 * counts[2]


def test_the_preset_asks_for_active_users_times_their_reading_speed() -> None:
    assert PRESET_1000.demand_tokens_per_s == 200 * 20.0
    t = connected_users(PRESET_1000, duration_s=3600, curve=DayCurve(trough=1.0), seed=2)
    assert t.output_tokens / 3600 == pytest.approx(4000.0, rel=0.08)
    assert "1,000 connected, 200 active" in t.name


def test_steady_demand_matches_its_rate_and_shares_prefixes() -> None:
    mix = LengthMix(shared_prefix_tokens=256, num_prefixes=3)
    t = steady(1000.0, 1200.0, mix, seed=5)
    assert t.output_tokens / 1200 == pytest.approx(1000.0, rel=0.1)
    assert {r.prefix_id for r in t.requests} == {0, 1, 2}
    assert all(r.prefix_tokens == 256 and r.prompt_tokens > 256 for r in t.requests)


def test_a_trace_csv_reads_back_what_was_written() -> None:
    t = steady(300.0, 60.0, LengthMix(shared_prefix_tokens=64, num_prefixes=2), seed=1)
    back = read_csv(to_csv(t))
    assert [(round(r.arrival, 6), r.prompt_tokens, r.output_tokens, r.prefix_id)
            for r in back.requests] == [(round(r.arrival, 6), r.prompt_tokens,
                                         r.output_tokens, r.prefix_id) for r in t.requests]


def test_the_arenas_export_is_a_burst_of_its_datacenter_users() -> None:
    text = ("side,user,you,ttft_s,tpot_s,e2e_s,queue_s,tokens,tokens_per_s,finish_reason\n"
            "datacenter,0,True,0.1,0.02,1.0,0.0,48,48.0,length\n"
            "datacenter,1,False,0.1,0.02,1.0,0.0,30,30.0,stop\n"
            "local,0,True,0.1,0.02,1.0,0.0,48,48.0,length\n")
    t = read_csv(text, prompt_tokens=120)
    assert [(r.arrival, r.prompt_tokens, r.output_tokens) for r in t.requests] == [
        (0.0, 120, 48), (0.0, 120, 30)]


def test_the_sweeps_export_plays_its_points_one_after_another() -> None:
    text = ("side,users,requests,completed,output_tokens,wall_s,throughput_tokens_per_s\n"
            "datacenter,2,2,2,32,1.5,21.3\nlocal,2,2,2,32,3.0,10.6\n"
            "datacenter,4,4,4,64,2.0,32.0\n")
    t = read_csv(text, prompt_tokens=50, rate_gap_s=1.0)
    assert [r.arrival for r in t.requests] == [0.0, 0.0, 2.5, 2.5, 2.5, 2.5]
    assert {r.output_tokens for r in t.requests} == {16}
    rate = ("side,rate_rps,requests,completed,output_tokens,wall_s\n"
            "datacenter,2.0,4,4,64,2.5\n")
    assert [r.arrival for r in read_csv(rate).requests] == [0.0, 0.5, 1.0, 1.5]


def test_a_csv_of_other_columns_or_bad_numbers_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="none of a trace"):
        read_csv("a,b\n1,2\n")
    with pytest.raises(ValueError, match="line 3: prompt_tokens must be a number"):
        read_csv("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,ten,5\n")
    with pytest.raises(ValueError, match="no rows"):
        read_csv("arrival_s,prompt_tokens,output_tokens\n")
    with pytest.raises(ValueError, match="output_tokens: must be >= 1"):
        read_csv("arrival_s,prompt_tokens,output_tokens\n0,10,0\n")
