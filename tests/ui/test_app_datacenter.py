"""The Datacenter page (AppTest, run on its own: no model, no shared engine) and its chart
builders (`chart.to_dict()`): every system × TP choice renders, an impossible layout says
why in one line, the figures shown are `measure.projection`'s, and the presenter's
scenario gives the same text every run."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from apptest import metric, pick
from streamlit.testing.v1 import AppTest

from measure import capacity as cap
from measure import projection as P
from ui import datacenter_charts as charts
from ui import datacenter_view as view

PAGE = str(Path(__file__).resolve().parents[2] / "pages" / "datacenter.py")


def page(**picks) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception, at.exception
    return pick(at, **picks)


@pytest.mark.exhaustive
def test_every_system_and_tp_renders() -> None:
    at = page()
    seen = set()
    for system in P.systems():
        for tp in P.TP_SIZES:
            pick(at, dc_system=system, dc_tp=tp)
            layout = P.Layout("llama-3.1-70b", system, "trtllm", tp=tp)
            verdict = P.check(layout, 2048, 64)
            if verdict.ok:
                assert at.success and layout.label() in at.success[0].value
                seen.add("fits")
            else:
                # one line, the projection's own reason
                assert [e.value for e in at.error][:1] == [verdict.reason]
                assert "\n" not in verdict.reason
                seen.add("does not fit")
    assert seen == {"fits", "does not fit"}


@pytest.mark.parametrize(("picks", "words"), [
    ({"dc_model": "smollm2-135m", "dc_tp": 2}, "9 attention heads do not split evenly"),
    ({"dc_model": "llama-3.1-405b", "dc_tp": 8, "dc_pp": 4}, "126 layers do not split"),
    ({"dc_system": "a100_sxm", "dc_dtype": "fp8"}, "no fp8 tensor cores"),
    ({"dc_tp": 1}, "Does not fit: Llama-3.1-70B bf16 needs 131.4 GiB"),
])
def test_an_impossible_layout_says_why_in_one_line(picks: dict, words: str) -> None:
    at = page(**picks)
    assert words in at.error[0].value and "\n" not in at.error[0].value
    assert not at.success


def test_the_figures_are_the_projection_s() -> None:
    at = page()
    layout = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=8)
    step = P.decode_step(layout, 64, 2048)
    assert metric(at, "Tokens/s total (batch 64)") == view.fmt_number(64 / step.seconds)
    assert metric(at, "Communication share") == f"{step.communication_share:.0%}"
    assert metric(at, "Prefill of 2,048 tokens") == view.fmt_seconds(
        P.prefill_seconds(layout, 2048))
    assert metric(at, "KV capacity (tokens)") == view.fmt_count(P.kv_capacity_tokens(layout))
    plan = cap.plan(layout, cap.Demand(prompt_tokens=2048), cap.Slo())
    assert metric(at, "GPUs") == f"{plan.gpus:,}"
    assert metric(at, "TPOT") == view.fmt_latency(plan.tpot_s)  # apart: each fits its column
    assert metric(at, "TTFT") == view.fmt_latency(plan.ttft_s)
    assert "4,000 tokens/s needed" in " ".join(m.value for m in at.markdown)


def test_a_slower_link_and_a_roofline_model_say_where_numbers_come_from() -> None:
    at = page(dc_link="pcie5")
    captions = " ".join(c.value for c in at.caption)
    assert "as measured on RTX PRO 6000" in captions
    at = pick(at, dc_link="", dc_model="llama-2-70b", dc_tp=4)
    captions = " ".join(c.value for c in at.caption)
    assert "not in aiconfigurator-core's bundled models" in captions


def test_pipeline_parallel_shows_its_bubble() -> None:
    at = page(dc_tp=4, dc_pp=2)
    captions = " ".join(c.value for c in at.caption)
    assert "1 micro-batch: 50%" in captions and "8 micro-batches: 11%" in captions
    assert "2 nodes" not in captions and "one node" in captions
    at = pick(at, dc_tp=8, dc_pp=2)  # 16 GPUs: two nodes of 8, hops over InfiniBand
    assert "2 nodes of 8" in " ".join(c.value for c in at.caption)


def test_the_capacity_preset_restores_the_seed_example() -> None:
    at = page(dc_active=50, dc_connected=300)
    assert "1,000 tokens/s needed" in " ".join(m.value for m in at.markdown)
    at.button(key="dc_preset").click().run()
    assert "4,000 tokens/s needed" in " ".join(m.value for m in at.markdown)


def scenario_text(at: AppTest) -> list[str]:
    return [m.value for m in at.markdown if m.value.startswith("**TP=")]


def test_the_scenario_gives_the_same_text_every_run() -> None:
    shown = []
    for _ in range(2):
        at = page()
        at.button(key="dc_scenario_button").click().run()
        shown.append(scenario_text(at))
    assert shown[0] == shown[1] and len(shown[0]) == 4
    one, two, nvlink, pcie = shown[0]
    assert "Does not fit" in one and "fits" in two
    df = view.scenario_frame()
    assert df["tokens_per_s"].iloc[2] > 1.5 * df["tokens_per_s"].iloc[3]  # NVLink vs PCIe
    assert f"{df['comm_share'].iloc[3]:.0%}" in pcie


def presenter_page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["presenter"] = True
    at.run()
    assert not at.exception, at.exception
    return at


def test_presenter_bar_steps_the_controls_through_the_scenario_s_layouts() -> None:
    at = presenter_page()
    popover = at.get("popover")[0]  # the settings fold into the bar's popover
    assert {getattr(w, "key", None) for w in popover} >= {"dc_model", "dc_tp", "dc_link"}
    at.button(key="dc_scenario_button").click().run()  # its first layout: TP=1
    assert at.session_state["dc_stage"] == view.STAGES[0]
    assert "Does not fit" in at.error[0].value and not at.success
    for stage, (_, tp, link) in zip(view.STAGES[1:], view.SCENARIO_STEPS[1:], strict=True):
        at.button(key=f"dc_stage_{stage}").click().run()
        assert not at.exception, at.exception
        layout = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=tp, link=link)
        verdict = P.check(layout, 2048, 64)  # TP=2 holds the weights, not 64 users' KV
        shown = at.success[0].value if verdict.ok else at.error[0].value
        assert shown.startswith(f"Fits: {layout.gpus}× H100") if verdict.ok else (
            shown == verdict.reason)
        batch = min(64, P.max_batch(layout, 2048))
        step = P.decode_step(layout, batch, 2048)
        assert metric(at, f"Tokens/s total (batch {batch})") == view.fmt_number(
            batch / step.seconds)
        assert metric(at, "Communication share") == (
            f"{step.communication_share:.0%}")
        primary = [b.key for b in at.button if b.proto.type == "primary"]
        assert primary == [f"dc_stage_{stage}"]  # the bar highlights the layout shown
    pick(at, dc_batch=32)  # a setting changed by hand: no stage is shown any more
    assert [b.key for b in at.button if b.proto.type == "primary"] == ["dc_scenario_button"]


def test_presenter_stages_follow_the_clicker_order() -> None:
    assert view.STAGES == ("tp1", "tp2", "tp8", "tp8-pcie5")
    assert [view.stage_settings(s)[view.KEY_TP] for s in view.STAGES] == [1, 2, 8, 8]
    assert view.stage_settings("tp8-pcie5")[view.KEY_LINK] == "pcie5"
    assert view.stage_settings("tp8")[view.KEY_LINK] == view.OWN_LINK


# ---- chart builders ------------------------------------------------------------------
def test_decode_chart_draws_measured_and_ideal() -> None:
    choice = view.Choice(P.Layout("llama-3.1-8b", "h200_sxm", "vllm", tp=2), 1024, 8, 512)
    df = view.decode_frame(choice)
    assert set(df["kind"]) == set(charts.KINDS) and set(df["series"]) == set(charts.SERIES)
    spec = charts.decode_chart(df, "t").to_dict()
    assert spec["encoding"]["strokeDash"]["field"] == "kind"
    top = max(df["batch"])
    assert top == max(b for b in view.BATCH_GRID if b <= P.max_batch(choice.layout, 1024))
    row = df[(df["batch"] == 8) & (df["kind"] == "measured") & (df["series"] == "total")]
    assert row["tokens_per_s"].iloc[0] == pytest.approx(
        8 / P.decode_step_seconds(choice.layout, 8, 1024))


def test_breakdown_chart_stacks_the_parts() -> None:
    choice = view.Choice(P.Layout("llama-3.1-70b", "b200_sxm", "sglang", tp=4), 2048, 32,
                         1024)
    df = view.breakdown_frame(choice)
    spec = charts.breakdown_chart(df, "t").to_dict()
    assert spec["encoding"]["x"]["stack"] == "zero"
    measured = df[df["step"] == "decode, batch 32 — measured"].set_index("part")["ms"]
    step = P.decode_step(choice.layout, 32, 2048)
    assert measured["communication"] == pytest.approx(step.communication_s * 1e3)
    assert measured.sum() == pytest.approx(step.seconds * 1e3)


def test_local_and_scenario_charts() -> None:
    choice = view.Choice(P.Layout("llama-3.1-70b", "h100_sxm", tp=8), 2048, 64, 2048)
    df = view.local_frame(choice)
    assert set(df["device"]) == {"RTX 4090 24 GB", "Apple M2 Max (64 GB unified)",
                                 "Laptop CPU (DDR5-5600, 32 GB)"}
    assert set(df["bound"]) == {"offload"}  # a 70B model fits none of them
    spec = charts.local_chart(df, [0.01, 1e4]).to_dict()
    assert spec["encoding"]["y"]["scale"]["domain"] == [0.01, 1e4]
    scen = charts.scenario_chart(view.scenario_frame()).to_dict()
    assert scen["title"] == "70B on 8 GPUs"
    assert isinstance(view.links_frame(choice), pd.DataFrame)


def test_the_hardware_page_s_node_shows_the_measured_step_beside_it() -> None:
    """The Hardware page's "8×H100 SXM node" adds up 8 GPUs as if all-reduces were free;
    it now says what the measured 8-GPU step gives."""
    hw_page = str(Path(PAGE).parent / "hardware.py")
    at = AppTest.from_file(hw_page, default_timeout=120).run()
    at = pick(at, hw_hardware="8xh100", hw_model="llama-3-70b", hw_batch=64)
    layout = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=8)
    measured = 64 / P.decode_step_seconds(layout, 64, 2048)
    note = at.info[0].value
    assert "as if the all-reduces after every layer were free" in note
    assert f"it is {view.fmt_number(measured)} tokens/s" in note
