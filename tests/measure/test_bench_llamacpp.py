"""measure.bench.llamacpp without llama.cpp: parsing the tools' real output (captured from
`llama-bench -o json` and `llama-batched-bench --output-format jsonl` on the bundled
model's bf16 GGUF, kept under fixtures/), finding the build, and the side-by-side table.
The real run is tests/compat/test_llamacpp_bench.py (`make compat`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from measure.bench import cli, llamacpp

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA_BENCH_JSON = FIXTURES / "llama_bench_pp512_tg128.json"  # -p 512 -n 128 -t 2 -r 2
BATCHED_JSONL = FIXTURES / "llama_batched_bench_npl1_64.jsonl"  # -npp 128 -ntg 128 -npl 1,64


def test_llama_bench_output_gives_pp512_and_tg128_with_their_samples():
    raw = json.loads(LLAMA_BENCH_JSON.read_text())
    figures = llamacpp.parse_llama_bench(LLAMA_BENCH_JSON.read_text())
    assert [f.test for f in figures] == ["pp512", "tg128"]
    for f, row in zip(figures, raw, strict=True):
        assert len(f.samples) == 2 and f.threads == 2
        # the mean llama-bench prints is the mean of its runs' rates: the right fields read
        assert f.tokens_per_s == pytest.approx(sum(f.samples) / len(f.samples), rel=1e-4)
        # and each run's rate is its tokens over its time
        tokens = row["n_prompt"] + row["n_gen"]
        assert f.samples == pytest.approx([tokens / (ns / 1e9) for ns in row["samples_ns"]],
                                          rel=1e-4)


def test_llama_bench_names_a_combined_test():
    row = json.loads(LLAMA_BENCH_JSON.read_text())[0] | {"n_prompt": 16, "n_gen": 4}
    assert llamacpp.parse_llama_bench(json.dumps([row]))[0].test == "pp16+tg4"


def test_batched_bench_output_gives_one_figure_per_parallel_count():
    lines = BATCHED_JSONL.read_text()
    figures = llamacpp.parse_batched_bench("llama_model_loader: a log line\n" + lines)
    assert [(f.pp, f.tg, f.pl) for f in figures] == [(128, 128, 1), (128, 128, 64)]
    rows = [json.loads(line) for line in lines.splitlines() if line.strip()]
    for f, raw in zip(figures, rows, strict=True):
        # decode rate = all sequences' decode tokens over the decode time (not the total)
        assert f.decode_tokens_per_s == pytest.approx(f.pl * f.tg / raw["t_tg"], rel=1e-4)
        assert f.prompt_tokens_per_s == pytest.approx(f.pl * f.pp / raw["t_pp"], rel=1e-4)
        assert f.threads == 1


def test_batched_bench_without_a_result_line_says_what_it_printed():
    with pytest.raises(ValueError, match="no result line: main: error"):
        llamacpp.parse_batched_bench("main: error: failed to load model\n")


def test_missing_tools_say_run_make_compat(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLENS_LLAMA_CACHE", str(tmp_path))
    with pytest.raises(llamacpp.LlamaCppMissing, match="run `make compat` first"):
        llamacpp.find_tools()


def fake_build(tmp_path: Path) -> Path:
    """Empty files where the build script leaves the tools (find only checks they exist)."""
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in llamacpp.TOOLS:
        (bin_dir / tool).write_text("")
    return bin_dir


def test_a_missing_gguf_names_the_conversion_command(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLENS_LLAMA_CACHE", str(tmp_path))
    fake_build(tmp_path)
    folder = tmp_path / "models" / "SmolLM2-abc"
    with pytest.raises(llamacpp.LlamaCppMissing,
                       match=f"build_llama_server.sh --convert {folder} bf16"):
        llamacpp.find(folder, "bfloat16")
    gguf = tmp_path / "gguf" / "SmolLM2-abc.bf16.gguf"
    gguf.parent.mkdir()
    gguf.write_text("")
    assert llamacpp.find(folder, "bfloat16").gguf == gguf
    with pytest.raises(ValueError, match="dtype 'int8'"):
        llamacpp.find(folder, "int8")


def test_bench_llamacpp_without_a_build_stops_before_loading_the_model(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv("BATCHLENS_LLAMA_CACHE", str(tmp_path))
    monkeypatch.setattr(cli.LoadedModel, "load", lambda *a: pytest.fail("model loaded"))
    assert cli.main(["--llamacpp", "--only", "engine"]) == 2
    assert "run `make compat` first" in capsys.readouterr().err


def test_comparison_sets_each_llama_figure_beside_the_engines():
    bench = llamacpp.parse_llama_bench(LLAMA_BENCH_JSON.read_text())
    batched = llamacpp.parse_batched_bench(BATCHED_JSONL.read_text())
    runs = {
        "engine@1": {"summary": {"throughput": 100.0},
                     "time": {"decode_tokens": 900, "decode_s": 5.0,
                              "prefill_tokens": 3000, "prefill_s": 2.0}},
        "engine@64": {"summary": {"throughput": 700.0},
                      "time": {"decode_tokens": 8000, "decode_s": 10.0}},
        "hf_static": {"summary": {"throughput": 50.0}},
    }
    engine = llamacpp.engine_figures(runs)
    assert engine == {"engine@1 decode": 180.0, "engine@1 prompt": 1500.0,
                      "engine@1 end to end": 100.0, "engine@64 decode": 800.0,
                      "engine@64 end to end": 700.0}
    text = llamacpp.comparison(bench, batched, engine, Path("m.bf16.gguf"))
    tg = next(line for line in text.splitlines() if line.startswith("llama-bench tg128"))
    assert "engine@1 decode" in tg and f"{180.0 / bench[1].tokens_per_s:.2f}x" in tg
    row64 = next(line for line in text.splitlines() if "64 seqs" in line)
    assert f"{800.0 / batched[1].decode_tokens_per_s:.2f}x" in row64
    assert "m.bf16.gguf, 1/2 threads" in text  # the fixtures ran on 2 and 1 threads


def test_a_run_the_engine_did_not_make_shows_na():
    batched = llamacpp.parse_batched_bench(BATCHED_JSONL.read_text())
    text = llamacpp.comparison([], batched, {}, Path("m.gguf"))
    assert all("n/a" in line for line in text.splitlines() if "seqs decode" in line)


def test_llama_bench_before_and_after_the_runs_is_one_figure_of_both():
    """`bracketed`: each test's samples from before the engine's runs, then after, their
    mean the figure; the report says how many ran on each side."""
    after = llamacpp.parse_llama_bench(LLAMA_BENCH_JSON.read_text())
    before = [llamacpp.BenchFigure(f.test, 2 * f.tokens_per_s, [2 * s for s in f.samples],
                                   f.threads) for f in after if f.test == "tg128"]
    both = llamacpp.bracketed(before, after)
    by_test = {f.test: f for f in both}
    tg, old = by_test["tg128"], next(f for f in after if f.test == "tg128")
    assert tg.samples == [*before[0].samples, *old.samples] and tg.before == len(old.samples)
    assert tg.tokens_per_s == pytest.approx(sum(tg.samples) / len(tg.samples))
    assert tg.tokens_per_s == pytest.approx(1.5 * old.tokens_per_s, rel=0.05)
    pp = by_test["pp512"]  # nothing of it before: as it was
    assert pp.before == 0 and pp.samples == next(f for f in after if f.test == "pp512").samples
    engine = {"engine@1 decode": 100.0}
    text = llamacpp.comparison(both, [], engine, Path("m.gguf"))
    n = len(old.samples)
    assert f"(tg128 over {2 * n} runs, {n} before the engine's runs and {n} after: " in text
    row = next(line for line in text.splitlines() if line.startswith("llama-bench tg128"))
    assert f"{100.0 / tg.tokens_per_s:.2f}x" in row
    saved = [llamacpp.BenchFigure(**json.loads(json.dumps(dataclasses.asdict(f))))
             for f in both]  # as the bench's JSON keeps them
    assert saved == both
