"""AppTest of the KV cache page: the block maps against the engine's own counts, a whole
scenario on its own engine, and Stop."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from apptest import keyed, new_app, run_until, wait_idle
from streamlit import dataframe_util
from streamlit.testing.v1 import AppTest

from engine import SamplingParams
from engine.kv_cache import waste_for_block_size
from engine.local import DEFAULT_N_CTX
from ui import kv_view, shared

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_engine")]
PAGE = "pages/kv_cache.py"
LONG = ("The lighthouse keeper climbed the stairs every evening, lit the lamp and wrote "
        "down the ships that passed, their flags and the weather over the island. ")


@pytest.fixture
def apps():
    """Apps opened by a test; their scenario jobs are closed (engines shut down) after."""
    opened: list[AppTest] = []
    yield opened
    for at in opened:
        if kv_view.SLOT.key in at.session_state:
            assert at.session_state[kv_view.SLOT.key].close(timeout=60)


def kv_page(apps: list[AppTest]) -> AppTest:
    at = new_app()
    at.switch_page(PAGE).run()
    assert not at.exception, at.exception
    apps.append(at)
    return at


def charts(at: AppTest) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) of every chart on the page, in page order."""
    out = []
    for el in at.get("vega_lite_chart"):
        vega = json.loads(el.proto.spec)
        rows = dataframe_util.convert_arrow_bytes_to_pandas_df(el.proto.data.data)
        out.append((vega["title"]["text"], rows))
    return out


def chart(at: AppTest, title_start: str) -> pd.DataFrame:
    return next(rows for title, rows in charts(at) if title.startswith(title_start))


def shown(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def counts(df: pd.DataFrame, *cols: str) -> tuple[int, ...]:
    return tuple(int(df[c].sum()) for c in cols)


def test_the_page_shows_four_scenarios_and_the_shared_engine():
    at = kv_page([])
    assert at.header[0].value.startswith("KV cache")
    for key in kv_view.KV_SCENARIOS:
        assert not at.button(key=f"kv_run_{key}").disabled
    assert set(kv_view.KV_SCENARIOS) == {"shared_prefix", "small_pool", "many_short",
                                         "parallel_answers"}
    assert at.button(key="kv_stop").disabled
    assert "shared datacenter engine" in keyed(at, "kv-shown").markdown[0].value
    assert [t.split(":")[0] for t, _ in charts(at)] == ["Paged", "Contiguous", "Scheduler steps"]
    assert any("Press Run" in i.value for i in at.info)


def test_block_map_counts_equal_the_engines_kv_stats(apps):
    at = kv_page(apps)
    engine = shared.shared_engine().engine
    engine.generate([LONG], SamplingParams(max_tokens=4))  # leaves cached (hashed) blocks
    busy = engine.submit("Count slowly from one to a thousand, one number a line.",
                         SamplingParams(max_tokens=400, ignore_eos=True))  # no shared prefix
    assert busy.wait_first_token(60)
    at.run()
    # live: the map and the figures come from one snapshot, so they agree exactly
    paged = chart(at, "Paged")
    used, cached, free = counts(paged, "used", "cached", "free")
    total = engine.kv.num_blocks
    assert used > 0 and cached > 0 and used + cached + free == total
    assert shown(at)["Blocks used"] == f"{used:,} / {total:,}"
    assert shown(at)["Cached blocks"] == f"{cached:,}"
    caption = keyed(at, "kv-paged-caption").caption[0].value
    assert f"{used:,} used · {cached:,} cached · {free:,} free" in caption
    # the contiguous layout: the one live request reserves n_ctx tokens, uses its blocks
    contiguous = chart(at, "Contiguous")
    per = math.ceil(DEFAULT_N_CTX / engine.kv.block_size)
    c_used, c_reserved, c_free = counts(contiguous, "used", "reserved", "free")
    assert c_used == used and c_used + c_reserved == per and c_free == total - per
    # idle: the map equals engine.stats() taken afterwards
    busy.cancel()
    wait_idle(engine)
    at.run()
    kv = engine.stats().kv
    paged = chart(at, "Paged")
    assert counts(paged, "used", "cached", "free") == (0, kv.cached_blocks, kv.free_blocks)
    assert kv.cached_blocks > 0 and kv.used_blocks == 0
    steps = chart(at, "Scheduler steps")
    assert set(steps["step"]) <= set(range(engine.stats().num_steps)) and len(steps) > 0


def test_a_scenario_runs_to_the_end_on_its_own_engine_and_leaks_no_blocks(apps):
    at = kv_page(apps)
    shared_engine = shared.shared_engine().engine
    at.button(key="kv_run_many_short").click().run()
    assert not at.exception, at.exception
    job = at.session_state[kv_view.SLOT.key]
    assert job.engine is not shared_engine and job.engine.loaded is shared_engine.loaded
    run_until(at, lambda a: job.finished and bool(a.success))
    res = job.result
    assert job.error is None and not res.stopped
    assert len(res.outputs) == 40
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in res.outputs)
    # the result line is the scenario's result
    line = at.success[0].value
    assert f"hit rate {res.hit_rate:.0%}" in line and f"{res.preemptions} preemption" in line
    # no KV blocks leak: the scenario engine is shut down with every block back
    kv = job.final_stats.kv
    assert kv.used_blocks == 0 and kv.free_blocks + kv.cached_blocks == kv.num_blocks
    assert not job.engine._thread.is_alive()
    # the page shows the shared engine again, untouched, with the cards enabled
    assert "shared datacenter engine" in keyed(at, "kv-shown").markdown[0].value
    assert shared.shared_engine().engine is shared_engine
    assert shared_engine.stats().kv.used_blocks == 0
    assert not at.button(key="kv_run_shared_prefix").disabled
    # waste vs block size from the requests' lengths, the block size used marked
    waste = chart(at, "Waste vs block size")
    assert waste["block_size"].tolist() == list(kv_view.BLOCK_SIZES)
    assert waste["waste"].tolist() == pytest.approx(
        [waste_for_block_size(job.lengths(), bs) for bs in kv_view.BLOCK_SIZES])
    assert waste.loc[waste["chosen"], "block_size"].tolist() == [16]
    # the finished scenario's own steps, and its answers as plain text
    titles = [t for t, _ in charts(at)]
    assert titles.count("Scheduler steps: prefill and decode tokens per step") == 2
    assert f"user 0: {res.outputs[0].text.strip()}" in at.code[0].value
    table = at.dataframe[0].value
    assert table["requests"].tolist() == [40] and table["block size"].tolist() == [16]


