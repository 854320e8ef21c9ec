"""measure.projection against the figures aiconfigurator-core 0.12.0 gives for fixed
inputs, its pipeline and link arithmetic, its memory answers, and the roofline fallback
for a model the package does not bundle."""

from __future__ import annotations

import math

import pytest
from aiconfigurator_core.sdk import EngineHandle

from measure import dc_catalogue, hardware, interconnect
from measure import projection as P

L70 = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=8)


def test_llama_70b_tp8_h100_trtllm_as_the_package_prints_it() -> None:
    """Context 2048: decode 9.98 ms at batch 1, 16.25 ms at 64, prefill of 2048 tokens
    93.7 ms; the all-reduces 6% and 26% of the step; TP=4 22.4 ms at batch 64."""
    assert P.decode_step_seconds(L70, 1, 2048) * 1e3 == pytest.approx(9.98, abs=0.005)
    assert P.decode_step_seconds(L70, 64, 2048) * 1e3 == pytest.approx(16.25, abs=0.005)
    assert P.prefill_seconds(L70, 2048) * 1e3 == pytest.approx(93.7, abs=0.05)
    assert P.decode_step(L70, 1, 2048).communication_share == pytest.approx(0.06, abs=0.005)
    assert P.decode_step(L70, 64, 2048).communication_share == pytest.approx(0.26, abs=0.005)
    tp4 = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=4)
    assert P.decode_step_seconds(tp4, 64, 2048) * 1e3 == pytest.approx(22.4, abs=0.05)


def test_wrapper_gives_the_package_s_own_numbers() -> None:
    h = EngineHandle.compile("Qwen/Qwen3-32B", "b200_sxm", "vllm", tp_size=2,
                             gemm_quant_mode="fp8", kvcache_quant_mode="fp8")
    layout = P.Layout("qwen3-32b", "b200_sxm", "vllm", tp=2, dtype="fp8")
    for batch in (1, 7, 100):
        assert P.decode_step_seconds(layout, batch, 900) == pytest.approx(
            h.decode_step_latency(batch, 900, 2) / 1e3, rel=1e-9)
        assert P.decode_step_seconds(layout, batch, 900) == pytest.approx(
            h.predict_decode_latency(batch, 900) / 1e3, rel=1e-3)  # its other entry point
        assert P.decode_step_seconds(layout, batch, 900) == pytest.approx(
            P.decode_step(layout, batch, 900).seconds, rel=1e-12)
    assert P.prefill_seconds(layout, 3000) == pytest.approx(
        h.predict_prefill_latency(1, 3000) / 1e3, rel=1e-9)
    # the breakdown sums to the step the package reports with its per-op values
    step = P.decode_step(layout, 7, 900)
    assert sum(step.parts().values()) == pytest.approx(step.seconds)
    assert step.seconds == pytest.approx(h.decode_step_latency(7, 900, 2) / 1e3, rel=1e-9)
    assert min(step.parts().values()) >= 0 and step.gemm_s > 0 and step.attention_s > 0


def test_pipeline_parallel_keeps_pp_micro_batches_in_flight() -> None:
    layout = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=4, pp=2)
    h = EngineHandle.compile("meta-llama/Meta-Llama-3.1-70B", "h100_sxm", "trtllm",
                             tp_size=4, pp_size=2)
    # batch 8 -> two micro-batches of 4, each one pass through both stages
    assert P.decode_step_seconds(layout, 8, 2048) == pytest.approx(
        h.decode_step_latency(4, 2048, 2) / 1e3)
    assert P.decode_step_seconds(layout, 1, 2048) == pytest.approx(
        h.decode_step_latency(1, 2048, 2) / 1e3)  # one sequence cannot be split
    assert P.decode_step(layout, 8, 2048).communication_s > 0  # all-reduces and the hop


