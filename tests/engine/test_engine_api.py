"""The engine's public surface on the real model: submit, stream, cancel, stats, errors."""

from __future__ import annotations

import threading

import pytest

from engine import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.model


def test_chat_prompt_streams_text_and_finishes(engine):
    h = engine.submit([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=24))
    deltas = list(h)
    out = h.result(timeout=60)
    assert "".join(deltas) == out.text
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")
    m = out.metrics
    assert m.ttft is not None and 0 < m.ttft <= m.e2e
    assert len(m.token_times) == len(out.token_ids)
    if len(out.token_ids) > 1:
        assert m.tpot == pytest.approx((m.e2e - m.ttft) / (len(out.token_ids) - 1))


def test_cancel_frees_blocks_and_engine_keeps_serving(engine):
    h = engine.submit("Tell me a very long story about dragons.",
                      SamplingParams(max_tokens=200, ignore_eos=True))
    it = iter(h)
    next(it)
    h.cancel()
    out = h.result(timeout=60)
    assert out.finish_reason == "cancelled"
    assert len(out.token_ids) < 200
    ok = engine.generate(["Hello"], SamplingParams(max_tokens=4))[0]
    assert ok.finish_reason in ("stop", "length")
    assert engine.stats().kv.used_blocks == 0


def test_stop_string_truncates_text(engine):
    out = engine.generate(["1, 2, 3, 4, 5, 6,"],
                          SamplingParams(max_tokens=30, stop=[" 9"], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert " 9" not in out.text
    assert out.text.strip().startswith("7")


def test_stop_token_ids_and_max_tokens(engine):
    first = engine.generate(["The capital of France is"], SamplingParams(max_tokens=3))[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 3
    stop_on = first.token_ids[1]
    out = engine.generate(["The capital of France is"],
                          SamplingParams(max_tokens=10, stop_token_ids=[stop_on]))[0]
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[:2]


def test_same_seed_same_output_regardless_of_batch(engine):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                       ignore_eos=True)
    alone = engine.generate(["Write a poem about the sea."], p)[0]
    others = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    batch = engine.generate(["Write a poem about the sea.", "Hi there"], [p, others])
    assert batch[0].token_ids == alone.token_ids
    different = engine.generate(["Write a poem about the sea."],
                                SamplingParams(max_tokens=16, temperature=0.9, seed=99,
                                               ignore_eos=True))[0]
    assert different.token_ids != alone.token_ids


def test_many_threads_submit_and_stream_at_once(engine):
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        h = engine.submit(f"Count to {i}:", SamplingParams(max_tokens=8, ignore_eos=True))
        results[i] = "".join(h)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(6))
    assert all(results[i] for i in range(6))
    assert engine.stats().kv.used_blocks == 0


@pytest.mark.parametrize("prompt,params,field", [
    ("", SamplingParams(), "prompt"),
    ("   ", SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ("word " * 1200, SamplingParams(), "prompt"),  # longer than the 64 x 16 token pool
    ("Hi", SamplingParams(max_tokens=5000), "max_tokens"),
])
def test_bad_input_is_a_value_error_naming_the_field(engine, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        engine.submit(prompt, params)


def test_error_in_a_step_fails_only_that_step(engine, monkeypatch):
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(entries, tables, gens):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(entries, tables, gens)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    bad = engine.generate(["This step fails"], SamplingParams(max_tokens=4))[0]
    assert bad.finish_reason == "error" and "injected fault" in bad.error
    good = engine.generate(["This one works"], SamplingParams(max_tokens=4))[0]
    assert good.finish_reason in ("stop", "length") and good.token_ids
    assert engine.stats().kv.used_blocks == 0


def test_stats_snapshot(engine):
    engine.generate(["a b c d e f g"], SamplingParams(max_tokens=5, ignore_eos=True))
    s = engine.stats()
    assert s.model == "SmolLM2-135M-Instruct"
    assert s.dtype == "float32" and s.device == "cpu"
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.num_steps > 0 and s.recent_steps
    step = s.recent_steps[-1]
    assert step.num_seqs >= 1 and step.duration > 0
    assert s.kv.free_blocks + s.kv.used_blocks + s.kv.cached_blocks == s.kv.num_blocks
    # pollers ask only for the steps they have not seen
    cut = s.recent_steps[-3].start
    assert engine.stats(steps_after=cut).recent_steps == s.recent_steps[-2:]
    assert engine.stats(steps_after=None).recent_steps == ()


def test_too_small_pool_is_rejected(loaded):
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Engine(EngineConfig(device="cpu", num_kv_blocks=1, block_size=1), loaded=loaded)


def test_shutdown_cancels_unfinished(loaded):
    e = Engine(EngineConfig(device="cpu", num_kv_blocks=64), loaded=loaded)
    h = e.submit("Go on forever", SamplingParams(max_tokens=500, ignore_eos=True))
    e.shutdown()
    assert h.result(timeout=30).finish_reason == "cancelled"
    with pytest.raises(RuntimeError):
        e.submit("after shutdown")


def test_n_candidates_stream_on_their_own_handles_and_cancel_together(engine):
    h = engine.submit("Tell me a story.", SamplingParams(max_tokens=6, n=3, temperature=1.0,
                                                         seed=3, ignore_eos=True))
    assert h.candidate(0) is not h and len(h.candidates) == 3
    texts = ["".join(h.candidate(i)) for i in range(3)]
    out = h.result(timeout=60)
    assert texts == [c.text for c in out.candidates] and out.text == texts[0]
    assert [c.request_id for c in out.candidates] == [f"{h.request_id}#{i}" for i in range(3)]
    long = engine.submit("Tell me a very long story about dragons.",
                         SamplingParams(max_tokens=200, n=4, ignore_eos=True))
    next(iter(long.candidate(2)))
    long.candidate(2).cancel()  # one handle cancels the whole request
    out = long.result(timeout=60)
    assert [c.finish_reason for c in out.candidates] == ["cancelled"] * 4
    assert all(c.done for c in long.candidates)
    assert engine.stats().kv.used_blocks == 0
    one = engine.submit("Hello", SamplingParams(max_tokens=2))
    assert one.candidate(0) is one and one.result(timeout=60).candidates == []


def test_n_past_max_num_seqs_is_refused_naming_n(loaded):
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32, max_num_seqs=2)
    with (Engine(config, loaded=loaded) as small,
          pytest.raises(ValueError, match=r"^n: 3 candidates exceed max_num_seqs of 2")):
        small.submit("Hi", SamplingParams(n=3))
