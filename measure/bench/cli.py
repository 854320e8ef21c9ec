"""Benchmark: this engine against transformers on the same requests, in one run.

`python -m measure.bench [--quick] [--only engine,hf_static] [--json PATH]` prints output
tokens/s and TTFT/TPOT p50/p99 per run, then the ratios; `--host-overhead` instead times
the engine loop around a stand-in model (`measure.bench.host`). Every request of a run
arrives at the run's start (all submitted at once), greedy, EOS ignored; all latency figures
come from `engine.metrics.summarize` over `RequestMetrics` built from `time.monotonic()` stamps.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from engine.models import native
from engine.models.loaded import LoadedModel
from measure.bench import llamacpp
from measure.bench.report import device_of, report, report_saved, roofline_floor, save_json
from measure.bench.requests import (
    make_requests,
    mix_lengths,
    tokenize_corpus,
)
from measure.bench.runs import RUNS, BenchContext, RunResult
from measure.calibrate import best_of, calibrate
from workloads.cpu_load import cpu_sample, others_busy

PROG = "python -m measure.bench"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The bench's flags, unresolved (`parse_args` resolves them)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 short requests, concurrency 1,8,16")
    ap.add_argument("--requests", type=int, help="number of requests (default 64, quick 16)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(RUNS)}, run in the "
                    "order given")
    ap.add_argument("--model", help="local HF folder or .gguf (default: the bundled model)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, help="torch.set_num_threads")
    ap.add_argument("--concurrency", help="comma-separated engine concurrencies (default 1,8,32,64;"
                    " quick 1,8,16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--host-overhead", action="store_true",
                    help="host time per engine step with a stand-in model that returns at "
                    "once, at 1,64,256,1024 decoding requests (--concurrency overrides)")
    ap.add_argument("--llamacpp", action="store_true",
                    help="llama.cpp's llama-bench (tg128, pp512; before and after the "
                    "runs, the mean of both) and llama-batched-bench (after them) on the "
                    "same weights and threads, printed beside the engine's figures (built "
                    "by `make compat`)")
    ap.add_argument("--report", metavar="PATH", nargs="+",
                    help="print the table of saved --json files (runs merged) and exit")
    return ap


def parse_args(argv: list[str] | None, prog: str = PROG) -> argparse.Namespace:
    """The command line; `--quick` and `--requests` resolve into n, lengths, concurrency."""
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    a.only = a.only.split(",") if a.only else list(RUNS)
    if unknown := set(a.only) - set(RUNS):
        ap.error(f"--only: unknown runs {sorted(unknown)}; choose from {','.join(RUNS)}")
    a.n = (16 if a.quick else 64) if a.requests is None else a.requests
    if a.n < 1 or (a.threads is not None and a.threads < 1):
        ap.error("--requests and --threads must be >= 1")
    a.prompt_len, a.max_tok = mix_lengths(a.quick)
    default = (1, 8, 16) if a.quick else (1, 8, 32, 64)
    try:
        conc = [int(c) for c in a.concurrency.split(",")] if a.concurrency else default
    except ValueError:
        ap.error(f"--concurrency: expected numbers like 1,8,64, got {a.concurrency!r}")
    if min(conc) < 1:
        ap.error("--concurrency values must be >= 1")
    a.host_sizes = sorted(set(conc))  # --host-overhead: not capped by --requests
    a.conc = sorted({min(c, a.n) for c in conc})
    return a


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Load the model once, run the chosen runs in turn, print and optionally save.
    `api` as the first argument runs the API vs in-process bench instead; `serve` the
    HTTP load generator against a running server; `speculative` (alias `spec`) speculative
    decoding on and off; `parallel` n candidates per request against n separate requests."""
    if argv and argv[0] == "api":
        from measure.bench import api

        return api.main(argv[1:], prog=f"{prog} api")
    if argv and argv[0] == "serve":
        from measure.bench import serve

        return serve.main(argv[1:], prog=f"{prog} serve")
    if argv and argv[0] in ("speculative", "spec"):  # `spec`: the name it had first
        from measure.bench import speculative

        return speculative.main(argv[1:], prog=f"{prog} speculative")
    if argv and argv[0] == "parallel":
        from measure.bench import parallel

        return parallel.main(argv[1:], prog=f"{prog} parallel")
    a = parse_args(argv, prog)
    if a.report:
        print(report_saved(a.report))
        return 0
    if a.host_overhead:
        from measure.bench import host

        sizes = tuple(a.host_sizes) if a.concurrency else host.HOST_SIZES
        return host.main(sizes, a.device, a.dtype, a.json, model=a.model)
    if a.llamacpp:
        try:
            llamacpp.find_tools()
        except llamacpp.LlamaCppMissing as exc:
            print(exc, file=sys.stderr)
            return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print("loading model ...", file=sys.stderr, flush=True)
    loaded = LoadedModel.load(a.model, a.device, a.dtype)
    reqs = make_requests(tokenize_corpus(loaded.tokenizer), a.n, a.seed, a.prompt_len, a.max_tok)
    tools = None
    if a.llamacpp:
        try:
            tools = llamacpp.find(loaded.folder, str(loaded.model.dtype).removeprefix("torch."))
        except (llamacpp.LlamaCppMissing, ValueError) as exc:
            print(exc, file=sys.stderr)
            return 2
    ctx = BenchContext(loaded, reqs, a.conc)
    floor = roofline_floor(loaded, reqs, a.conc[-1])  # calibrates (kept for the process)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    run_info = {"model": loaded.name, "device": str(loaded.model.device), "dtype": dtype,
                "threads": torch.get_num_threads(), "requests": a.n, "seed": a.seed}
    print(f"model {loaded.name} on {loaded.model.device}, dtype {dtype} "
          f"({loaded.dtype_reason}), {torch.get_num_threads()} threads; {native.status(loaded.model.dtype)}")
    print(f"{a.n} requests (seed {a.seed}): prompt {a.prompt_len[0]}-{a.prompt_len[1]} tokens, "
          f"max_tokens {a.max_tok[0]}-{a.max_tok[1]}, greedy, EOS ignored; "
          f"{sum(r.max_tokens for r in reqs)} output tokens per run")
    before = None
    if tools is not None:  # llama-bench on both sides of the runs (measure.bench.llamacpp)
        print("run llama-bench before the runs ...", file=sys.stderr, flush=True)
        before = llamacpp.run_llama_bench(tools, torch.get_num_threads())
    cpu0 = cpu_sample()
    time.sleep(1.0)
    if (busy := others_busy(cpu0, cpu_sample())) > 0.1:
        print(f"warning: other processes used {busy:.0%} of the CPUs just before the runs")
    results: list[RunResult] = []
    for name in a.only:
        print(f"run {name} ...", file=sys.stderr, flush=True)
        t, cpu0 = time.monotonic(), cpu_sample()
        try:
            got = RUNS[name](ctx)
        except Exception as exc:  # one failing run must not lose the others
            traceback.print_exc(file=sys.stderr)
            got = [RunResult(name, na=f"{type(exc).__name__}: {exc}")]
        for r in got:
            r.extra["others_cpu"] = others_busy(cpu0, cpu_sample())
        results += got
        print(f"run {name} done in {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
        if a.json:
            save_json(a.json, run_info, results, floor, complete=name == a.only[-1])
    if floor is not None:  # measured again: a busy moment must not lower the floor
        dev = device_of(loaded)
        readings = [calibrate(device=dev), calibrate(device=dev, fresh=True)]
        floor = roofline_floor(loaded, reqs, a.conc[-1], best_of(*readings), readings)
        if a.json:
            save_json(a.json, run_info, results, floor, complete=True)
    print("\n" + report(results, floor))
    if tools is not None:
        print(compare_llamacpp(tools, reqs, a.conc, results, run_info, floor, a.json, before))
    return 0


def compare_llamacpp(tools: llamacpp.LlamaCpp, reqs: list, conc: list[int],
                     results: list[RunResult], run_info: dict, floor: dict | None,
                     json_path: str | None,
                     before: list[llamacpp.BenchFigure] | None = None) -> str:
    """llama.cpp's figures on this process's thread count, after the runs (so the two never
    share the cores; `llama-bench` also `before` them), as printed; saved with the runs
    under "llamacpp" with `--json`."""
    print("run llama.cpp (llama-bench, llama-batched-bench) ...", file=sys.stderr, flush=True)
    pp = round(sum(len(r.prompt_ids) for r in reqs) / len(reqs))
    tg = round(sum(r.max_tokens for r in reqs) / len(reqs))
    figures = llamacpp.measure(tools, torch.get_num_threads(), sorted({1, conc[-1]}), pp, tg,
                               before)
    if json_path:
        save_json(json_path, run_info | {"llamacpp": figures}, results, floor, complete=True)
    runs = {r.name: {"summary": r.summary.as_dict() if r.summary else None, **r.extra}
            for r in results}
    return "\n" + llamacpp.report(figures, runs)