def test_a_slower_link_takes_its_measured_all_reduces() -> None:
    """The same 8 GPUs over PCIe 5: communication as measured on 8 RTX PRO 6000 servers'
    GPUs (PCIe 5), everything else as measured on H100."""
    pcie = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=8, link="pcie5")
    twin = P.link_twin(pcie)
    assert twin == P.Layout("llama-3.1-70b", "rtx_pro_6000_server", "trtllm", tp=8)
    native, moved = P.decode_step(L70, 64, 2048), P.decode_step(pcie, 64, 2048)
    assert moved.communication_s == P.decode_step(twin, 64, 2048).communication_s
    assert moved.gemm_s == native.gemm_s and moved.attention_s == native.attention_s
    assert moved.seconds == pytest.approx(native.seconds - native.communication_s
                                          + moved.communication_s)
    assert moved.communication_s > 3 * native.communication_s
    assert P.decode_step_seconds(pcie, 64, 2048) == pytest.approx(moved.seconds)
    assert P.prefill_seconds(pcie, 2048) > P.prefill_seconds(L70, 2048)
    assert "RTX PRO 6000" in P.source_note(pcie)


def test_a_link_without_measured_data_takes_the_ring_formula() -> None:
    """Tensor parallel over InfiniBand between nodes: no measured all-reduces there."""
    ib = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=8, link="ib_ndr")
    assert P.link_twin(ib) is None
    native, moved = P.decode_step(L70, 64, 2048), P.decode_step(ib, 64, 2048)
    formula = interconnect.tensor_parallel_seconds(64, 8192, 80, 8, "ib_ndr")
    assert moved.communication_s == pytest.approx(formula)
    assert moved.seconds == pytest.approx(native.seconds - native.communication_s + formula)
    assert "ring formula" in P.source_note(ib)
    # fp8 has no twin on A100 (no fp8 tensor cores): the formula answers there too
    fp8 = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=8, dtype="fp8", link="nvlink3")
    assert P.link_twin(fp8) is None


def test_memory_per_gpu() -> None:
    mem = P.memory(L70)
    assert mem.source == "measured"
    assert mem.weights_bytes == pytest.approx(70.55e9 * 2 / 8, rel=0.01)
    assert mem.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # one KV head per GPU, bf16
    assert mem.kv_tokens == pytest.approx(mem.kv_bytes / mem.kv_bytes_per_token, abs=1)
    assert mem.weights_bytes + mem.other_bytes + mem.kv_bytes <= mem.capacity_bytes
    assert P.kv_capacity_blocks(L70, 16) == P.kv_capacity_tokens(L70) // 16
    assert P.max_batch(L70, 2048) == P.kv_capacity_tokens(L70) // 2048
    assert P.weights_bytes(L70) == pytest.approx(8 * mem.weights_bytes)
    assert P.gpus_per_replica(L70) == 8
    assert P.power_per_gpu_w(L70) == 700
    assert P.energy_per_step_j(L70, 64, 2048) == pytest.approx(
        700 * 8 * P.decode_step_seconds(L70, 64, 2048))


def test_70b_needs_two_h100s() -> None:
    one = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=1)
    verdict = P.check(one)
    assert not verdict.ok and verdict.reason.startswith("Does not fit")
    assert "131.4 GiB" in verdict.reason and "\n" not in verdict.reason
    assert P.max_batch(one, 2048) == 0 and P.kv_capacity_tokens(one) == 0
    two = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=2)
    assert P.check(two, 2048, 1).ok
    crowded = P.check(two, 2048, 10 * P.max_batch(two, 2048))
    assert not crowded.ok and crowded.reason.startswith("KV cache does not fit")


@pytest.mark.parametrize(("layout", "words"), [
    (P.Layout("smollm2-135m", "h100_sxm", tp=2), "9 attention heads do not split"),
    (P.Layout("llama-3.1-405b", "h100_sxm", tp=8, pp=4), "126 layers do not split"),
    (P.Layout("llama-3.1-70b", "a100_sxm", tp=8, dtype="fp8"), "no fp8 tensor cores"),
    (P.Layout("llama-3.1-8b", "h100_sxm", "sglang", tp=8, dtype="fp8"),
     "aiconfigurator-core has no measured data for SGLang fp8"),
])
def test_impossible_layouts_say_why_in_one_line(layout: P.Layout, words: str) -> None:
    verdict = P.check(layout)
    assert not verdict.ok and words in verdict.reason and "\n" not in verdict.reason
    with pytest.raises(ValueError, match=words):
        P.decode_step_seconds(layout, 1, 100)


