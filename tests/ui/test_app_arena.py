"""AppTest of the arena page: controls, a full race, bad input, stop, a closed tab."""

from __future__ import annotations

import dataclasses

import pytest
from apptest import keyed, metrics, new_app, run_until, wait_idle

from ui import arena, shared
from workloads.prompts import load_prompts

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_engine")]


def race_of(at):
    return at.session_state[arena.SLOT.key]


def test_page_shows_controls_presets_and_an_idle_status_strip():
    at = new_app()
    assert not at.exception
    assert "one user at a time" in at.title[0].value
    names = at.selectbox(key="arena_preset").options
    assert any("Korean" in n for n in names) and any("Long" in n for n in names)
    assert at.number_input(key="arena_users").value == 8
    assert not at.button(key="arena_run").disabled and at.button(key="arena_stop").disabled
    assert "running: 0" in at.caption[0].value
    assert at.info and at.info[0].value == arena.IDLE
    assert len(at.get("vega_lite_chart")) == 4  # the live layout is there, empty, before Run


def test_presenter_mode_asks_for_a_scenario_where_it_has_no_run_button():
    at = new_app()
    at.session_state["presenter"] = True
    at.run()
    assert not at.exception
    assert not [b for b in at.button if b.key == "arena_run"]  # the scenario bar starts races
    assert at.info and at.info[0].value == arena.IDLE_PRESENTER
    assert at.button(key="scenario-one_user")  # ... which that sentence points to


def test_a_preset_fills_the_prompt():
    at = new_app()
    korean = next(n for n in load_prompts().presets if "Korean" in n)
    at.selectbox(key="arena_preset").select(korean).run()
    assert at.text_area(key="arena_prompt").value == load_prompts().presets[korean]


def test_empty_prompt_disables_run_with_a_hint():
    at = new_app()
    at.text_area(key="arena_prompt").input("   ").run()
    assert at.button(key="arena_run").disabled
    assert any("Type a prompt" in c.value for c in at.caption)


def test_a_race_streams_both_sides_and_ends_with_a_summary_and_csv():
    at = new_app()
    at.number_input(key="arena_users").set_value(3)
    at.number_input(key="arena_max_tokens").set_value(6)
    at.button(key="arena_run").click().run()
    # inputs are disabled while the race runs
    assert at.text_area(key="arena_prompt").disabled and at.button(key="arena_run").disabled
    assert not at.button(key="arena_stop").disabled
    run_until(at, lambda a: bool(a.success) or bool(a.error))
    assert not at.error, at.error[0].value
    race = race_of(at)
    assert f"{race.snapshot().ratio:.1f}x the local PC" in at.success[0].value
    for side in ("local", "datacenter"):
        shown = metrics(at, side)
        assert shown["Users finished"] == "3/3"
        assert float(shown["Total tokens/s"]) > 0
    # your answer, as plain text, on both sides
    answers = [c.value for c in at.code]
    assert answers == [race.outputs("local")[0].text, race.outputs("datacenter")[0].text]
    assert len(at.get("vega_lite_chart")) == 4
    assert len(at.get("download_button")) == 1
    table = at.dataframe[0].value
    assert len(table) == 6 and {"ttft_s", "tpot_s", "e2e_s", "tokens_per_s"} <= set(table)
    # inputs are enabled again
    assert not at.text_area(key="arena_prompt").disabled
    assert not at.button(key="arena_run").disabled


def test_an_over_long_prompt_shows_the_limit():
    at = new_app()
    at.text_area(key="arena_prompt").input("word " * 2100).run()
    at.button(key="arena_run").click().run()
    assert at.error and "prompt:" in at.error[0].value and "2048 tokens" in at.error[0].value
    assert arena.SLOT.key not in at.session_state


def test_stop_cancels_the_race_and_frees_its_blocks():
    at = new_app()
    at.number_input(key="arena_users").set_value(4)
    at.number_input(key="arena_max_tokens").set_value(400)
    at.button(key="arena_run").click().run()
    race = race_of(at)
    run_until(at, lambda a: race.snapshot().sides["datacenter"].total_tokens > 8)
    at.button(key="arena_stop").click().run()
    run_until(at, lambda a: bool(a.warning))
    assert "Stopped" in at.warning[0].value
    engine = shared.shared_engine().engine
    wait_idle(engine)
    assert engine.stats().kv.used_blocks == 0


def test_a_closed_tab_cancels_its_requests(monkeypatch):
    monkeypatch.setattr(arena, "SLOT", dataclasses.replace(arena.SLOT, heartbeat_s=1.0))
    at = new_app()
    at.number_input(key="arena_users").set_value(4)
    at.number_input(key="arena_max_tokens").set_value(400)
    at.button(key="arena_run").click().run()
    race = race_of(at)
    # the tab is closed: no more reruns, so no more heartbeats
    assert race.join(timeout=60)
    assert race.snapshot().phase == "abandoned"
    engine = shared.shared_engine().engine
    wait_idle(engine)
    assert engine.stats().kv.used_blocks == 0


