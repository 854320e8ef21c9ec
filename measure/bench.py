"""Benchmark: this engine against transformers on the same requests, in one run.

`python -m measure.bench [--quick] [--only engine,hf_static] [--json PATH]` prints output
tokens/s and TTFT/TPOT p50/p99 per run, then the ratios. Every request of a run arrives at
the run's start (all submitted at once), greedy, EOS ignored; all latency figures come from
`engine.metrics.summarize` over `RequestMetrics` built from `time.monotonic()` stamps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from engine import compute
from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine, StepStats
from engine.local import LocalPC
from engine.metrics import RequestMetrics, RunSummary, summarize
from engine.models import native
from engine.models.loaded import LoadedModel, freeze_heap
from measure import hardware
from measure.calibrate import calibrate
from measure.roofline import machine_profile, mix_floor, model_profile_key

TEXT = (
    "The old lighthouse stood at the edge of the cliff for more than a century, guiding ships "
    "through fog and storm. Its keeper climbed the spiral stairs every evening to light the lamp, "
    "and every morning he wrote the weather, the passing ships and the state of the sea in a "
    "thick leather book. When the lamp was finally automated, the book was given to the town "
    "library, where children still read it on rainy afternoons.\n\n"
    "Bread is one of the oldest prepared foods. Flour and water are mixed into a dough, yeast "
    "makes it rise, and heat turns it into a loaf with a crisp crust and a soft crumb. Bakers "
    "adjust the time, the temperature and the amount of water to suit the flour of each season, "
    "and a good baker can tell by touch alone whether the dough is ready for the oven.\n\n"
    "A computer runs a program by fetching instructions from memory, decoding them and executing "
    "them one after another. Modern processors overlap these stages, predict which way branches "
    "will go and keep recently used data in small, fast caches. Much of the speed of a program "
    "therefore depends less on how many operations it performs than on how well it uses memory.\n\n"
    "The river rises in the mountains, gathers the melting snow in spring and winds through "
    "farmland and forests before it reaches the sea. Towns grew up along its banks because it "
    "brought water, fish and trade. Today the old mills are museums, and people walk and cycle "
    "along the towpaths where horses once pulled heavy boats upstream against the current."
)


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: prompt token ids and the exact number of tokens to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class RunResult:
    """One run's figures: a summary, or `na` saying why there is none."""

    name: str
    summary: RunSummary | None = None
    na: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def make_requests(
    corpus_ids: list[int], n: int, seed: int, prompt_len: tuple[int, int],
    max_tokens: tuple[int, int],
) -> list[BenchRequest]:
    """Deterministic requests: prompts are slices of `corpus_ids` (cyclic, from a random
    offset, so prompts rarely share a prefix), lengths uniform in the inclusive ranges."""
    if not corpus_ids:
        raise ValueError("corpus_ids must not be empty")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, off = rng.randint(*prompt_len), rng.randrange(len(corpus_ids))
        ids = [corpus_ids[(off + i) % len(corpus_ids)] for i in range(length)]
        out.append(BenchRequest(tuple(ids), rng.randint(*max_tokens)))
    return out


class _StepClock:
    """A `generate` streamer that stamps each step. The first `put` is the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.monotonic())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@dataclass
class BenchContext:
    """What every run needs: the shared loaded, the requests, the options."""

    loaded: LoadedModel
    requests: list[BenchRequest]
    concurrency: list[int]
    static_batch: int = 32

    @cached_property
    def hf_model(self) -> Any:
        """The transformers reference model, same weights folder, dtype and device."""
        from transformers import AutoModelForCausalLM

        m = self.loaded.model

        def load() -> Any:
            hf = AutoModelForCausalLM.from_pretrained(self.loaded.folder, dtype=m.dtype)
            return hf.to(m.device).eval()

        hf = compute.run(load)
        freeze_heap()  # as LoadedModel.load does: no full-heap GC pauses in any run
        return hf

    @property
    def pad_id(self) -> int:
        tok = self.loaded.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def hf_generate(self, reqs: list[BenchRequest], new_tokens: int) -> list[float]:
        """One left-padded greedy `generate` of exactly `new_tokens`; the step times.

        Runs on the compute thread, where the engine's steps run too (see engine.compute)."""
        return compute.run(self._hf_generate, reqs, new_tokens)

    def _hf_generate(self, reqs: list[BenchRequest], new_tokens: int) -> list[float]:
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        dev = self.loaded.model.device
        clock = _StepClock()
        with torch.inference_mode():
            self.hf_model.generate(
                input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=self.pad_id, streamer=clock,
            )
        return clock.times


