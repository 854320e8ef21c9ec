"""measure.bench pieces that need no model: request generation, table, ratios, report."""

import pytest

from engine.engine import StepStats
from engine.metrics import RequestMetrics, summarize
from measure.bench.cli import parse_args
from measure.bench.report import format_table, ratios, report, report_saved, save_json
from measure.bench.requests import make_requests
from measure.bench.runs import RUNS, RunResult, step_breakdown
from workloads.cpu_load import others_busy

CORPUS = list(range(100, 400))


def test_make_requests_is_deterministic_and_in_range():
    a = make_requests(CORPUS, 64, 0, (10, 300), (16, 256))
    assert a == make_requests(CORPUS, 64, 0, (10, 300), (16, 256))
    assert a != make_requests(CORPUS, 64, 1, (10, 300), (16, 256))
    assert len(a) == 64
    assert all(10 <= len(r.prompt_ids) <= 300 and 16 <= r.max_tokens <= 256 for r in a)
    assert all(set(r.prompt_ids) <= set(CORPUS) for r in a)
    # prompts start at different offsets, so they rarely share a prefix
    assert len({r.prompt_ids[:4] for r in a}) > 48


def test_make_requests_wraps_a_short_corpus_and_rejects_an_empty_one():
    reqs = make_requests([5, 6, 7], 3, 0, (10, 10), (1, 1))
    assert all(len(r.prompt_ids) == 10 and set(r.prompt_ids) <= {5, 6, 7} for r in reqs)
    with pytest.raises(ValueError, match="corpus_ids"):
        make_requests([], 1, 0, (1, 2), (1, 2))


def _run(name: str, step: float, n_tokens: int = 5) -> RunResult:
    ms = [RequestMetrics(arrival_time=0.0, token_times=[step * (k + 1) for k in range(n_tokens)])
          for _ in range(4)]
    return RunResult(name, summarize(ms, wall_time=step * n_tokens))


def test_format_table_ratios_and_report():
    results = [
        _run("hf_batch1", 0.1), _run("hf_static", 0.05), _run("engine@1", 0.05),
        _run("engine@8", 0.01), RunResult("hf_continuous", na="no generate_batch"),
    ]
    results[-2].extra = {"kv_waste": 0.125, "steps": 7, "preemptions": 0,
                         "cached_prompt_tokens": 0, "others_cpu": 0.0}
    table = format_table(results)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["run", "tok/s"]
    assert "hf_continuous n/a: no generate_batch" in " ".join(table.split())
    row = next(ln for ln in lines if ln.startswith("engine@8")).split()
    assert row[1] == "400.0"  # 20 tokens / 0.05 s
    assert row[2] == "10"  # TTFT p50 in ms
    rat = ratios(results)
    assert rat == {"engine@8 / hf_static": pytest.approx(5.0),
                   "engine@1 / hf_batch1": pytest.approx(2.0)}
    text = report(results)
    assert "engine@8: reserved-but-unused KV slots 12.5% over 7 steps" in text
    assert "engine@8 / hf_static = 5.00x" in text


def test_parse_args_quick_and_only():
    a = parse_args(["--quick", "--only", "engine,hf_static"])
    assert (a.n, a.prompt_len, a.max_tok, a.conc) == (16, (10, 100), (8, 48), [1, 8, 16])
    assert a.only == ["engine", "hf_static"]
    a = parse_args(["--requests", "4"])
    assert a.n == 4 and a.conc == [1, 4]
    assert parse_args([]).conc == [1, 8, 32, 64]
    assert parse_args(["--concurrency", "64,8,200"]).conc == [8, 64]
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "a"])
    with pytest.raises(SystemExit):
        parse_args(["--only", "nope"])
    with pytest.raises(SystemExit):
        parse_args(["--requests", "0"])
    assert set(RUNS) == {"hf_batch1", "hf_static", "hf_continuous", "engine", "local"}
    # ours first, in a process transformers has not run in; its continuous batching last
    assert list(RUNS)[:2] == ["engine", "local"] and list(RUNS)[-1] == "hf_continuous"
    assert parse_args([]).only == list(RUNS)


def test_others_busy_subtracts_this_process():
    assert others_busy((0.0, 0.0, 0.0), (10.0, 6.0, 4.0)) == pytest.approx(0.2)
    assert others_busy((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)) == 0.0


