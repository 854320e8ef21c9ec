"""Scripted scenarios (workloads/scenarios.py): well-formed, fit the engine, and replayable:
the same scenario run twice gives the same text."""

from __future__ import annotations

import threading

import pytest

from engine import Engine, EngineConfig
from engine.local import LocalPC
from workloads import scenarios
from workloads.race import Race


def test_registry():
    for key, sc in scenarios.SCENARIOS.items():
        assert scenarios.get(key) is sc and sc.key == key
    with pytest.raises(ValueError, match="scenario: unknown 'nope'"):
        scenarios.get("nope")
    laptop = scenarios.get("laptop_70b")
    assert laptop.emulation == ("laptop_cpu", "llama-2-70b", "int4")
    many = scenarios.get("many_users")
    assert many.num_users == 32 and len({p[-1]["content"] for p in many.prompts}) > 8


def test_engine_config_applies_scenario_fields_then_changes():
    sc = scenarios.get("small_pool")
    cfg = sc.engine_config(EngineConfig(max_num_seqs=7), block_size=8)
    assert cfg.num_kv_blocks == 64 and cfg.max_num_seqs == 7 and cfg.block_size == 8


def test_shared_prefix_system_prompt_is_about_300_tokens(loaded):
    sc = scenarios.get("shared_prefix")
    ids = [loaded.encode(list(p)) for p in sc.prompts + (sc.warmup,)]
    shared = next(i for i, col in enumerate(zip(*ids, strict=False)) if len(set(col)) > 1)
    assert 290 <= shared <= 340  # tokens every user's prompt (and the warm-up) starts with
    assert all(len(x) - shared < 30 for x in ids)  # short questions after it


@pytest.mark.model
def test_many_users_twice_gives_identical_text(loaded):
    sc = scenarios.get("many_users")
    with Engine(EngineConfig(num_kv_blocks=256), loaded=loaded) as eng:
        first = scenarios.run_scenario(eng, sc, prefix="a")
        second = scenarios.run_scenario(eng, sc, prefix="b")
        kv = eng.stats().kv
    assert len(first.outputs) == 32 and all(first.texts)
    assert first.texts == second.texts
    assert kv.free_blocks + kv.cached_blocks == kv.num_blocks  # nothing leaked


@pytest.mark.model
def test_one_user_race_twice_gives_identical_text_on_both_sides(loaded):
    sc = scenarios.get("one_user")
    texts = []
    with Engine(EngineConfig(num_kv_blocks=64), loaded=loaded) as eng:
        for _ in range(2):
            race = Race(eng, LocalPC(loaded, n_ctx=512), [list(p) for p in sc.prompts],
                        sc.params(0), heartbeat_timeout=None, close_local=True).start()
            assert race.join(timeout=120)
            texts.append([race.outputs(side)[0].text for side in ("datacenter", "local")])
    assert texts[0] == texts[1]
    assert texts[0][0] == texts[0][1]  # greedy: both sides agree too


@pytest.mark.model
def test_stop_cancels_a_staggered_scenario(loaded):
    sc = scenarios.get("shared_prefix")
    stop = threading.Event()
    with Engine(sc.engine_config(), loaded=loaded) as eng:
        res = scenarios.run_scenario(eng, sc, stop=stop,
                                     on_submit=lambda i, h: i == 1 and stop.set())
        kv = eng.stats().kv
    assert res.stopped and len(res.outputs) == 2
    assert kv.free_blocks + kv.cached_blocks == kv.num_blocks


@pytest.mark.model
def test_four_answers_twice_give_the_same_four_texts_from_one_prompt_computed_once(loaded):
    sc = scenarios.get("parallel_answers")
    assert (sc.n, sc.num_users) == (4, 1) and sc.temperature > 0
    runs = []
    for _ in range(2):
        with Engine(sc.engine_config(), loaded=loaded) as eng:
            res = scenarios.run_scenario(eng, sc)
            steps = eng.stats().recent_steps
        runs.append([c.text for c in res.outputs[0].candidates])
    assert runs[0] == runs[1] and len(runs[0]) == 4  # fixed seeds: the same text every run
    assert len(set(runs[0])) > 1  # four answers, not one four times
    prompt = len(res.outputs[0].prompt_token_ids)
    assert prompt > 300 and sum(s.num_prefill_tokens for s in steps) == prompt
