"""The KV cache page's frames and chart builders (checked through `chart.to_dict()`), and
`waste_for_block_size` against hand-computed values. No model."""

from __future__ import annotations

import dataclasses

import pytest

from engine.engine import StepStats
from engine.kv_cache import BlockInfo, KVCacheManager, waste_for_block_size
from ui import kv_charts as charts
from ui import kv_frames as frames
from ui.charts import template

# five blocks: a's own block, a block shared by a and b (ref count 2), b's own block,
# a cached (free, hashed) block and a free one
BLOCKS = [
    BlockInfo(0, "used", 1, ("req-0",)),
    BlockInfo(1, "used", 2, ("req-0", "req-1")),
    BlockInfo(2, "used", 1, ("req-1",)),
    BlockInfo(3, "cached", 0, ()),
    BlockInfo(4, "free", 0, ()),
]


def values(vega: dict) -> list[dict]:
    return vega["datasets"][vega["data"]["name"]]


def layer_marks(vega: dict) -> list[str]:
    return [layer["mark"]["type"] for layer in vega["layer"]]


# ---- waste_for_block_size --------------------------------------------------------------
@pytest.mark.parametrize(("lengths", "block_size", "expected"), [
    ([10, 17], 8, 13 / 40),  # 2 blocks (16 slots) + 3 blocks (24): 6 + 7 empty of 40
    ([10, 17], 16, 21 / 48),  # 16 + 32 slots: 6 + 15 empty
    ([10, 17], 1, 0.0),  # one slot per block: nothing wasted
    ([32, 16], 16, 0.0),  # whole blocks
    ([1], 128, 127 / 128),
    ([], 16, 0.0),  # nothing reserved
    ([0, 0], 16, 0.0),
])
def test_waste_for_block_size_by_hand(lengths, block_size, expected):
    assert waste_for_block_size(lengths, block_size) == pytest.approx(expected)


def test_waste_for_block_size_rejects_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        waste_for_block_size([4], 0)
    with pytest.raises(ValueError, match="lengths"):
        waste_for_block_size([4, -1], 4)


def test_waste_for_block_size_agrees_with_the_kv_cache_stats():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    for rid, n in (("a", 5), ("b", 8), ("c", 13)):
        assert kv.allocate(rid, n)
        kv.record_computed(rid, list(range(n)), n)
    assert kv.stats().waste == pytest.approx(waste_for_block_size([5, 8, 13], 4))


# ---- the paged block map -----------------------------------------------------------------
def test_block_map_frame_is_one_cell_per_block_with_owner_colour_and_ref_count():
    df = frames.block_map_frame(BLOCKS)
    assert list(df.columns) == frames.MAP_COLUMNS
    assert list(df["state"]) == ["used", "used", "used", "cached", "free"]
    assert list(df["owner"]) == ["req-0", "req-0", "req-1", "", ""]
    assert list(df["label"]) == ["", "2", "", "", ""]
    assert df.loc[1, "owners"] == "req-0, req-1"
    assert list(df["color"]) == [frames.request_color("req-0")] * 2 + [
        frames.request_color("req-1"), frames.CACHED_COLOR, frames.FREE_COLOR]
    assert (df["used"].sum(), df["cached"].sum(), df["free"].sum()) == (3, 1, 1)
    assert list(df["row"]) == [0] * 5 and list(df["col"]) == [0, 1, 2, 3, 4]


def test_a_big_pool_is_drawn_in_groups_of_blocks_with_exact_counts():
    blocks = [BlockInfo(i, "used" if i < 10 else "cached" if i < 15 else "free",
                        3 if i == 2 else int(i < 10), (f"r-{i % 2}",) if i < 10 else ())
              for i in range(200)]
    df = frames.block_map_frame(blocks, max_cells=64)
    assert frames.blocks_per_cell(200, 64) == 4 and len(df) == 50
    assert (df["used"].sum(), df["cached"].sum(), df["free"].sum()) == (10, 5, 185)
    assert list(df["state"][:5]) == ["used", "used", "used", "cached", "free"]
    assert df.loc[0, "label"] == "3" and df.loc[0, "last_block"] == 3
    assert frames.map_columns(200, max_cells=64) == 16  # 50 cells: 16 a row
    assert list(df["row"][-2:]) == [3, 3] and df["col"].max() == 15


def test_small_pools_get_fewer_columns_and_bigger_cells():
    assert [frames.map_columns(n) for n in (8, 64, 192, 256, 512, 768, 2912, 10**6)] == [
        16, 16, 16, 32, 32, 32, 64, 64]
    assert charts.cell_px(16) == 4 * charts.cell_px(64)


