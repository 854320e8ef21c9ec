"""The local-PC side: batch 1, FIFO queue, contiguous KV reservation, emulated pacing."""

from __future__ import annotations

import time

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.local import LocalPC
from measure import hardware

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at"]


def test_greedy_outputs_equal_the_engine(loaded, local):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ours = local.generate(PROMPTS, params)
    with Engine(EngineConfig(device="cpu", dtype="float32"), loaded=loaded) as engine:
        theirs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert all(o.emulated is None for o in ours)


def test_users_queue_one_after_another(local):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    handles = [local.submit(p, params) for p in PROMPTS]
    reserved = []
    while not handles[-1].done:
        time.sleep(0.01)
        s = local.stats()
        if s.running_ids:
            reserved.append((s.kv_reserved_bytes, s.kv_used_bytes, s.num_waiting))
    outs = [h.result(timeout=120) for h in handles]
    for k in range(1, len(outs)):
        # everyone arrived together: user k waits out the service of every user before it
        served = sum(o.metrics.e2e - o.metrics.queue_time for o in outs[:k])
        assert outs[k].metrics.ttft >= served
        assert outs[k].metrics.ttft >= outs[k - 1].metrics.e2e
        # served strictly after the previous user finished
        assert outs[k].metrics.first_scheduled_time >= outs[k - 1].metrics.token_times[-1]
    per_request = local.n_ctx * local.kv_bytes_per_token
    assert reserved and all(r == per_request for r, _, _ in reserved)
    assert all(0 <= used <= r for r, used, _ in reserved)
    assert local.stats().kv_reserved_bytes == 0  # nothing active, nothing reserved


def test_emulated_device_releases_no_token_before_the_projection(loaded):
    # a 70B model at int4 on a desktop CPU projects ~2.5 tokens/s: far slower than this
    # machine, so the release schedule, not the compute, sets the pace (the schedule's own
    # arithmetic is tests/engine/test_pacing.py); a slow or busy machine only adds to the
    # gaps, so the bound holds on any machine
    pacing = hardware.Emulation("desktop_cpu", "llama-2-70b", "int4")
    with LocalPC(loaded, n_ctx=256, pacing=pacing) as paced:
        out = paced.generate(["Tell me about the sea."],
                             SamplingParams(max_tokens=8, ignore_eos=True))[0]
    m, prompt = out.metrics, len(out.prompt_token_ids)
    assert m.token_times[0] - m.first_scheduled_time >= pacing.prefill_seconds(prompt)
    for k in range(1, len(m.token_times)):
        # output token k is decoded at context prompt + k
        assert m.token_times[k] - m.token_times[k - 1] >= pacing.decode_seconds(prompt + k)
    assert len(out.token_ids) == 8
    assert out.emulated and "70B" in out.emulated and "projected" in out.emulated


def test_cancel_while_queued_and_while_running(local):
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    first = local.submit("Keep going", params)
    second = local.submit("Never served", params)
    second.cancel()
    next(iter(first))
    first.cancel()
    assert first.result(timeout=60).finish_reason == "cancelled"
    assert second.result(timeout=60).finish_reason == "cancelled"
    assert second.result().token_ids == []


@pytest.mark.parametrize("kwargs", [dict(n_ctx=1), dict(n_ctx=-5)])
def test_bad_settings_name_the_field(loaded, kwargs):
    with pytest.raises(ValueError, match="n_ctx"):
        LocalPC(loaded, **kwargs)


@pytest.mark.parametrize("args,field", [
    (("toaster", "llama-2-7b"), "hardware"),
    (("rtx4090", "gpt-9"), "model"),
    (("rtx4090", "llama-2-7b", "fp3"), "precision"),
])
def test_bad_emulation_names_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        hardware.Emulation(*args)


def test_prompt_longer_than_n_ctx_is_rejected(local):
    with pytest.raises(ValueError, match="n_ctx"):
        local.submit("word " * 600, SamplingParams(max_tokens=4))


def test_shutdown_frees_the_contiguous_reservation_and_keeps_the_stats(loaded):
    import gc
    import weakref

    local = LocalPC(loaded, n_ctx=128)
    out = local.generate(["Water boils at"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    kv = weakref.ref(local.runner.kv_caches[0][0])
    local.shutdown()  # a race over, its panel still on screen, holding `local`
    gc.collect()
    assert kv() is None  # the n_ctx buffer went back, though `local` is still referenced
    assert local.stats().kv_reserved_bytes == 0 and len(out.token_ids) == 4


def test_n_candidates_reserve_n_contiguous_windows_each_holding_the_prompt(loaded):
    prompt = loaded.encode("The capital of France is")
    with LocalPC(loaded, n_ctx=64) as local:
        h = local.submit(prompt, SamplingParams(max_tokens=6, ignore_eos=True, n=8))
        seen = []
        while not h.done:
            s = local.stats()
            if s.running_ids:
                seen.append((s.kv_reserved_bytes, s.kv_used_bytes))
            time.sleep(0.002)
        out = h.result(timeout=120)
        per_token = local.kv_bytes_per_token
        assert local.runner.num_blocks == 8 * 64 // 16  # eight n_ctx slots of 16-token blocks
        assert local.runner.kv_caches[0][0].shape[1] == local.runner.num_blocks + 1
        assert seen and all(r == 8 * 64 * per_token for r, _ in seen)
        # each candidate processes the prompt again into its own slot, and keeps it
        most = max(u for _, u in seen) // per_token
        assert most > 7 * len(prompt)
        assert local.stats().kv_reserved_bytes == 0
        single = local.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        assert local.runner.num_blocks == 64 // 16  # back to one slot
    assert [c.token_ids for c in out.candidates] == [single.token_ids] * 8