def test_block_size_and_prefix_caching_build_the_scenario_engine_and_stop_ends_it(apps):
    at = kv_page(apps)
    at.select_slider(key="kv_block_small_pool").set_value(32)
    at.checkbox(key="kv_prefix_small_pool").check()
    at.button(key="kv_run_small_pool").click().run()
    job = at.session_state[kv_view.SLOT.key]
    assert job.engine.kv.block_size == 32 and job.engine.kv.num_blocks == 32
    assert job.config.enable_prefix_caching
    assert shared.shared_engine().engine.config.block_size == 16  # untouched
    # six long requests in 32 blocks take many steps: the page that started them, drawn
    # straight after, shows the scenario's own engine and locks the other cards
    assert "32 blocks × 32 tokens" in keyed(at, "kv-shown").markdown[0].value
    assert at.button(key="kv_run_many_short").disabled
    at.button(key="kv_stop").click().run()
    run_until(at, lambda a: job.finished and bool(a.warning))
    assert job.result.stopped and "Stopped" in at.warning[0].value
    kv = job.final_stats.kv
    assert kv.used_blocks == 0 and kv.free_blocks + kv.cached_blocks == kv.num_blocks
    assert not job.engine._thread.is_alive()
    assert not at.button(key="kv_run_small_pool").disabled



def shared_line(at: AppTest) -> str | None:
    try:
        return keyed(at, "kv-shared").markdown[0].value
    except AssertionError:
        return None


def test_four_answers_share_the_prompt_blocks_with_ref_count_four(apps):
    at = kv_page(apps)
    assert "parallel_answers" in kv_view.KV_SCENARIOS
    at.button(key="kv_run_parallel_answers").click().run()
    job = at.session_state[kv_view.SLOT.key]
    # live: the forked candidates hold the prompt's blocks together
    run_until(at, lambda a: job.finished or (shared_line(a) is not None
                                             and (chart(a, "Paged")["ref_count"] == 4).any()))
    assert not job.finished, "the scenario ended before a refresh saw its answers"
    paged = chart(at, "Paged")
    used = paged[paged["state"] == "used"]
    prompt_len = len(job.engine.loaded.encode(list(job.scenario.prompts[0])))
    assert (used["ref_count"] == 4).sum() >= prompt_len // 16  # the prompt's full blocks
    assert set(used["ref_count"]) <= {1, 2, 3, 4}  # shared ones, and each answer's own
    line = shared_line(at)
    separate, held = int(used["ref_count"].sum()), len(used)
    assert line.startswith("**KV shared: ") and f"{separate:,} blocks as separate" in line
    saved = (separate - held) * 16 * job.engine.kv_bytes_per_token
    assert f"{saved / 2**20:.1f} MiB saved ({1 - held / separate:.0%})" in line
    # a bound on a hang: 160 sampled tokens take minutes on a busy 2-core machine
    run_until(at, lambda a: job.finished and bool(a.success), timeout=900)
    assert "at its peak, KV shared: " in at.success[0].value
    out = job.result.outputs[0]
    assert len(out.candidates) == 4 and len({c.text for c in out.candidates}) > 1
    text = at.code[0].value
    for j, cand in enumerate(out.candidates, 1):
        assert f"user 0, answer {j}: {cand.text.strip()}" in text
    assert job.final_stats.kv.used_blocks == 0


def test_presenter_shared_prompt_button_starts_the_scenario_on_the_kv_page(apps):
    """Presenter mode's "shared system prompt" button opens this page with it running."""
    from ui.presenter import KEY_KV_START

    at = kv_page(apps)
    at.session_state[KEY_KV_START] = "shared_prefix"
    at.run(timeout=120)
    assert not at.exception, at.exception
    job = at.session_state[kv_view.SLOT.key]
    assert job.scenario.key == "shared_prefix"
    assert KEY_KV_START not in at.session_state