def _result(name: str, metrics: list[RequestMetrics], t0: float, end: float) -> RunResult:
    return RunResult(name, summarize(metrics, wall_time=end - t0))


def run_hf_batch1(ctx: BenchContext) -> list[RunResult]:
    """transformers `generate`, one request at a time; all requests arrive at t0."""
    ctx.hf_generate(ctx.requests[:1], 2)  # warm-up
    t0, metrics = time.monotonic(), []
    for r in ctx.requests:
        times = ctx.hf_generate([r], r.max_tokens)
        metrics.append(RequestMetrics(arrival_time=t0, token_times=times))
    return [_result("hf_batch1", metrics, t0, time.monotonic())]


def run_hf_static(ctx: BenchContext) -> list[RunResult]:
    """transformers static batches (left-padded), each run to its longest max_tokens.

    Token times are real per-step times from a streamer: request i's k-th token is stamped
    when step k of its batch ends; only its own max_tokens count as output tokens."""
    ctx.hf_generate(ctx.requests[:2], 2)  # warm-up
    t0, metrics = time.monotonic(), []
    for s in range(0, len(ctx.requests), ctx.static_batch):
        batch = ctx.requests[s:s + ctx.static_batch]
        times = ctx.hf_generate(batch, max(r.max_tokens for r in batch))
        for r in batch:
            metrics.append(RequestMetrics(arrival_time=t0, token_times=times[:r.max_tokens]))
    return [_result("hf_static", metrics, t0, time.monotonic())]