def _fake_step(num_seqs: int, duration: float, prefill: int = 0) -> StepStats:
    return StepStats(start=0.0, duration=duration, num_seqs=num_seqs,
                     num_prefill_tokens=prefill, num_decode_tokens=num_seqs if not prefill else 0,
                     num_preempted=0, kv_usage=0.0, kv_used_slots=0, kv_reserved_slots=0)


def test_step_breakdown_fits_fixed_plus_per_sequence_cost():
    # fake decode steps costing exactly 20 ms + 1.5 ms per sequence, and one prefill step
    steps = [_fake_step(n, 0.020 + 0.0015 * n) for n in (1, 8, 32, 64)]
    steps.append(_fake_step(4, 0.4, prefill=500))
    t = step_breakdown(steps)
    assert t["prefill_s"] == pytest.approx(0.4) and t["prefill_tokens"] == 500
    assert t["decode_steps"] == 4 and t["decode_tokens"] == 105
    assert t["fixed_ms"] == pytest.approx(20.0) and t["per_seq_ms"] == pytest.approx(1.5)
    r = RunResult("engine@64", extra={"time": t})
    assert "each ~20.0 ms + 1.50 ms per sequence" in report([r])


def test_step_breakdown_without_two_batch_sizes_has_no_fit():
    t = step_breakdown([_fake_step(8, 0.03), _fake_step(8, 0.031)])
    assert "fixed_ms" not in t and t["decode_s"] == pytest.approx(0.061)


def test_report_prints_the_roofline_floor_and_the_share_reached():
    results = [_run("engine@4", 0.01), _run("local@4", 0.04)]  # 400 and 100 tok/s
    floor = {"concurrency": 4, "requests": 4, "bandwidth_gbs": 40.0, "tflops": 0.4,
             "dtype": "bfloat16", "batched_s": 0.025, "sequential_s": 0.1, "output_tokens": 20,
             "ratio": 4.0, "elsewhere": {"H100 SXM 80 GB": 9.5}}
    text = report(results, floor)
    assert "engine@4 >= 0.0 s (800 tok/s), local@4 >= 0.1 s (200 tok/s)" in text
    assert "batching alone can buy 4.0x on this machine" in text
    assert "engine@4 at 50%, local@4 at 50%" in text
    assert "H100 SXM 80 GB 9.5x" in text
    assert "floor" not in report(results)


def test_a_floor_from_two_calibrations_says_what_each_read():
    results = [_run("engine@4", 0.01)]
    floor = {"concurrency": 4, "requests": 4, "bandwidth_gbs": 43.3, "tflops": 0.89,
             "dtype": "bfloat16", "batched_s": 0.025, "sequential_s": 0.1, "output_tokens": 20,
             "ratio": 4.0, "elsewhere": {}, "readings": [[36.4, 0.52], [43.3, 0.89]]}
    assert ("best of 2, before and after the runs, which read 36.4 and 43.3 GB/s and 0.52 "
            "and 0.89 TFLOPS; no overheads") in report(results, floor)
    del floor["readings"]  # a JSON saved before the readings were kept
    floor["measurements"] = 2
    assert "best of 2, before and after the runs; no overheads" in report(results, floor)
    floor["measurements"] = 1
    assert "best of" not in report(results, floor)


def test_saved_json_reprints_the_same_report(tmp_path):
    results = [_run("engine@4", 0.01), RunResult("hf_static", na="skipped")]
    results[0].extra = {"steps": 5, "preemptions": 0, "cached_prompt_tokens": 0,
                        "kv_waste": 0.25, "others_cpu": 0.0}
    info = {"model": "m", "device": "cpu", "dtype": "bfloat16", "threads": 2, "requests": 4,
            "seed": 0}
    path = tmp_path / "bench.json"
    save_json(str(path), info, results, None, complete=True)
    head, _, body = report_saved([str(path)]).partition("\n\n")
    assert head.startswith("model m on cpu, dtype bfloat16, 2 threads; 4 requests (seed 0)")
    assert body == report(results)


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--requests", "0"]])
def test_bench_api_rejects_fewer_than_one_pair_or_request(argv, capsys):
    from measure.bench import api

    with pytest.raises(SystemExit) as exit_:
        api.main(argv)
    assert exit_.value.code == 2
    assert "--requests and --repeat must be >= 1" in capsys.readouterr().err