def test_request_colours_are_stable_and_not_grey():
    assert frames.request_color("shared_prefix-3") == frames.request_color("race-x-da-u3")
    assert frames.request_color("req-0") != frames.request_color("req-1")
    assert {frames.request_color(f"r-{i}") for i in range(50)} <= set(frames.PALETTE)
    assert frames.FREE_COLOR not in frames.PALETTE and frames.CACHED_COLOR not in frames.PALETTE


def test_block_map_chart_draws_cells_in_their_colour_and_ref_counts():
    df = frames.block_map_frame(BLOCKS)
    vega = charts.block_map_chart(df, 16).to_dict()
    assert layer_marks(vega) == ["rect", "text"]
    cells, labels = vega["layer"]
    assert cells["encoding"]["color"] == {"field": "color", "type": "nominal", "scale": None}
    assert cells["encoding"]["x"]["scale"]["domain"] == list(range(16))
    assert labels["encoding"]["text"]["field"] == "label"
    assert labels["transform"] == [{"filter": "datum.ref_count > 1"}]
    assert vega["height"] == {"step": charts.cell_px(16)}
    assert values(vega) == df.to_dict("records")


# ---- the contiguous layout ---------------------------------------------------------------
def test_contiguous_reservations_hold_n_ctx_per_request_in_arrival_order():
    res = frames.contiguous_reservations(BLOCKS, n_ctx=64, block_size=16)
    assert res == [frames.Reservation("req-0", 4, 2), frames.Reservation("req-1", 4, 2)]
    assert frames.fitting(res, 10) == 2 and frames.fitting(res, 7) == 1
    assert frames.fitting(res, 3) == 0 and frames.fitting([], 10) == 0
    many = [BlockInfo(i, "used", 1, (f"u-{i}",)) for i in (10, 2, 1)]
    assert [r.request_id for r in frames.contiguous_reservations(many, 64, 16)] == [
        "u-1", "u-2", "u-10"]
    long = [BlockInfo(i, "used", 1, ("x",)) for i in range(9)]
    assert frames.contiguous_reservations(long, 64, 16)[0].used_blocks == 4  # capped


def test_contiguous_frame_lays_the_reservations_end_to_end():
    res = [frames.Reservation("a-0", 4, 1), frames.Reservation("b-1", 4, 2),
           frames.Reservation("c-2", 4, 4)]  # only two fit in 10 blocks
    df = frames.contiguous_frame(res, 10)
    assert list(df["state"]) == ["used"] + ["reserved"] * 3 + ["used"] * 2 + [
        "reserved"] * 2 + ["free"] * 2
    assert list(df["owner"][:8]) == ["a-0"] * 4 + ["b-1"] * 4
    assert list(df["opacity"][:2]) == [1.0, frames.RESERVED_OPACITY]
    assert (df["used"].sum(), df["reserved"].sum(), df["free"].sum()) == (3, 5, 2)
    grouped = frames.contiguous_frame(res, 10, max_cells=4)  # 3 blocks a cell
    assert len(grouped) == 4 and list(grouped["state"]) == ["used", "used", "reserved", "free"]
    assert (grouped["used"].sum(), grouped["reserved"].sum(), grouped["free"].sum()) == (3, 5, 2)


def test_contiguous_chart_draws_reserved_blocks_pale():
    df = frames.contiguous_frame([frames.Reservation("a-0", 4, 1)], 6)
    vega = charts.contiguous_chart(df).to_dict()
    assert layer_marks(vega) == ["rect"]
    enc = vega["layer"][0]["encoding"]
    assert enc["opacity"] == {"field": "opacity", "type": "quantitative", "scale": None}
    assert enc["color"]["field"] == "color"
    assert values(vega) == df.to_dict("records")


# ---- the scheduler timeline --------------------------------------------------------------
def step(start: float, prefill: int, decode: int, preempted: int = 0) -> StepStats:
    return StepStats(start=start, duration=0.05, num_seqs=3, num_prefill_tokens=prefill,
                     num_decode_tokens=decode, num_preempted=preempted, kv_usage=0.5,
                     kv_used_slots=10, kv_reserved_slots=16)


def test_step_frame_stacks_prefill_under_decode_and_numbers_the_steps():
    steps = [step(10.0, 300, 2), step(10.1, 0, 3, preempted=1), step(10.2, 16, 2)]
    df = frames.step_frame(steps, num_steps=42, last=2)  # the engine has run 42 steps
    assert list(df.columns) == frames.STEP_COLUMNS
    assert list(df["step"]) == [40, 40, 41, 41]
    assert list(df["kind"]) == ["prefill", "decode"] * 2
    assert list(zip(df["lo"], df["hi"], strict=True)) == [(0, 0), (0, 3), (0, 16), (16, 18)]
    assert list(df["num_preempted"]) == [1, 1, 0, 0]
    assert df["t"].tolist() == pytest.approx([0.0, 0.0, 0.1, 0.1])
    assert frames.step_frame((), 0).empty


