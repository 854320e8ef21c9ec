"""API vs in-process: the same requests through the OpenAI-compatible API and straight into
the engine, with the same engine settings.

    batchlens bench api [--quick] [--requests N] [--repeat N] [--json PATH]

First the in-process run (every request submitted at once to an `Engine` in this process),
then `batchlens serve` in a child process with the same settings, and N concurrent
streaming clients (`measure.bench.serve.run_load`: httpx, one asyncio loop in this
process) sending the same prompts as token ids to /v1/completions. Client-side figures
are measured as `vllm bench serve` measures them: TTFT to the first content chunk, E2E to
the last, TPOT = (E2E - TTFT) / (tokens - 1) with tokens from the stream's usage chunk.
Both sides share the machine's cores with their clients, as a real deployment's clients
would not. `--repeat N` runs N such pairs (a fresh server each, so no run finds the last
one's prompts in its prefix cache) and reports each pair's ratio and their median: on a
small shared machine one pair's ratio moves by 10% or more with what else runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from engine import Engine, EngineConfig, LoadedModel, SamplingParams, summarize
from measure.bench.report import format_table
from measure.bench.requests import (
    BenchRequest,
    make_requests,
    mix_lengths,
    tokenize_corpus,
)
from measure.bench.runs import RunResult
from measure.bench.serve import from_bench, run_load
from server.child import child_server, free_port, health_url, serve_command

PROG = "batchlens bench api"
HEALTH_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0


def run_in_process(loaded: LoadedModel, reqs: list[BenchRequest], config: EngineConfig,
                   ) -> RunResult:
    """Every request submitted at once to an engine in this process."""
    with Engine(config, loaded=loaded) as eng:
        eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
        t0 = time.monotonic()
        outs = eng.generate([list(r.prompt_ids) for r in reqs], params)
        end = time.monotonic()
    return RunResult("in_process", summarize([o.metrics for o in outs], wall_time=end - t0))


def serve_flags(config: EngineConfig, dtype: str) -> list[str]:
    """`batchlens serve` flags for the same engine settings."""
    return ["--dtype", dtype, "--max-num-seqs", str(config.max_num_seqs),
            "--max-num-batched-tokens", str(config.max_num_batched_tokens),
            "--block-size", str(config.block_size)]


def run_api(reqs: list[BenchRequest], config: EngineConfig, dtype: str, model: str,
            log: Path) -> RunResult:
    """The same requests from concurrent streaming clients over the API."""
    port = free_port()
    with child_server(serve_command(port, *serve_flags(config, dtype)), health_url(port),
                      log=log, timeout=HEALTH_TIMEOUT_S):
        cpu0 = time.process_time()
        load = run_load(f"http://127.0.0.1:{port}", model, from_bench(reqs),
                        ignore_eos=True, timeout=REQUEST_TIMEOUT_S)
        cpu = time.process_time() - cpu0
        print(f"clients: {cpu:.2f} s of CPU in {load.duration:.1f} s "
              f"({cpu / load.duration:.0%} of a core)", file=sys.stderr, flush=True)
    if failed := [r.error for r in load.results if not r.ok]:
        raise RuntimeError(f"{len(failed)} of {len(reqs)} requests failed: {failed[0]}")
    return RunResult("api", summarize([r.metrics() for r in load.results],
                                      wall_time=load.duration))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run both and print the table and the API's share of in-process throughput."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 short requests")
    ap.add_argument("--requests", type=int, help="number of requests (default 64, quick 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="in-process/API pairs to run; the median ratio is reported "
                    "(default: 1)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--log", default="/tmp/batchlens-bench-api-server.log",
                    help="where the child server's output goes")
    a = ap.parse_args(argv)
    n = (16 if a.quick else 64) if a.requests is None else a.requests
    if n < 1 or a.repeat < 1:
        ap.error("--requests and --repeat must be >= 1")
    prompt_len, max_tok = mix_lengths(a.quick)
    print("loading model ...", file=sys.stderr, flush=True)
    loaded = LoadedModel.load(None)
    reqs = make_requests(tokenize_corpus(loaded.tokenizer), n, a.seed, prompt_len, max_tok)
    config = EngineConfig(max_num_seqs=n)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    print(f"{n} requests (seed {a.seed}), {sum(r.max_tokens for r in reqs)} output tokens, "
          f"greedy, EOS ignored; {loaded.name}, {dtype}; max_num_seqs {n}, block size "
          f"{config.block_size}, token budget {config.max_num_batched_tokens}")
    pairs, ratios = [], []
    for i in range(a.repeat):
        tag = f" ({i + 1}/{a.repeat})" if a.repeat > 1 else ""
        print(f"run in_process{tag} ...", file=sys.stderr, flush=True)
        results = [run_in_process(loaded, reqs, config)]
        print(f"run api{tag} ...", file=sys.stderr, flush=True)
        results.append(run_api(reqs, config, dtype, loaded.name, Path(a.log)))
        inproc, api = (r.summary for r in results)
        ratios.append(api.throughput / inproc.throughput)
        pairs.append(results)
        print("\n" + format_table(results, others=False,
                                   note="api: measured by the clients, over HTTP"))
        print(f"API throughput / in-process = {ratios[-1]:.1%}")
    ratio = statistics.median(ratios)
    if a.repeat > 1:
        print(f"median over {a.repeat} pairs: {ratio:.1%} "
              f"({', '.join(f'{r:.1%}' for r in ratios)})")
    if a.json:
        doc = {"requests": n, "seed": a.seed, "dtype": dtype, "model": loaded.name,
               "runs": {r.name: r.summary.as_dict() for r in pairs[-1]}, "api_share": ratio,
               "api_shares": ratios,
               "pairs": [{r.name: r.summary.as_dict() for r in p} for p in pairs]}
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0
