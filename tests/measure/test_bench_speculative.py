"""`batchlens bench speculative` and the speculation workload's pure parts, without a model:
the flags, the table, the gain, the engine settings of a run."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from measure.bench import speculative
from workloads import scenarios
from workloads.speculative import SpecRun, edit_prompts, engine_config, speedup


def run(users: int, on: bool, per_user: float, answers=((1, 2, 3),)) -> SpecRun:
    return SpecRun(users=users, speculative=on, output_tokens=3 * users, wall_s=1.0,
                   total_tokens_per_s=per_user * users, tokens_per_s_per_user=per_user,
                   acceptance_rate=0.75 if on else None,
                   mean_accepted_length=2.5 if on else None, num_drafts=4 if on else 0,
                   num_draft_tokens=16 if on else 0, num_accepted_tokens=12 if on else 0,
                   answers=answers)


def test_users_flag_is_checked():
    assert speculative.parse_users("1,32,64") == [1, 32, 64]
    with pytest.raises(ValueError, match="--users: expected numbers"):
        speculative.parse_users("1,many")
    with pytest.raises(ValueError, match="--users: every count must be >= 1"):
        speculative.parse_users("0,4")


def test_gain_is_per_user_tokens_per_s_on_over_off():
    runs = [run(1, False, 30.0), run(1, True, 60.0), run(32, False, 10.0)]
    assert speedup(runs, 1) == 2.0
    assert speedup(runs, 32) is None  # not run with speculation yet


def test_table_shows_each_run_the_gain_and_whether_answers_match():
    runs = [run(1, False, 30.0), run(1, True, 60.0),
            run(32, False, 10.0), run(32, True, 8.0, answers=((9,),))]
    text = speculative.table(runs)
    lines = text.splitlines()
    assert lines[0].split() == ["users", "speculation", "tok/s/user", "total", "tok/s",
                                "accepted", "mean", "len", "tokens", "same"]
    assert lines[2].split() == ["1", "on", "60.0", "60.0", "75%", "2.50", "3", "yes"]
    assert lines[4].split()[-1] == "no"
    assert "1 user: speculation gives 2.00x the tokens/s per user" in text
    assert "32 users: speculation gives 0.80x the tokens/s per user" in text


def test_each_run_gets_a_pool_for_all_its_users():
    cfg = engine_config(64, True, prompt_tokens=64 * 120, base=EngineConfig(block_size=16))
    sc = scenarios.get("edit_paragraph")
    assert cfg.speculative == "ngram" and cfg.max_num_seqs == 64
    assert cfg.num_kv_blocks * 16 >= 64 * (120 + sc.max_tokens)
    assert engine_config(1, False, 100).speculative is None
    assert edit_prompts(10) == list(sc.prompts[:10])
    more = edit_prompts(40)  # past the scenario's 32 users, its prompts again
    assert len(more) == 40 and more[32:] == list(sc.prompts[:8])