def test_step_frame_stacks_verified_drafts_on_top():
    spec_step = dataclasses.replace(step(5.0, 16, 3), num_draft_tokens=10,
                                    num_accepted_tokens=7)
    df = frames.step_frame([step(4.9, 0, 3), spec_step], num_steps=2)
    assert list(df["kind"]) == ["prefill", "decode", "prefill", "decode", "accepted draft",
                                "rejected draft"]
    assert list(zip(df["lo"], df["hi"], strict=True))[2:] == [(0, 16), (16, 19), (19, 26),
                                                               (26, 29)]


def test_steps_chart_stacks_tokens_and_marks_preemptions():
    df = frames.step_frame([step(1.0, 100, 0), step(1.1, 0, 4, preempted=2)], num_steps=2)
    vega = charts.steps_chart(df).to_dict()
    assert layer_marks(vega) == ["rect", "rule", "point"]
    bars = vega["layer"][0]["encoding"]
    assert (bars["x"]["field"], bars["x2"]["field"]) == ("x0", "x1")
    assert (bars["y"]["field"], bars["y2"]["field"]) == ("lo", "hi")
    assert bars["color"]["scale"]["domain"] == ["prefill", "decode", "accepted draft",
                                                 "rejected draft"]
    for layer in vega["layer"][1:]:
        assert layer["transform"] == [
            {"filter": "datum.kind == 'prefill' && datum.num_preempted > 0"}]
    assert values(vega) == df.to_dict("records")


# ---- waste vs block size -----------------------------------------------------------------
def test_waste_frame_and_chart_mark_the_chosen_block_size():
    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    df = frames.waste_frame([10, 17, 40], sizes, chosen=16)
    assert list(df["block_size"]) == list(sizes)
    assert df["waste"].tolist() == pytest.approx(
        [waste_for_block_size([10, 17, 40], bs) for bs in sizes])
    assert df["chosen"].tolist() == [bs == 16 for bs in sizes]
    assert df.loc[4, "label"] == f"block size 16: {df.loc[4, 'waste']:.1%} empty"
    assert df["label_side"].tolist() == ["left"] * 4 + ["right"] * 4
    vega = charts.waste_chart(df).to_dict()
    assert layer_marks(vega) == ["line", "rule", "point", "text", "text"]
    assert vega["layer"][0]["encoding"]["x"]["scale"] == {"type": "log", "base": 2}
    assert vega["layer"][2]["transform"] == [{"filter": "datum.chosen"}]
    assert values(vega) == df.to_dict("records")


def test_every_template_is_a_vega_lite_dict_without_rows():
    empties = [charts.block_map_chart(frames.block_map_frame([])),
               charts.contiguous_chart(frames.contiguous_frame([], 0)),
               charts.steps_chart(frames.step_frame((), 0)),
               charts.waste_chart(frames.waste_frame([], (1, 16), 16))]
    for chart in empties:
        vega = template(chart)
        assert "datasets" not in vega and "data" not in vega and vega["layer"]


def test_kv_shared_is_what_separate_copies_would_hold_minus_what_is_held():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate("r#0", 10)  # a 10-token prompt: 3 blocks
    kv.record_computed("r#0", list(range(10)), 10)
    assert frames.kv_shared(kv.stats().reserved_slots, kv.stats().used_blocks, 4, 100) is None
    for i in (1, 2, 3):
        kv.fork("r#0", f"r#{i}", 10)  # 4 answers hold the prompt's 3 blocks together
    for i in range(4):
        kv.allocate(f"r#{i}", 13)  # each writes on: a tail of its own, then a new block
    s = kv.stats()
    shared = frames.kv_shared(s.reserved_slots, s.used_blocks, 4, 100)
    # separate: 4 x 4 blocks; held: the 2 full prompt blocks + 4 tails + 4 new blocks
    assert (shared.separate_blocks, shared.held_blocks) == (16, 10)
    assert shared.saved_bytes == 6 * 4 * 100 and shared.saved_share == pytest.approx(6 / 16)
    assert shared.line == f"KV shared: {2400 / 2**20:.1f} MiB saved (38%)"


def test_peak_kv_shared_takes_the_step_that_saved_most():
    step = StepStats(0.0, 0.1, 4, 0, 4, 0, kv_usage=0.25, kv_used_slots=0,
                     kv_reserved_slots=64)
    steps = [dataclasses.replace(step, kv_usage=0.5, kv_reserved_slots=32), step,
             dataclasses.replace(step, kv_reserved_slots=16)]
    peak = frames.peak_kv_shared(steps, num_blocks=16, block_size=4, bytes_per_token=1)
    assert (peak.separate_blocks, peak.held_blocks) == (16, 4)  # the second step's
    assert frames.peak_kv_shared(steps[2:], 16, 4, 1) is None  # no block shared
