"""Parallel sampling bench: n candidates per request against the same candidates sent as
n separate requests, on the engine and on the local PC.

    batchlens bench parallel [--n 4] [--quick] [--requests N] [--json PATH] [--dtype ...]

Every prompt of the bench mix (`measure.bench.requests`) runs twice on each side: as one
request with `n` candidates ("n=4"), and as n requests of one candidate each ("4 x n=1"),
candidate i seeded as `engine.config.candidate_params` seeds it, so both modes sample the
same answers. Sampling at temperature 0.8, EOS ignored, so every candidate has exactly
its max_tokens. The engine gets every request at once; the local PC serves them one
after another, as it serves users.

Per run: prompt tokens computed (engine: the prefill tokens of its steps, prefix-cache
hits excluded; local PC: every candidate's prompt, which it processes again each time),
peak KV blocks held at once (engine: the most any step left allocated; local PC: one
contiguous n_ctx reservation per candidate of a request, as a runtime with n slots holds
them), output tokens/s, wall.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from engine.config import EngineConfig, SamplingParams, candidate_params
from engine.engine import Engine
from engine.local import LOCAL_BLOCK, LocalPC
from engine.models.loaded import LoadedModel
from engine.outputs import RequestOutput
from measure.bench.requests import (
    BenchRequest,
    make_requests,
    mix_lengths,
    tokenize_corpus,
)
from workloads.cpu_load import cpu_sample, others_busy

PROG = "batchlens bench parallel"
TEMPERATURE = 0.8
WARM_UP = SamplingParams(max_tokens=2, ignore_eos=True)


@dataclass
class ParallelRun:
    """One side's run of one mode; the figures the table shows."""

    side: str  # "engine" or "local"
    mode: str  # "n=4" (one request, n candidates) or "4 x n=1" (n requests)
    prompts: int
    candidates: int  # per prompt
    prompt_tokens_computed: int
    cached_prompt_tokens: int
    peak_kv_blocks: int
    output_tokens: int
    wall_s: float
    answers: list[list[int]]  # every candidate's tokens, prompt by prompt, index by index
    others_cpu: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The figures for `--json` (without the answers' tokens)."""
        d = asdict(self)
        del d["answers"]
        return {**d, "output_tokens_per_s": self.tokens_per_s}


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4, help="candidates per prompt (default: 4)")
    ap.add_argument("--quick", action="store_true", help="8 short prompts")
    ap.add_argument("--requests", type=int, help="prompts (default 16, quick 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="local HF folder or .gguf (default: the bundled model)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, help="torch.set_num_threads")
    ap.add_argument("--sides", default="engine,local",
                    help="comma-separated subset of engine,local (default: %(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return ap


def parse_args(argv: list[str] | None, prog: str = PROG) -> argparse.Namespace:
    """The command line; `--quick` and `--requests` resolve into prompts and lengths."""
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    a.prompts = (8 if a.quick else 16) if a.requests is None else a.requests
    if a.prompts < 1:
        ap.error(f"--requests must be >= 1, got {a.prompts}")
    if not 2 <= a.n <= 16:
        ap.error(f"--n must be in 2..16, got {a.n}")
    if a.threads is not None and a.threads < 1:
        ap.error("--threads must be >= 1")
    a.sides = a.sides.split(",")
    if bad := set(a.sides) - {"engine", "local"}:
        ap.error(f"--sides: unknown sides {sorted(bad)}; choose from engine,local")
    # the bench's own lengths (measure.bench.cli)
    a.prompt_len, a.max_tok = mix_lengths(a.quick)
    return a


def parallel_params(reqs: list[BenchRequest], n: int, seed: int) -> list[SamplingParams]:
    """One request of `n` candidates per prompt; prompt j's candidates are seeded
    seed + j*n + i, so no two candidates of the mix share a seed."""
    return [SamplingParams(max_tokens=r.max_tokens, temperature=TEMPERATURE, seed=seed + j * n,
                           ignore_eos=True, n=n) for j, r in enumerate(reqs)]


def separate(prompts: list[list[int]], params: list[SamplingParams],
             ) -> tuple[list[list[int]], list[SamplingParams]]:
    """The same candidates as requests of one candidate each: candidate i of a prompt
    becomes the single request with candidate i's params."""
    out_prompts, out_params = [], []
    for prompt, p in zip(prompts, params, strict=True):
        for i in range(p.n):
            out_prompts.append(prompt)
            out_params.append(replace(candidate_params(p, i), n=1))
    return out_prompts, out_params


def answers_of(outs: list[RequestOutput], n: int) -> list[list[int]]:
    """Every candidate's tokens in prompt, then index order, whether the outputs are one
    request per prompt or n requests per prompt."""
    answers = [list(c.token_ids) for o in outs for c in o.answers]
    assert len(answers) % n == 0  # n per prompt in either mode
    return answers


def run_engine(loaded: LoadedModel, prompts: list[list[int]], params: list[SamplingParams],
               mode: str, n: int) -> ParallelRun:
    """Every request submitted at once to a fresh engine (no prompt cached before)."""
    with Engine(EngineConfig(), loaded=loaded) as eng:
        eng.generate([[1, 2, 3, 4]], WARM_UP)
        before = eng.stats()
        t0, cpu0 = time.monotonic(), cpu_sample()
        outs = eng.generate(prompts, params)
        wall, busy = time.monotonic() - t0, others_busy(cpu0, cpu_sample())
        # the steps are recorded before their outputs are handed out, so all are here
        st = eng.stats(steps_after=t0)
    steps = st.recent_steps
    assert len(steps) == st.num_steps - before.num_steps  # none fell off the bounded record
    assert st.kv is not None and before.kv is not None
    answers = answers_of(outs, n)
    return ParallelRun(
        "engine", mode, len(answers) // n, n,
        prompt_tokens_computed=sum(s.num_prefill_tokens for s in steps),
        cached_prompt_tokens=st.kv.prefix_hits - before.kv.prefix_hits,
        peak_kv_blocks=max((round(s.kv_usage * st.kv.num_blocks) for s in steps), default=0),
        output_tokens=sum(map(len, answers)), wall_s=wall, answers=answers, others_cpu=busy)


def run_local(loaded: LoadedModel, prompts: list[list[int]], params: list[SamplingParams],
              mode: str, n: int) -> ParallelRun:
    """The local PC serving every request in turn: each candidate processes its prompt
    into its own contiguous n_ctx slot, so its figures follow from the requests."""
    with LocalPC(loaded) as local:
        local.generate([[1, 2, 3, 4]], WARM_UP)
        t0, cpu0 = time.monotonic(), cpu_sample()
        outs = local.generate(prompts, params)
        wall, busy = time.monotonic() - t0, others_busy(cpu0, cpu_sample())
        blocks = max(p.n for p in params) * -(-local.n_ctx // LOCAL_BLOCK)
    answers = answers_of(outs, n)
    return ParallelRun(
        "local", mode, len(answers) // n, n,
        prompt_tokens_computed=sum(len(c.prompt_token_ids) for o in outs for c in o.answers),
        cached_prompt_tokens=0, peak_kv_blocks=blocks, output_tokens=sum(map(len, answers)),
        wall_s=wall, answers=answers, others_cpu=busy)


def same_answers(runs: list[ParallelRun], side: str) -> tuple[int, int] | None:
    """(candidates equal in both modes, candidates) on one side; None before both ran."""
    pair = [r for r in runs if r.side == side]
    if len(pair) != 2:
        return None
    a, b = pair[0].answers, pair[1].answers
    return sum(x == y for x, y in zip(a, b, strict=True)), len(a)


def ratio(runs: list[ParallelRun], side: str, field: str) -> float | None:
    """Separate requests' figure over n candidates' on one side (how much n saves)."""
    pair = [r for r in runs if r.side == side]
    if len(pair) != 2:
        return None
    a, b = (getattr(r, field) for r in pair)
    return b / a if a else None


def table(runs: list[ParallelRun]) -> str:
    """One row per run, then per side what n candidates per request saved."""
    head = (f"{'side':<7}{'requests':>14}{'prompt tok':>11}{'cached':>8}{'peak KV blk':>12}"
            f"{'out tok':>9}{'tok/s':>8}{'wall s':>8}{'others':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        reqs = f"{r.prompts} x {r.mode}"
        lines.append(f"{r.side:<7}{reqs:>14}{r.prompt_tokens_computed:>11}"
                     f"{r.cached_prompt_tokens:>8}{r.peak_kv_blocks:>12}{r.output_tokens:>9}"
                     f"{r.tokens_per_s:>8.1f}{r.wall_s:>8.1f}{r.others_cpu:>8.0%}")
    for side in dict.fromkeys(r.side for r in runs):
        lines += summary_lines(runs, side)
    lines.append("(prompt tok: prompt tokens computed; cached: prompt tokens found in the "
                 "prefix cache; blk: 16-token blocks held at once; others: CPU share other "
                 "processes used)")
    return "\n".join(lines)


def summary_lines(runs: list[ParallelRun], side: str) -> list[str]:
    """What separate requests cost against n candidates on one side, as printed."""
    tok, blk = ratio(runs, side, "prompt_tokens_computed"), ratio(runs, side, "peak_kv_blocks")
    tps, same = ratio(runs, side, "tokens_per_s"), same_answers(runs, side)
    if tok is None or blk is None or tps is None or same is None:
        return []
    return [f"{side}: separate requests compute {tok:.2f}x the prompt tokens, hold "
            f"{blk:.2f}x the peak KV blocks, run at {tps:.2f}x the tokens/s; "
            f"{same[0]} of {same[1]} candidates equal in both modes"]


def save(path: str, info: dict[str, Any], runs: list[ParallelRun]) -> None:
    """The figures so far (written after every run, so a killed bench keeps them)."""
    sides = dict.fromkeys(r.side for r in runs)
    doc = {**info, "runs": [r.as_dict() for r in runs],
           "separate_over_n": {s: {f: ratio(runs, s, f) for f in (
               "prompt_tokens_computed", "peak_kv_blocks", "tokens_per_s")} for s in sides},
           "same_answers": {s: same_answers(runs, s) for s in sides}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


RUNNERS = {"engine": run_engine, "local": run_local}


def run_bench(loaded: LoadedModel, reqs: list[BenchRequest], n: int, seed: int,
              sides: list[str], on_run: Callable[[list[ParallelRun]], None] | None = None,
              ) -> list[ParallelRun]:
    """Each side in both modes, n candidates per request first; `on_run(runs so far)`
    after each run."""
    prompts, params = [list(r.prompt_ids) for r in reqs], parallel_params(reqs, n, seed)
    modes = {f"n={n}": (prompts, params), f"{n} x n=1": separate(prompts, params)}
    runs: list[ParallelRun] = []
    for side in sides:
        for mode, (ps, pp) in modes.items():
            print(f"run {side} {mode} ...", file=sys.stderr, flush=True)
            runs.append(RUNNERS[side](loaded, ps, pp, mode, n))
            if on_run is not None:
                on_run(runs)
    return runs


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Load the model once, run each side in both modes, print, optionally save."""
    a = parse_args(argv, prog)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    print("loading model ...", file=sys.stderr, flush=True)
    loaded = LoadedModel.load(a.model, a.device, a.dtype)
    reqs = make_requests(tokenize_corpus(loaded.tokenizer), a.prompts, a.seed, a.prompt_len,
                         a.max_tok)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    info = {"model": loaded.name, "device": str(loaded.model.device), "dtype": dtype,
            "threads": torch.get_num_threads(), "prompts": a.prompts, "n": a.n,
            "seed": a.seed, "temperature": TEMPERATURE, "prompt_len": a.prompt_len,
            "max_tokens": a.max_tok}
    print(f"model {loaded.name} on {loaded.model.device}, {dtype}, {torch.get_num_threads()} "
          f"threads; {a.prompts} prompts of {a.prompt_len[0]}-{a.prompt_len[1]} tokens, "
          f"{a.n} candidates each, max_tokens {a.max_tok[0]}-{a.max_tok[1]}, temperature "
          f"{TEMPERATURE}, EOS ignored")
    on_run = (lambda runs: save(a.json, info, runs)) if a.json else None
    runs = run_bench(loaded, reqs, a.n, a.seed, a.sides, on_run)
    print("\n" + table(runs))
    return 0
