"""`batchlens bench parallel`: the flags, the separate requests' params, the table and the
JSON from made-up figures; and one tiny run on the bundled model."""

from __future__ import annotations

import json

import pytest

from engine.config import SamplingParams
from measure.bench import parallel
from measure.bench.parallel import ParallelRun
from measure.bench.requests import BenchRequest


def run(side: str, mode: str, prompt_tok: int, blocks: int, wall: float,
        answers: list[list[int]]) -> ParallelRun:
    return ParallelRun(side, mode, prompts=2, candidates=2, prompt_tokens_computed=prompt_tok,
                       cached_prompt_tokens=0, peak_kv_blocks=blocks,
                       output_tokens=sum(map(len, answers)), wall_s=wall, answers=answers)


RUNS = [run("engine", "n=2", 40, 6, 1.0, [[1, 2], [3, 4], [5, 6], [7, 8]]),
        run("engine", "2 x n=1", 76, 9, 2.0, [[1, 2], [3, 4], [5, 6], [7, 9]]),
        run("local", "n=2", 76, 128, 4.0, [[1, 2], [3, 4], [5, 6], [7, 8]]),
        run("local", "2 x n=1", 76, 128, 4.0, [[1, 2], [3, 4], [5, 6], [7, 8]])]


def test_flags_resolve_and_are_checked():
    a = parallel.parse_args([])
    assert (a.n, a.prompts, a.sides) == (4, 16, ["engine", "local"])
    assert a.prompt_len == (10, 300) and a.max_tok == (16, 256)
    q = parallel.parse_args(["--quick", "--n", "2", "--sides", "engine"])
    assert (q.n, q.prompts, q.sides, q.max_tok) == (2, 8, ["engine"], (8, 48))
    for bad in (["--n", "1"], ["--requests", "0"], ["--sides", "gpu"]):
        with pytest.raises(SystemExit):
            parallel.parse_args(bad)


def test_separate_requests_are_the_candidates_one_by_one():
    reqs = [BenchRequest((1, 2, 3), 5), BenchRequest((4, 5), 7)]
    params = parallel.parallel_params(reqs, 3, seed=10)
    assert [(p.n, p.seed, p.max_tokens) for p in params] == [(3, 10, 5), (3, 13, 7)]
    assert all(p.ignore_eos and p.temperature == parallel.TEMPERATURE for p in params)
    prompts, single = parallel.separate([[1, 2, 3], [4, 5]], params)
    assert prompts == [[1, 2, 3]] * 3 + [[4, 5]] * 3
    assert [(p.n, p.seed) for p in single] == [(1, s) for s in range(10, 16)]
    assert all(isinstance(p, SamplingParams) and p.max_tokens == 5 for p in single[:3])


def test_table_shows_each_run_and_what_n_saves():
    text = parallel.table(RUNS)
    lines = text.splitlines()
    assert lines[0].split() == ["side", "requests", "prompt", "tok", "cached", "peak", "KV",
                                "blk", "out", "tok", "tok/s", "wall", "s", "others"]
    assert lines[2].split() == ["engine", "2", "x", "n=2", "40", "0", "6", "8", "8.0", "1.0",
                                "0%"]
    assert lines[3].split()[:7] == ["engine", "2", "x", "2", "x", "n=1", "76"]
    assert ("engine: separate requests compute 1.90x the prompt tokens, hold 1.50x the peak "
            "KV blocks, run at 0.50x the tokens/s; 3 of 4 candidates equal in both modes"
            ) in text
    assert ("local: separate requests compute 1.00x the prompt tokens, hold 1.00x the peak "
            "KV blocks, run at 1.00x the tokens/s; 4 of 4 candidates equal") in text


def test_a_side_with_one_mode_run_has_no_summary():
    assert parallel.summary_lines(RUNS[:1], "engine") == []
    assert parallel.ratio(RUNS[:1], "engine", "peak_kv_blocks") is None


def test_json_has_every_run_and_the_ratios(tmp_path):
    path = tmp_path / "p.json"
    parallel.save(str(path), {"n": 2}, RUNS)
    doc = json.loads(path.read_text())
    assert doc["n"] == 2 and len(doc["runs"]) == 4 and "answers" not in doc["runs"][0]
    assert doc["runs"][0]["output_tokens_per_s"] == 8.0
    assert doc["separate_over_n"]["engine"]["prompt_tokens_computed"] == 1.9
    assert doc["same_answers"] == {"engine": [3, 4], "local": [4, 4]}


@pytest.mark.model
def test_n_candidates_compute_the_prompt_once_and_hold_fewer_blocks(loaded):
    reqs = [BenchRequest(tuple(range(100, 140)), 8), BenchRequest(tuple(range(200, 237)), 8)]
    runs = parallel.run_bench(loaded, reqs, n=2, seed=3, sides=["engine", "local"])
    eng_n, eng_sep, local_n, local_sep = runs
    assert eng_n.prompt_tokens_computed == 40 + 37  # each prompt's tokens once
    assert eng_sep.prompt_tokens_computed > eng_n.prompt_tokens_computed
    assert eng_n.peak_kv_blocks <= eng_sep.peak_kv_blocks
    # the local PC processes every candidate's prompt again, in both modes, each into an
    # n_ctx slot of its own: a request of 2 candidates reserves 2 slots
    assert local_n.prompt_tokens_computed == local_sep.prompt_tokens_computed == 2 * (40 + 37)
    assert local_n.peak_kv_blocks == 2 * local_sep.peak_kv_blocks
    assert all(r.output_tokens == 2 * 2 * 8 for r in runs)
