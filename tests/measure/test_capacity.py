"""The capacity search against its definition (checked by brute force), and the cost and
energy arithmetic by hand."""

from __future__ import annotations

import math

import pytest

from measure import capacity as cap
from measure import hardware
from measure import projection as P

L70 = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=8)


def test_the_seed_example_needs_4000_tokens_per_s() -> None:
    demand = cap.Demand()
    assert (demand.connected, demand.active, demand.tokens_per_s_each) == (1000, 200, 20)
    assert demand.tokens_per_s == 4000


def meets(layout: P.Layout, demand: cap.Demand, slo: cap.Slo, replicas: int) -> bool:
    """The definition, written out: every replica's users get a token within the target."""
    batch = math.ceil(demand.active / replicas)
    if batch > P.max_batch(layout, demand.context):
        return False
    step = P.decode_step_seconds(layout, batch, demand.context)
    prefill = P.prefill_seconds(layout, demand.prompt_tokens)
    share = batch * demand.tokens_per_s_each / demand.output_tokens * prefill
    tpot_target = min(slo.tpot_s, 1 / demand.tokens_per_s_each)
    return share < 1 and step / (1 - share) <= tpot_target and prefill + step <= slo.ttft_s


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("slo", [cap.Slo(), cap.Slo(ttft_s=0.5, tpot_s=0.02)])
def test_plan_is_the_fewest_replicas_that_meet_the_targets(tp: int, slo: cap.Slo) -> None:
    layout = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=tp)
    demand = cap.Demand()
    plan = cap.plan(layout, demand, slo)
    brute = next((r for r in range(1, demand.active + 1) if meets(layout, demand, slo, r)),
                 None)
    if brute is None:
        assert not plan.ok and plan.reason.startswith("No batch meets the targets")
        return
    assert plan.ok and plan.replicas == brute and plan.gpus == brute * tp
    assert plan.batch == math.ceil(demand.active / brute)
    assert plan.replicas * plan.replica_tokens_per_s >= demand.tokens_per_s
    assert plan.tpot_s <= slo.tpot_s and plan.ttft_s <= slo.ttft_s


def test_a_layout_that_does_not_fit_plans_nothing() -> None:
    plan = cap.plan(P.Layout("llama-3.1-70b", "h100_sxm", tp=1), cap.Demand(), cap.Slo())
    assert not plan.ok and plan.reason.startswith("Does not fit") and plan.gpus == 0


def test_nobody_generating_needs_no_replica() -> None:
    plan = cap.plan(L70, cap.Demand(active=0), cap.Slo())
    assert plan.ok and plan.replicas == 0


def test_cost_and_energy_by_hand() -> None:
    # 8 GPUs at $3/h = $24/h = $0.006667/s; at 4,000 tokens/s: $1.667 per million tokens
    assert cap.cost_per_million_tokens(3.0, 8, 4000) == pytest.approx(24 / 3600 / 4000 * 1e6)
    # 8 × 700 W for a 16.25 ms step of 64 tokens: 1.4219 J a token
    assert cap.energy_per_token_j(5600, 0.01625, 64) == pytest.approx(1.421875)
    with pytest.raises(ValueError):
        cap.cost_per_million_tokens(3.0, 8, 0)


def test_local_pcs_one_each_at_the_roofline() -> None:
    demand = cap.Demand()
    m = P.get_model("llama-3.1-8b").profile
    lp = cap.local_plan(m, "rtx4090", demand)
    p = hardware.decode_tokens_per_s(m, "fp16", "rtx4090", 1, demand.context)
    assert lp.pcs == demand.connected and lp.tokens_per_s_each == p.per_user
    assert lp.energy_per_token_j == pytest.approx(450 * p.step_seconds)
    assert lp.meets_rate == (p.per_user >= 20)


def test_every_system_has_a_sourced_price_and_every_pc_a_sourced_power() -> None:
    assert set(cap.GPU_HOUR_USD) == set(P.systems())
    assert all(price > 0 and src for price, src in cap.GPU_HOUR_USD.values())
    assert all(w > 0 and src for w, src in cap.LOCAL_POWER_W.values())


def test_bad_demand_names_the_field() -> None:
    with pytest.raises(ValueError, match="active"):
        cap.Demand(connected=10, active=11)
    with pytest.raises(ValueError, match="tokens_per_s_each"):
        cap.Demand(tokens_per_s_each=0)
    with pytest.raises(ValueError, match="ttft_s"):
        cap.Slo(ttft_s=0)