def test_speculation_switches_run_each_side_speculatively():
    from workloads.scenarios import EDIT_ASK, EDIT_PARAGRAPHS

    at = new_app()  # a prompt whose answer copies it: drafts are proposed on both sides
    at.text_area(key="arena_prompt").input(EDIT_ASK + EDIT_PARAGRAPHS[1]).run()
    at.number_input(key="arena_users").set_value(1)
    at.number_input(key="arena_max_tokens").set_value(16)
    at.toggle(key="arena_spec_local").set_value(True)
    at.toggle(key="arena_spec_dc").set_value(True).run()
    at.button(key="arena_run").click().run()
    race = race_of(at)
    shared_engine = shared.shared_engine().engine
    # the datacenter side runs on a speculating engine of its own; the shared one is as it was
    assert race.engine is not shared_engine and race.engine.speculation is not None
    assert shared_engine.speculation is None and race.local.speculation is not None
    run_until(at, lambda a: bool(a.success) or bool(a.error))
    assert not at.error, at.error[0].value
    views = race.snapshot().sides
    for side in ("local", "datacenter"):
        stats = race.engine.stats() if side == "datacenter" else race.local.stats()
        assert stats.spec_decode.num_drafts > 0, side  # drafts were verified on both sides
        line = arena.speculation_line(views[side])
        assert line in [c.value for c in at.caption]
    assert race.engine.stopped_reason == "shut down"  # its own engine ended with the race


def test_presenter_edit_scenario_compares_speculation_off_and_on(monkeypatch):
    from ui import speculative_view
    from workloads import scenarios

    short = dataclasses.replace(scenarios.get("edit_paragraph"), max_tokens=8)
    monkeypatch.setitem(scenarios.SCENARIOS, "edit_paragraph", short)
    monkeypatch.setattr(scenarios, "EDIT_PARAGRAPHS", scenarios.EDIT_PARAGRAPHS[:1])
    monkeypatch.setattr(speculative_view, "PRESENTER_USERS", (1, 2))
    at = new_app()
    at.session_state["presenter"] = True
    at.run()
    at.button(key="scenario-edit_paragraph").click().run()
    job = at.session_state[speculative_view.SLOT.key]
    run_until(at, lambda a: job.finished and not a.button(key="scenario-one_user").disabled)
    assert job.error is None and [(r.users, r.speculative) for r in job.runs] == [
        (1, False), (1, True), (2, False), (2, True)]
    shown = {m.label: m.value for m in at.metric}
    assert shown["1 user, without: tokens/s per user"] == f"{job.runs[0].tokens_per_s_per_user:.1f}"
    assert "2 users: drafted tokens accepted" in shown
    table = at.dataframe[0].value
    assert list(table["speculation"]) == ["off", "on", "off", "on"]
    assert shared.shared_engine().engine.speculation is None  # nobody's settings changed


def test_answers_per_user_shows_your_candidates_and_the_local_pc_holding_n_windows():
    at = new_app()
    assert at.number_input(key="arena_n").value == 1
    at.number_input(key="arena_users").set_value(2)
    at.number_input(key="arena_max_tokens").set_value(5)
    at.number_input(key="arena_n").set_value(3)
    at.slider(key="arena_temperature").set_value(0.8)
    at.button(key="arena_run").click().run()
    run_until(at, lambda a: bool(a.success) or bool(a.error))
    assert not at.error, at.error[0].value
    race = race_of(at)
    for side in ("local", "datacenter"):
        panel = keyed(at, f"side-{side}")
        assert [t.label for t in panel.tabs] == ["Answer 1", "Answer 2", "Answer 3"]
        shown = [c.value for c in panel.code]
        assert shown == [c.text for c in race.outputs(side)[0].candidates]
        assert metrics(at, side)["Users finished"] == "2/2"
    assert any("held 3 times" in c.value for c in keyed(at, "side-local").caption)
    assert any("computed once" in c.value for c in keyed(at, "side-datacenter").caption)
    # every candidate's tokens count, on each side
    rows = {r["side"]: r["tokens"] for r in race.snapshot().rows if r["user"] == 0}
    for side in ("local", "datacenter"):
        cands = race.outputs(side)[0].candidates
        assert rows[side] == sum(len(c.token_ids) for c in cands) > len(cands[0].token_ids)
    kv = race.snapshot().kv
    local = race.local.stats(steps_after=None)
    reserved = {s: max(p["bytes"] for p in kv if p["side"] == s and p["kind"] == "reserved")
                for s in ("local", "datacenter")}
    assert reserved["local"] == 3 * local.n_ctx * local.kv_bytes_per_token
    assert reserved["datacenter"] < reserved["local"]


def test_answers_per_user_out_of_range_disables_run():
    at = new_app()
    at.number_input(key="arena_n").set_value(9).run()
    assert at.button(key="arena_run").disabled
    assert any("Answers per user: 9 is out of range" in e.value for e in at.error)
