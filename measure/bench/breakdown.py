"""Where one engine step's time goes, by torch.profiler: a decode step of the bench's
sequences (64 by default) and a mixed step (half of them decoding, prompt chunks filling
the rest of the token budget), each run as `ModelRunner.execute` runs it: prepare, forward,
sampling.

Every profiled op's own time (without its children) is put in one part by its name:

    matmuls          linear layers (QKV, O, gate/up, down, LM head): the bfloat16 kernel,
                     oneDNN or MKL
    paged attention  the CPU kernel: decode rows, and prefill rows where it takes them too
    decode attention the torch path's gather, batched matmuls and softmax
    prefill attention SDPA over a prompt chunk (torch path)
    elementwise      norms, RoPE, SiLU x up, residual adds, K/V writes, embedding, copies
    sampler          the argmax (greedy) or sampling of the step's logits
    host             the step's wall time no op accounts for: Python, building the inputs

Host work here is a lower bound of what the engine loop adds (the scheduler and the
outputs run outside `execute`; `python -m measure.bench --host-overhead` times those).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine import compute
from engine.config import SamplingParams
from engine.metrics import RequestMetrics
from engine.models.loaded import LoadedModel
from engine.runner import ModelRunner
from engine.sampler import greedy
from engine.sequence import Sequence

PARTS = ("matmuls", "paged attention", "decode attention", "prefill attention", "elementwise",
         "sampler", "host")
MATMUL_OPS = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::_weight_int8pack_mm",
              "batchlens::bf16_linear"}
DECODE_OPS = {"aten::bmm", "aten::index_select", "aten::_softmax", "aten::masked_fill_"}
SAMPLER_SCOPE = "sampler"
BLOCK_SIZE = 16
REPS = 3


@dataclass(frozen=True)
class StepProfile:
    """One profiled step: what it held, its wall time and the parts of it (ms)."""

    name: str
    num_seqs: int
    prompt_tokens: int
    context_tokens: int
    wall_ms: float
    parts_ms: dict[str, float]
    threads: int


def part_of(op: str, in_sampler: bool) -> str:
    """The part an op's own time belongs to (see the module docstring)."""
    if in_sampler:
        return "sampler"
    if op in MATMUL_OPS:
        return "matmuls"
    if op == "batchlens::paged_decode_attention":
        return "paged attention"
    if "scaled_dot_product" in op:
        return "prefill attention"
    if op in DECODE_OPS:
        return "decode attention"
    return "elementwise"


def profile_steps(loaded: LoadedModel, contexts: Seq[int], prompts: Seq[int],
                  token_budget: int = 512) -> list[StepProfile]:
    """Profile a decode step of len(`contexts`) sequences (each with that many tokens of KV)
    and a mixed step: the first half of them decoding, then chunks of `prompts` up to
    `token_budget` tokens in all. Medians of REPS runs after one warm-up."""
    with profile(activities=[ProfilerActivity.CPU]):
        pass  # started once on this thread first, the profiler's client logs no thread error
    return compute.run(_profile_steps, loaded, list(contexts), list(prompts), token_budget)


def _profile_steps(loaded: LoadedModel, contexts: list[int], prompts: list[int],
                   budget: int) -> list[StepProfile]:
    half = contexts[: max(1, len(contexts) // 2)]
    chunks, room = [], budget - len(half)
    for p in prompts:
        if room <= 1:
            break
        chunks.append(min(p, room))
        room -= chunks[-1]
    blocks = sum(-(-(n + 1) // BLOCK_SIZE) for n in contexts + chunks)
    runner = ModelRunner(loaded.model, blocks, BLOCK_SIZE)
    try:
        tables: dict[str, list[int]] = {}
        decode = [cached_sequence(tables, f"d{i}", n, 1) for i, n in enumerate(contexts)]
        fresh = [cached_sequence(tables, f"p{i}", 0, n) for i, n in enumerate(chunks)]
        mixed = [(s, 1) for s in decode[: len(half)]] + [(s, s.num_tokens) for s in fresh]
        steps = [(f"decode step, {len(contexts)} sequences", [(s, 1) for s in decode]),
                 (f"mixed step, {len(half)} decoding + {len(chunks)} prompts", mixed)]
        return [_profile(runner, tables, name, entries) for name, entries in steps]
    finally:
        runner.release_kv()


def cached_sequence(tables: dict[str, list[int]], rid: str, cached: int, new: int) -> Sequence:
    """A request of `cached + new` prompt tokens, `cached` of them already in the cache
    (whose K/V stay zeros: the step's time does not depend on them), with its blocks."""
    seq = Sequence(rid, [(31 * len(tables) + t) % 1000 + 3 for t in range(cached + new)],
                   SamplingParams(max_tokens=1, ignore_eos=True), RequestMetrics(0.0))
    seq.num_computed_tokens = cached
    start = sum(len(t) for t in tables.values())
    tables[rid] = list(range(start, start + -(-(cached + new) // BLOCK_SIZE)))
    return seq


def _profile(runner: ModelRunner, tables: dict[str, list[int]], name: str,
             entries: list[tuple[Sequence, int]]) -> StepProfile:
    model = runner.model

    def step() -> None:  # ModelRunner.execute's eager path, with the sampler marked
        ids, pos, meta, rows, sampled = runner.prepare(entries, tables)
        logits = model.forward(ids, pos, meta, runner.kv_caches, rows)
        with record_function(SAMPLER_SCOPE):
            greedy(logits[: len(sampled)])

    step()  # warm-up: oneDNN picks its kernels for these shapes
    runs = []
    for _ in range(REPS):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step()
            wall = (time.perf_counter() - start) * 1000
        runs.append((wall, _parts(prof.events(), wall)))
    wall, parts = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    prompt = sum(n for _, n in entries if n > 1)
    context = sum(s.num_computed_tokens + n for s, n in entries)
    return StepProfile(name, len(entries), prompt, context, wall, parts, torch.get_num_threads())


def _parts(events, wall_ms: float) -> dict[str, float]:
    """Self times (ms) of the profiled ops by part, and the rest of `wall_ms` as host."""
    parts = dict.fromkeys(PARTS, 0.0)
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CPU or ev.name == SAMPLER_SCOPE:
            continue
        parent, in_sampler = ev.cpu_parent, False
        while parent is not None:
            in_sampler |= parent.name == SAMPLER_SCOPE
            parent = parent.cpu_parent
        parts[part_of(ev.name, in_sampler)] += ev.self_cpu_time_total / 1000
    parts["host"] = max(0.0, wall_ms - sum(parts.values()))
    return parts


def format_profiles(profiles: list[StepProfile]) -> list[str]:
    """One line per profiled step: wall time, then each part with its share."""
    lines = []
    for p in profiles:
        shown = [f"{k} {v:.1f} ({v / p.wall_ms:.0%})" for k, v in p.parts_ms.items() if v >= 0.05]
        lines.append(f"step breakdown (torch.profiler, {p.threads} threads), {p.name}, "
                     f"{p.context_tokens:,} tokens of context, {p.prompt_tokens} prompt tokens: "
                     f"{p.wall_ms:.1f} ms = " + ", ".join(shown))
    return lines