def run_hf_continuous(ctx: BenchContext) -> list[RunResult]:
    """transformers continuous batching. `generate_batch` takes one max_new_tokens for all
    requests, so this drives the manager it wraps (same code path) to give each request its
    own; eos_token_id=-1 ignores EOS. Its token stamps are perf_counter, mapped to monotonic."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model, reqs = ctx.hf_model, ctx.requests
    if not hasattr(model, "generate_batch"):
        return [RunResult("hf_continuous", na="this transformers has no generate_batch")]
    hints = WorkloadHints(max(len(r.prompt_ids) for r in reqs), max(r.max_tokens for r in reqs),
                          len(reqs))
    with model.continuous_batching_context_manager(
            block=True, timeout=5, workload_hints=hints) as mgr:
        t0 = time.monotonic()
        shift = t0 - time.perf_counter()
        rids = [mgr.add_request(list(r.prompt_ids), max_new_tokens=r.max_tokens,
                                record_timestamps=True, eos_token_id=-1) for r in reqs]
        done: dict[str, Any] = {}
        while len(done) < len(rids):
            out = mgr.get_result(timeout=1)
            if out is not None and out.is_finished():
                done[out.request_id] = out
            elif out is None and not mgr.is_running():
                raise RuntimeError(f"manager stopped after {len(done)}/{len(rids)} requests")
        end = time.monotonic()
    bad = [rid for rid, r in zip(rids, reqs, strict=True)
           if done[rid].error or len(done[rid].generated_tokens) != r.max_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed or fell short: {done[bad[0]].error}")
    metrics = [RequestMetrics(arrival_time=t0, token_times=[t + shift for t in done[rid].timestamps])
               for rid in rids]
    return [_result("hf_continuous", metrics, t0, end)]


def run_engine(ctx: BenchContext) -> list[RunResult]:
    """This engine at each concurrency (max_num_seqs), all requests submitted at once."""
    results = []
    for c in ctx.concurrency:
        print(f"  engine@{c} ...", file=sys.stderr, flush=True)
        with Engine(EngineConfig(max_num_seqs=c), loaded=ctx.loaded) as eng:
            eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
            warm_steps = eng.stats().num_steps
            params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in ctx.requests]
            t0 = time.monotonic()
            outs = eng.generate([list(r.prompt_ids) for r in ctx.requests], params)
            end = time.monotonic()
            st = eng.stats()
        short = [o for o, r in zip(outs, ctx.requests, strict=True)
                 if len(o.token_ids) != r.max_tokens]
        if short:
            raise RuntimeError(f"{len(short)} requests ended {short[0].finish_reason}: "
                               f"{short[0].error}")
        res = _result(f"engine@{c}", [o.metrics for o in outs], t0, end)
        steps = [s for s in st.recent_steps if s.start >= t0]
        res.extra = {"steps": st.num_steps - warm_steps, "preemptions": st.num_preemptions,
                     "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs)}
        reserved = sum(s.kv_reserved_slots for s in steps)
        if len(steps) == res.extra["steps"]:
            res.extra["time"] = step_breakdown(steps)
        if len(steps) < res.extra["steps"]:  # recent_steps is a bounded deque
            res.extra["kv_waste"] = f"n/a: only {len(steps)} of {res.extra['steps']} steps kept"
        elif reserved:
            res.extra["kv_waste"] = sum(s.kv_reserved_slots - s.kv_used_slots
                                        for s in steps) / reserved
        results.append(res)
    return results


def step_breakdown(steps: list[StepStats]) -> dict[str, float]:
    """Where an engine run's time went: steps with prompt tokens, and decode-only steps
    with a least-squares fit of their duration, `fixed_ms + per_seq_ms x sequences`."""
    pre = [s for s in steps if s.num_prefill_tokens]
    dec = [s for s in steps if not s.num_prefill_tokens]
    out = {"prefill_s": sum(s.duration for s in pre),
           "prefill_tokens": sum(s.num_prefill_tokens for s in pre),
           "decode_s": sum(s.duration for s in dec),
           "decode_tokens": sum(s.num_decode_tokens for s in dec), "decode_steps": len(dec)}
    if len({s.num_seqs for s in dec}) >= 2:
        n = len(dec)
        mx = sum(s.num_seqs for s in dec) / n
        my = sum(s.duration for s in dec) / n
        sxx = sum((s.num_seqs - mx) ** 2 for s in dec)
        slope = sum((s.num_seqs - mx) * (s.duration - my) for s in dec) / sxx
        out |= {"fixed_ms": 1000 * (my - slope * mx), "per_seq_ms": 1000 * slope}
    return out


def run_local(ctx: BenchContext) -> list[RunResult]:
    """The local PC: one user alone, then every request queued on one PC (sequential)."""
    results = []
    with LocalPC(ctx.loaded, n_ctx=2048) as local:
        local.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        for name, reqs in (("local@1", ctx.requests[:1]),
                           (f"local@{len(ctx.requests)}", ctx.requests)):
            print(f"  {name} ...", file=sys.stderr, flush=True)
            params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
            t0 = time.monotonic()
            outs = local.generate([list(r.prompt_ids) for r in reqs], params)
            results.append(_result(name, [o.metrics for o in outs], t0, time.monotonic()))
    return results


FLOOR_ELSEWHERE = ("h100", "rtx4090")  # reference hardware the floor ratio is also shown for


def roofline_floor(loaded: LoadedModel, reqs: list[BenchRequest],
                   concurrency: int) -> dict[str, Any] | None:
    """The mix's roofline floors (`measure.roofline.mix_floor`) on this machine, measured by
    `measure.calibrate` (about 3 s), and its ratio on reference GPUs; None for a model with
    no profile in engine/hardware.py."""
    key = model_profile_key(loaded.model.spec)
    if key is None:
        return None
    model = loaded.model
    cal = calibrate(device="cuda" if model.device.type == "cuda" else "cpu")
    here = machine_profile(cal, model.dtype)
    lens = [len(r.prompt_ids) for r in reqs], [r.max_tokens for r in reqs]
    floor = mix_floor(*lens, concurrency, key, here)
    return {"concurrency": concurrency, "requests": len(reqs), "bandwidth_gbs": cal.bandwidth_gbs,
            "tflops": here.peak_tflops, "dtype": str(model.dtype).removeprefix("torch."),
            "batched_s": floor.batched_s, "sequential_s": floor.sequential_s,
            "output_tokens": floor.output_tokens, "ratio": floor.ratio,
            "elsewhere": {hardware.get_hardware(k).name: mix_floor(*lens, concurrency, key, k).ratio
                          for k in FLOOR_ELSEWHERE}}


def floor_lines(floor: dict[str, Any], results: list[RunResult]) -> list[str]:
    """The floor as printed, with how close the measured runs came to it."""
    f, tput = floor, {r.name: r.summary.throughput for r in results if r.summary}
    eng, loc = f"engine@{f['concurrency']}", f"local@{f['requests']}"
    best = {eng: f["output_tokens"] / f["batched_s"], loc: f["output_tokens"] / f["sequential_s"]}
    lines = [f"roofline floor of this mix here ({f['bandwidth_gbs']:.1f} GB/s, "
             f"{f['tflops']:.2f} TFLOPS {f['dtype']}, measured by measure.calibrate; no "
             f"overheads, no attention FLOPs): {eng} >= {f['batched_s']:.1f} s "
             f"({best[eng]:.0f} tok/s), {loc} >= {f['sequential_s']:.1f} s ({best[loc]:.0f} "
             f"tok/s): batching alone can buy {f['ratio']:.1f}x on this machine"]
    if got := [f"{n} at {tput[n] / best[n]:.0%}" for n in best if n in tput]:
        lines.append("measured speed as a share of the floor's: " + ", ".join(got))
    lines.append("the same mix's floor ratio elsewhere: "
                 + ", ".join(f"{name} {r:.1f}x" for name, r in f["elsewhere"].items()))
    return lines


# The registry of runs, in run order. transformers' continuous batching runs last: its
# manager computes on a thread of its own, whose OpenMP team outlives it and slows every
# later run in the process (measured: this engine's batch-1 decode step, 26 ms before it,
# 48 ms after it).
RUNS: dict[str, Callable[[BenchContext], list[RunResult]]] = {
    "hf_batch1": run_hf_batch1,
    "hf_static": run_hf_static,
    "engine": run_engine,
    "local": run_local,
    "hf_continuous": run_hf_continuous,
}


def cpu_sample() -> tuple[float, float, float]:
    """(all CPUs' seconds, their busy seconds, this process's CPU seconds); Linux /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0, 0.0, time.process_time()
    hz = os.sysconf("SC_CLK_TCK")
    return sum(v) / hz, (sum(v) - v[3] - v[4]) / hz, time.process_time()


