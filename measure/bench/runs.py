"""The bench's runs, one function per kind: transformers one at a time, in static batches
and with continuous batching; this engine at each concurrency; the local PC. Each returns
`RunResult`s whose latency figures come from `engine.metrics.summarize` over
`RequestMetrics` built from `time.monotonic()` stamps.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import torch

from engine import compute
from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine, StepStats
from engine.local import LocalPC
from engine.metrics import RequestMetrics, RunSummary, summarize
from engine.models.loaded import LoadedModel, freeze_heap
from measure.bench.requests import BenchRequest


@dataclass
class RunResult:
    """One run's figures: a summary, or `na` saying why there is none."""

    name: str
    summary: RunSummary | None = None
    na: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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
    metrics = [RequestMetrics(arrival_time=t0,
                              token_times=[t + shift for t in done[rid].timestamps])
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
            params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
                      for r in ctx.requests]
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
    if results and ctx.loaded.model.device.type == "cpu":
        results[-1].extra["profile"] = profile_breakdown(ctx, ctx.concurrency[-1])
    return results


def profile_breakdown(ctx: BenchContext, concurrency: int) -> list[dict[str, Any]]:
    """`measure.bench.breakdown` on this mix: a decode step of `concurrency` of its
    requests, each halfway through its output, and a mixed step with the next prompts."""
    from measure.bench import breakdown

    reqs = ctx.requests[:concurrency]
    contexts = [r.halfway_context for r in reqs]
    prompts = [len(r.prompt_ids) for r in ctx.requests[concurrency:] + ctx.requests]
    print("  profiling a decode step and a mixed step ...", file=sys.stderr, flush=True)
    return [asdict(p) for p in breakdown.profile_steps(ctx.loaded, contexts, prompts)]


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
    with LocalPC(ctx.loaded) as local:
        local.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        for name, reqs in (("local@1", ctx.requests[:1]),
                           (f"local@{len(ctx.requests)}", ctx.requests)):
            print(f"  {name} ...", file=sys.stderr, flush=True)
            params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
            t0 = time.monotonic()
            outs = local.generate([list(r.prompt_ids) for r in reqs], params)
            results.append(_result(name, [o.metrics for o in outs], t0, time.monotonic()))
    return results


# The registry of runs, in run order. This engine and the local PC run first, in a process
# no transformers run has touched yet: after transformers' static batching, engine@64 in the
# same process runs a few percent slower (cause not found; not a second OpenMP team).
# transformers' continuous batching runs last: its manager computes on a thread of its own,
# whose OpenMP team outlives it and slows every later run in the process (this engine's
# batch-1 decode step takes about twice as long after it).
RUNS: dict[str, Callable[[BenchContext], list[RunResult]]] = {
    "engine": run_engine,
    "local": run_local,
    "hf_batch1": run_hf_batch1,
    "hf_static": run_hf_static,
    "hf_continuous": run_hf_continuous,
}