def test_a_model_the_package_lacks_falls_back_to_the_roofline() -> None:
    layout = P.Layout("llama-2-70b", "h100_sxm", "trtllm", tp=4)
    assert not layout.measured
    step = P.decode_step(layout, 16, 1000)
    assert step.source == "roofline"
    assert step == P.ideal_decode_step(layout, 16, 1000)
    # the roofline of a 4-GPU group: step_cost on 4× the bandwidth, plus the ring formula
    group = P.get_system("h100_sxm").roofline_profile(4)
    cost = hardware.step_cost("llama-2-70b", "fp16", group, 16, 16, 16_000)
    comm = interconnect.tensor_parallel_seconds(16, 8192, 80, 4, "nvlink4")
    assert step.seconds == pytest.approx(cost.seconds + comm)
    assert P.memory(layout).source == "roofline"
    assert P.prefill(layout, 512).source == "roofline"
    assert "not in aiconfigurator-core" in P.source_note(layout)
    assert "Measured kernels" in P.source_note(L70)


def test_an_unbundled_name_never_reaches_the_package() -> None:
    with pytest.raises(ValueError, match="not bundled"):
        dc_catalogue.bundled_config("someone/not-a-bundled-model")


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_ideal_line_is_a_floor_under_the_measured_one(tp: int, batch: int) -> None:
    layout = P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=tp)
    assert P.ideal_decode_step(layout, batch, 2048).seconds < P.decode_step_seconds(
        layout, batch, 2048)


def test_models_and_systems_cover_the_range() -> None:
    models, systems = P.models(), P.systems()
    assert {"llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"} <= set(models)
    assert models["llama-3.1-70b"].profile.params == hardware.MODELS["llama-3-70b"].params
    assert {"h100_sxm", "b200_sxm", "gb200", "l40s"} <= set(systems)
    h100 = systems["h100_sxm"]
    assert (h100.memory_bytes / 2**30, h100.bandwidth_gbs, h100.power_w) == (80, 3350, 700)
    assert math.isclose(h100.bf16_tflops, 989)


def test_bad_layouts_name_the_field() -> None:
    for kwargs, field in [({"tp": 3}, "tp"), ({"pp": 8}, "pp"), ({"dtype": "int4"}, "dtype"),
                          ({"backend": "tgi"}, "backend"), ({"link": "wifi"}, "link")]:
        with pytest.raises(ValueError, match=field):
            P.Layout("llama-3.1-8b", "h100_sxm", **kwargs)
    with pytest.raises(ValueError, match="model: unknown"):
        P.Layout("gpt-5", "h100_sxm")
    with pytest.raises(ValueError, match="system: unknown"):
        P.Layout("llama-3.1-8b", "tpu_v5")
    with pytest.raises(ValueError, match="batch"):
        P.decode_step_seconds(L70, 0, 10)


@pytest.mark.exhaustive
@pytest.mark.parametrize("system", list(P.systems()))
def test_every_engine_and_dtype_answers_or_says_why(system: str) -> None:
    """No combination the page offers reaches the package's own errors: either it answers,
    or `check` gives a one-line reason (fp8 without fp8 tensor cores, an op the package
    has no measured data for)."""
    for backend in P.BACKENDS:
        for dtype in P.DTYPES:
            layout = P.Layout("llama-3.1-8b", system, backend, tp=2, dtype=dtype)
            verdict = P.check(layout, 2048, 1)
            if not verdict.ok:
                assert verdict.reason and "\n" not in verdict.reason
                continue
            assert P.decode_step(layout, 16, 2048).seconds > 0
            assert P.prefill(layout, 2048).seconds > 0
            assert P.decode_step_seconds(layout, 300, 4000) > 0