def others_busy(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """Share of all CPU time between two samples used by other processes."""
    total = b[0] - a[0]
    return max(0.0, (b[1] - a[1] - (b[2] - a[2])) / total) if total > 0 else 0.0


def format_table(results: list[RunResult]) -> str:
    """A fixed-width table: tok/s, TTFT and TPOT p50/p99 (ms), others' CPU share per run."""
    head = (f"{'run':<14}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'tokens':>8}{'wall s':>8}{'others':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.summary
        if s is None:
            lines.append(f"{r.name:<14}n/a: {r.na}")
            continue
        ms = [v * 1000 for v in (s.ttft_p50, s.ttft_p99, s.tpot_p50, s.tpot_p99)]
        lines.append(f"{r.name:<14}{s.throughput:>9.1f}" + "".join(f"{v:>10.0f}" for v in ms)
                     + f"{s.output_tokens:>8}{s.wall_time:>8.1f}"
                     + f"{r.extra.get('others_cpu', math.nan):>8.0%}")
    lines.append("(ms; all requests arrive at t=0; others: CPU share other processes used)")
    return "\n".join(lines)


def ratios(results: list[RunResult]) -> dict[str, float]:
    """Throughput ratios: top-concurrency engine vs HF static / continuous; engine@1 vs batch 1."""
    tput = {r.name: r.summary.throughput for r in results if r.summary}
    engines = [n for n in tput if n.startswith("engine@")]
    top = max(engines, key=lambda n: int(n.split("@")[1]), default=None)
    local = f"local@{top.split('@')[1]}" if top else None
    pairs = [(top, "hf_static"), (top, "hf_continuous"), ("engine@1", "hf_batch1"),
             (top, local), ("engine@1", "local@1")]
    return {f"{a} / {b}": tput[a] / tput[b] for a, b in pairs if a in tput and b in tput}


def report(results: list[RunResult], floor: dict[str, Any] | None = None) -> str:
    """The table, the throughput ratios, the roofline floor and each engine run's KV waste
    and step times, as printed."""
    out = [format_table(results)]
    if rat := ratios(results):
        out.append("throughput ratios: " + ", ".join(f"{k} = {v:.2f}x" for k, v in rat.items()))
    if floor:
        out += floor_lines(floor, results)
    for r in results:
        if "kv_waste" in r.extra:
            w = r.extra["kv_waste"]
            out.append(f"{r.name}: reserved-but-unused KV slots "
                       f"{f'{w:.1%}' if isinstance(w, float) else w} over {r.extra['steps']} "
                       f"steps, {r.extra['preemptions']} preemptions, "
                       f"{r.extra['cached_prompt_tokens']} prompt tokens from the prefix cache")
        if t := r.extra.get("time"):
            line = (f"{r.name}: steps with prompt tokens {t['prefill_s']:.1f} s "
                    f"({t['prefill_tokens']:,} prompt tokens); decode-only steps "
                    f"{t['decode_s']:.1f} s ({t['decode_steps']} steps, "
                    f"{t['decode_tokens']:,} tokens)")
            if "fixed_ms" in t:
                line += (f", each ~{t['fixed_ms']:.1f} ms + {t['per_seq_ms']:.2f} ms per "
                         "sequence")
            out.append(line)
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; `--quick` and `--requests` resolve into n, lengths, concurrency."""
    ap = argparse.ArgumentParser(prog="python -m measure.bench", description=__doc__.split("\n")[0])
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
    ap.add_argument("--report", metavar="PATH", nargs="+",
                    help="print the table of saved --json files (runs merged) and exit")
    a = ap.parse_args(argv)
    a.only = a.only.split(",") if a.only else list(RUNS)
    if unknown := set(a.only) - set(RUNS):
        ap.error(f"--only: unknown runs {sorted(unknown)}; choose from {','.join(RUNS)}")
    a.n = (16 if a.quick else 64) if a.requests is None else a.requests
    if a.n < 1 or (a.threads is not None and a.threads < 1):
        ap.error("--requests and --threads must be >= 1")
    a.prompt_len, a.max_tok = ((10, 100), (8, 48)) if a.quick else ((10, 300), (16, 256))
    default = (1, 8, 16) if a.quick else (1, 8, 32, 64)
    try:
        conc = [int(c) for c in a.concurrency.split(",")] if a.concurrency else default
    except ValueError:
        ap.error(f"--concurrency: expected numbers like 1,8,64, got {a.concurrency!r}")
    if min(conc) < 1:
        ap.error("--concurrency values must be >= 1")
    a.conc = sorted({min(c, a.n) for c in conc})
    return a


def main(argv: list[str] | None = None) -> int:
    """Load the model once, run the chosen runs in turn, print and optionally save."""
    a = parse_args(argv)
    if a.report:
        print(report_saved(a.report))
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print("loading model ...", file=sys.stderr, flush=True)
    loaded = LoadedModel.load(a.model, a.device, a.dtype)
    corpus = list(loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    reqs = make_requests(corpus, a.n, a.seed, a.prompt_len, a.max_tok)
    ctx = BenchContext(loaded, reqs, a.conc)
    floor = roofline_floor(loaded, reqs, a.conc[-1])
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    print(f"model {loaded.name} on {loaded.model.device}, dtype {dtype} "
          f"({loaded.dtype_reason}), {torch.get_num_threads()} threads; {native.status()}")
    print(f"{a.n} requests (seed {a.seed}): prompt {a.prompt_len[0]}-{a.prompt_len[1]} tokens, "
          f"max_tokens {a.max_tok[0]}-{a.max_tok[1]}, greedy, EOS ignored; "
          f"{sum(r.max_tokens for r in reqs)} output tokens per run")
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
            save_json(a.json, a, loaded, dtype, results, floor, complete=name == a.only[-1])
    print("\n" + report(results, floor))
    return 0


def report_saved(paths: list[str]) -> str:
    """The table and ratios of runs saved by `--json` (later files add or replace runs)."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    runs: dict[str, dict[str, Any]] = {}
    for doc in docs:
        runs.update(doc["runs"])
    results = []
    for name, r in runs.items():
        extra = {k: v for k, v in r.items() if k not in ("summary", "na")}
        summary = RunSummary(**r["summary"]) if r["summary"] else None
        results.append(RunResult(name, summary, r["na"], extra))
    d = docs[0]
    head = (f"model {d['model']} on {d['device']}, dtype {d['dtype']}, {d['threads']} threads; "
            f"{d['requests']} requests (seed {d['seed']}); from {', '.join(paths)}")
    return head + "\n\n" + report(results, next((d["floor"] for d in docs if d.get("floor")), None))


def save_json(path: str, a: argparse.Namespace, loaded: LoadedModel, dtype: str,
              results: list[RunResult], floor: dict[str, Any] | None, complete: bool) -> None:
    """Write the figures so far; called after every run, so a killed bench keeps them."""
    doc = {"model": loaded.name, "device": str(loaded.model.device), "dtype": dtype,
           "threads": torch.get_num_threads(), "requests": a.n, "seed": a.seed,
           "complete": complete,
           "runs": {r.name: {"summary": r.summary.as_dict() if r.summary else None,
                             "na": r.na, **r.extra} for r in results},
           "ratios": ratios(results), "floor": floor}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
