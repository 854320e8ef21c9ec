"""Chart builders and snapshot frames, checked through `chart.to_dict()` (no model)."""

from __future__ import annotations

from ui import arena, charts, frames, kv_view, presenter
from workloads import scenarios
from workloads.prompts import load_prompts, user_prompts
from workloads.race import RaceSnapshot, SideView


def snapshot(**kw) -> RaceSnapshot:
    base = dict(phase="done", elapsed=3.0, sides={}, tokens=[], kv=[], batch=[], rows=[],
                finished=True, ratio=None, error=None)
    return RaceSnapshot(**{**base, **kw})


SNAP = snapshot(
    tokens=[{"side": s, "t": t, "tokens": n} for s in ("local", "datacenter")
            for t, n in ((0.0, 0), (0.5, 4), (1.0, 9))],
    kv=[{"side": "local", "t": 0.5, "kind": k, "bytes": b}
        for k, b in (("reserved", 2**21), ("used", 2**19))],
    batch=[{"t": 0.1, "num_seqs": 3}, {"t": 0.2, "num_seqs": 2}],
    rows=[{"side": s, "user": u, "you": u == 0, "ttft_s": 0.1 * (u + 1), "tpot_s": 0.05,
           "e2e_s": 1.0 + u, "queue_s": 0.0, "tokens": 8, "tokens_per_s": 8.0,
           "finish_reason": "length"} for s in ("local", "datacenter") for u in range(3)],
)


def values(vega: dict) -> list[dict]:
    return next(iter(vega["datasets"].values()))


def test_tokens_chart_has_one_line_per_side():
    vega = charts.tokens_chart(frames.tokens_frame(SNAP)).to_dict()
    assert vega["mark"]["type"] == "line"
    assert vega["encoding"]["x"]["field"] == "t" and vega["encoding"]["y"]["field"] == "tokens"
    assert vega["encoding"]["color"]["scale"]["domain"] == ["Local PC", "Datacenter"]
    assert {v["side"] for v in values(vega)} == {"Local PC", "Datacenter"}
    assert len(values(vega)) == 6


def test_latency_chart_draws_ttft_and_e2e_by_user():
    vega = charts.latency_chart(frames.latency_frame(SNAP)).to_dict()
    assert vega["encoding"]["x"]["field"] == "user"
    assert vega["encoding"]["strokeDash"]["field"] == "metric"
    rows = values(vega)
    assert len(rows) == 12 and {r["metric"] for r in rows} == {"TTFT", "end-to-end"}


def test_kv_chart_is_in_mib_with_reserved_and_used():
    vega = charts.kv_chart(frames.kv_frame(SNAP)).to_dict()
    assert vega["encoding"]["y"]["field"] == "mib"
    assert sorted(v["mib"] for v in values(vega)) == [0.5, 2.0]
    assert vega["encoding"]["strokeDash"]["scale"]["domain"] == ["reserved", "used"]


def test_batch_chart_plots_sequences_per_step():
    vega = charts.batch_chart(frames.batch_frame(SNAP)).to_dict()
    assert vega["encoding"]["y"]["field"] == "num_seqs"
    assert [v["num_seqs"] for v in values(vega)] == [3, 2]


def test_empty_snapshot_still_gives_valid_charts():
    empty = snapshot()
    for build, frame in ((charts.tokens_chart, frames.tokens_frame),
                         (charts.latency_chart, frames.latency_frame),
                         (charts.kv_chart, frames.kv_frame),
                         (charts.batch_chart, frames.batch_frame)):
        vega = build(frame(empty)).to_dict()
        assert values(vega) == []


def test_rows_frame_has_fixed_columns_for_the_csv():
    df = frames.rows_frame(SNAP)
    assert list(df.columns) == frames.ROW_COLUMNS
    assert set(df["side"]) == {"Local PC", "Datacenter"}
    assert df.to_csv(index=False).splitlines()[0].startswith("side,user,you,ttft_s")


def test_a_chart_gets_at_most_about_max_points_first_and_last_kept():
    pts = [{"t": i} for i in range(1001)]
    out = frames.thin(pts, 100)
    assert len(out) <= 102 and out[0] == pts[0] and out[-1] == pts[-1]
    assert frames.thin(pts[:5], 100) == pts[:5]


def test_a_long_kv_series_keeps_both_kinds():
    kv = [{"side": "local", "t": i / 10, "kind": k, "bytes": b}
          for i in range(1000) for k, b in (("reserved", 2**21), ("used", 2**19))]
    cols = frames.kv_columns(snapshot(kv=kv))
    assert cols["kind"].count("reserved") == cols["kind"].count("used") <= frames.MAX_POINTS + 1
    assert cols["t"][-1] == kv[-1]["t"]


def test_the_race_summary_names_both_totals_and_their_ratio():
    def side(name: str, tps: float) -> SideView:
        return SideView(name, 8, True, True, 2.0, "", 0.1, 5.0, 64, tps, 8, None)

    snap = snapshot(sides={"datacenter": side("datacenter", 123.4), "local": side("local", 9.87)},
                    ratio=123.4 / 9.87)
    assert arena.summary_sentence(snap) == (
        "With 8 users at once, the datacenter engine generated 123 tokens/s in total, 12.5x "
        "the local PC's 9.9 tokens/s serving one user at a time.")


def test_every_presenter_scenario_is_played_by_a_page():
    from ui import speculative_view

    assert len(presenter.SCENARIOS) == 5
    assert set(kv_view.KV_SCENARIOS) <= set(scenarios.SCENARIOS)
    for key in presenter.SCENARIOS:
        assert scenarios.get(key).key == key
    assert [k for k in presenter.SCENARIOS if k in kv_view.KV_SCENARIOS] == ["shared_prefix"]
    assert speculative_view.SCENARIO in presenter.SCENARIOS  # the arena page's comparison


def test_presets_include_korean_and_a_long_prompt():
    presets = load_prompts()
    texts = list(presets.presets.values())
    assert any(any("\uac00" <= ch <= "\ud7a3" for ch in t) for t in texts)  # Hangul
    assert max(len(t) for t in texts) > 2000
    assert len(set(presets.others)) >= 8


def test_user_prompts_put_you_first_or_last():
    prompts, you = user_prompts("mine", 4, True, False, ("a", "b"))
    assert you == 0 and [p[0]["content"] for p in prompts] == ["mine", "a", "b", "a"]
    prompts, you = user_prompts("mine", 3, False, True, ("a", "b"))
    assert you == 2 and [p[0]["content"] for p in prompts] == ["mine"] * 3
    assert prompts[0] == ({"role": "user", "content": "mine"},)


def test_a_template_is_the_vega_lite_dict_without_its_rows():
    chart = charts.tokens_chart(frames.tokens_frame(SNAP))
    vega = charts.template(chart)
    assert "datasets" not in vega and "data" not in vega
    assert vega["encoding"] == chart.to_dict()["encoding"]
