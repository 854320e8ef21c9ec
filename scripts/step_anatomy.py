"""Where a decode step's time goes, against the weights' streaming alone.

A batch-1 step reads every weight once, so its floor is the weights' bytes over the
memory bandwidth. This script times, for the bundled model (or --model):

- the engine's decode steps, as `batchlens bench` counts them (one request of --prompt
  tokens generating --tokens; the median step);
- the same step's parts on the compute thread, each as the engine runs it, right after a
  forward pass: the inputs (`ModelRunner.prepare_inputs`), the forward, the sampling
  (`ModelRunner.sample_rows`). A forward streams the weights through every cache, so the
  host code after it runs from memory: these parts cost several times what they cost when
  timed back to back;
- the trip to the compute thread and back (`engine.compute.run` from another thread);
- inside the forward, where the layer stack runs in one native call (csrc/decoder.cpp), its
  ops by kind and its final norm and LM head, timed in that call
  (`torch.ops.batchlens.forward_times`; torch.profiler costs as much per op as a batch-1
  step's small ops take), and what runs outside it;
- the weights' bytes at `measure.calibrate`'s bandwidth, measured in the same run.

`--seqs N` (N > 1) times the step's parts for N requests of the bench's mix instead, each
halfway through its output (the contexts of the bench's profiled decode step), without the
engine's own steps.

`--kv-layouts R` times only the forward and its decode attention, with the KV cache in rows
and packed (`native.packed_kv`) in turn, R rounds of each, so both see the same load on a
shared machine. Packed, the attention stores the step's K/V itself (the RoPE ops do, in
rows): compare the forwards.

`--head-apart R` times only the engine's batch-1 decode steps, with the LM head in the layer
stack's call (as the engine runs it where the head is the bf16 kernel) and apart from it
(called from Python after the call), in turn, R rounds of each.

    PYTHONPATH=. python scripts/step_anatomy.py [--model PATH] [--prompt N] [--tokens N]
                                                [--seqs N] [--kv-layouts R] [--head-apart R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from engine import compute
from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.models import native
from engine.models.llama import LlamaModel
from engine.models.loaded import LoadedModel
from engine.runner import ModelRunner
from measure.bench.breakdown import BLOCK_SIZE, cached_sequence
from measure.bench.requests import MIX_MAX_TOKENS, MIX_PROMPT_LEN, make_requests, tokenize_corpus
from measure.calibrate import calibrate

ITERATIONS = 60


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def engine_steps(loaded: LoadedModel, prompt: int, tokens: int) -> float:
    """The median decode step (ms) of one request in the engine, as the bench counts it."""
    with Engine(EngineConfig(max_num_seqs=1), loaded=loaded) as eng:
        eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))
        start = time.monotonic()
        ids = [(37 * i) % 1000 + 5 for i in range(prompt)]
        eng.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))
        steps = [s.duration for s in eng.stats().recent_steps
                 if s.start >= start and not s.num_prefill_tokens]
    return median_ms(steps)


def decode_step(model: LlamaModel, contexts: list[int]) -> tuple[ModelRunner, list, dict]:
    """A runner holding one request per context (that many tokens cached), each decoding
    its next: the runner, the step's entries, the block tables."""
    tables: dict[str, list[int]] = {}
    entries = [(cached_sequence(tables, f"r{i}", n, 1), 1) for i, n in enumerate(contexts)]
    blocks = sum(-(-(n + 1) // BLOCK_SIZE) for n in contexts)
    return ModelRunner(model, blocks, BLOCK_SIZE), entries, tables


def step_parts(loaded: LoadedModel, contexts: list[int]) -> dict[str, float]:
    """Inputs, forward and sampling of a decode step of requests at `contexts` tokens (ms,
    medians), each timed right after a forward, as the engine runs them (on the compute
    thread)."""
    model = loaded.model
    runner, entries, tables = decode_step(model, contexts)
    parts: dict[str, list[float]] = {"inputs": [], "forward": [], "sampling": []}
    try:
        for i in range(ITERATIONS + 3):
            if i == 3 and model.layer_stack is not None:
                torch.ops.batchlens.forward_times(True)
            t0 = time.perf_counter()
            s = runner.prepare_inputs(entries, tables)
            t1 = time.perf_counter()
            logits = model.forward(s.input_ids, s.positions, s.meta, runner.kv_caches,
                                   s.logits_rows)
            t2 = time.perf_counter()
            runner.sample_rows(logits[: len(s.sampled)], entries, s.sampled, {})
            t3 = time.perf_counter()
            if i >= 3:
                for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    parts[name].append(dt)
        stack = (torch.ops.batchlens.forward_times(False) if model.layer_stack is not None
                 else [])
    finally:
        runner.release_kv()
    out = {name: median_ms(ts) for name, ts in parts.items()}
    out["forward_mean"] = statistics.mean(parts["forward"]) * 1000
    if stack:  # means, ms: matmuls, attention, norms, RoPE + K/V, SiLU x up, head, calls
        out |= dict(zip(("matmuls", "attention", "norms", "rope", "silu", "head", "stack"),
                        (t / 1000 / ITERATIONS for t in stack), strict=True))
    return out


def kv_layouts(loaded: LoadedModel, contexts: list[int],
               rounds: int) -> dict[str, dict[str, list[float]]]:
    """The forward and decode attention (ms) of `step_parts` with the KV cache in rows and
    packed, `rounds` times each, taking turns (the runner picks its layout as it starts,
    from BATCHLENS_KV_PACKED)."""
    times: dict[str, dict[str, list[float]]] = {
        name: {"forward": [], "attention": []} for name in ("in rows", "packed")}
    saved = os.environ.get("BATCHLENS_KV_PACKED")
    try:
        for r in range(rounds):
            order = [("in rows", "0"), ("packed", "1")]
            for name, flag in order if r % 2 == 0 else order[::-1]:
                os.environ["BATCHLENS_KV_PACKED"] = flag
                parts = compute.run(step_parts, loaded, contexts)
                times[name]["forward"].append(parts["forward"])
                times[name]["attention"].append(parts.get("attention", float("nan")))
    finally:
        if saved is None:
            os.environ.pop("BATCHLENS_KV_PACKED", None)
        else:
            os.environ["BATCHLENS_KV_PACKED"] = saved
    return times


def head_apart(loaded: LoadedModel, prompt: int, tokens: int,
               rounds: int) -> dict[str, list[float]]:
    """The median engine decode step (ms) of `engine_steps` with the LM head in the layer
    stack's call and apart from it, `rounds` times each, taking turns."""
    model = loaded.model
    head = model.stack_head
    variants = {"in the call": head, "apart": head[:0]}  # empty: the call returns the rows
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for r in range(rounds):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                model.stack_head = variants[name]
                times[name].append(engine_steps(loaded, prompt, tokens))
    finally:
        model.stack_head = head
    return times


def round_trip(loaded: LoadedModel, context: int) -> float:
    """The trip to the compute thread and back around a forward (ms): `compute.run` timed
    from another thread, less the time the forward took inside it."""
    model = loaded.model
    runner, entries, tables = decode_step(model, [context])
    s = compute.run(runner.prepare_inputs, entries, tables)
    inside: list[float] = []

    def forward() -> None:
        t0 = time.perf_counter()
        model.forward(s.input_ids, s.positions, s.meta, runner.kv_caches, s.logits_rows)
        inside.append(time.perf_counter() - t0)

    trips: list[float] = []

    def caller() -> None:  # as the engine's loop thread calls it
        for _ in range(ITERATIONS):
            t0 = time.perf_counter()
            compute.run(forward)
            trips.append(time.perf_counter() - t0 - inside[-1])

    try:
        thread = threading.Thread(target=caller)
        thread.start()
        thread.join()
    finally:
        compute.run(runner.release_kv)
    return median_ms(trips[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="local HF folder or .gguf (default: the bundled model)")
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens (default 300)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens generated (default 200)")
    ap.add_argument("--seqs", type=int, default=1,
                    help="requests in the step (default 1; more: the bench mix's contexts)")
    ap.add_argument("--kv-layouts", type=int, default=0, metavar="R",
                    help="only the forward, KV cache in rows and packed in turn, R rounds")
    ap.add_argument("--head-apart", type=int, default=0, metavar="R",
                    help="only the engine's steps, the LM head in the stack's call and apart "
                         "in turn, R rounds")
    a = ap.parse_args()
    if a.seqs < 1:
        ap.error("--seqs must be at least 1")
    if a.kv_layouts < 0:
        ap.error("--kv-layouts must not be negative (0: off)")
    if a.head_apart < 0:
        ap.error("--head-apart must not be negative (0: off)")
    loaded = LoadedModel.load(a.model)
    if a.seqs == 1:
        contexts = [a.prompt + a.tokens // 2]
    else:  # as measure.bench.runs.profile_breakdown: the mix's first requests, halfway
        reqs = make_requests(tokenize_corpus(loaded.tokenizer), a.seqs, 0, MIX_PROMPT_LEN,
                             MIX_MAX_TOKENS)
        contexts = [r.halfway_context for r in reqs]
    bandwidth = calibrate().bandwidth_gbs
    if a.kv_layouts:
        model = loaded.model
        arch = model.arch
        if not native.packed_kv(model.device, model.dtype, BLOCK_SIZE, arch.head_dim,
                                arch.num_heads // arch.num_kv_heads):
            raise SystemExit("--kv-layouts: this model's KV cache is never packed here (it "
                             "needs bfloat16 on a CPU with AMX or AVX512_BF16)")
        times = kv_layouts(loaded, contexts, a.kv_layouts)
        print(f"decode step of {len(contexts)} sequences, {sum(contexts):,} tokens of "
              f"context, {torch.get_num_threads()} threads; calibrated bandwidth "
              f"{bandwidth:.1f} GB/s; ms, medians of {a.kv_layouts} rounds (each the median "
              "forward and the mean attention of a step_parts run)")
        for name, t in times.items():
            print(f"  KV {name:<8} forward {statistics.median(t['forward']):7.2f}   decode "
                  f"attention {statistics.median(t['attention']):6.2f}")
        return
    if a.head_apart:
        model = loaded.model
        if model.layer_stack is None or not model.stack_head.numel():
            raise SystemExit("--head-apart: this model's LM head never runs in the layer "
                             "stack's call here (it needs every matmul, the head's too, to be "
                             "the bf16 kernel)")
        times = head_apart(loaded, a.prompt, a.tokens, a.head_apart)
        print(f"batch-1 decode steps, {loaded.name}, {torch.get_num_threads()} threads, "
              f"{a.prompt} prompt tokens, {a.tokens} generated; calibrated bandwidth "
              f"{bandwidth:.1f} GB/s; ms, the median of {a.head_apart} rounds' median steps")
        for name, t in times.items():
            print(f"  LM head {name:<12} {statistics.median(t):6.2f}   rounds: "
                  + " ".join(f"{x:.2f}" for x in t))
        return
    engine_ms = engine_steps(loaded, a.prompt, a.tokens) if a.seqs == 1 else None
    parts = compute.run(step_parts, loaded, contexts)
    trip = round_trip(loaded, contexts[0])
    model = loaded.model
    arch = model.arch
    weights = sum(t.numel() * t.element_size() for t in weight_tensors(model))
    kv = (sum(contexts) * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
          * model.dtype.itemsize)
    step = "batch-1 decode step" if a.seqs == 1 else f"decode step of {a.seqs} sequences"
    print(f"{step}, {loaded.name} ({model.dtype}), {torch.get_num_threads()} threads, "
          f"{sum(contexts):,} tokens of context; calibrated bandwidth {bandwidth:.1f} GB/s; "
          "ms (medians; the forward's parts means)")

    def row(label: str, ms: float, note: str = "") -> None:
        print(f"  {label:<48}{ms:7.2f}{note}")

    if engine_ms is not None:
        row("engine step (the bench's decode figure)", engine_ms)
    row("to the compute thread and back", trip)
    row("inputs, after a forward", parts["inputs"])
    row("forward", parts["forward"])
    if "stack" in parts:
        layer_bytes = sum(t.numel() * t.element_size() for t in weight_tensors(model)[:-1])
        small = parts["norms"] + parts["rope"] + parts["silu"]
        rest = parts["stack"] - parts["matmuls"] - parts["attention"] - small - parts["head"]
        head_bytes = weights - layer_bytes
        row(f"  layer matmuls ({layer_bytes / 1e6:.0f} MB)", parts["matmuls"],
            f"   {layer_bytes / parts['matmuls'] / 1e6:5.1f} GB/s")
        row(f"  decode attention ({kv / 1e6:.1f} MB of K/V)", parts["attention"],
            f"   {kv / parts['attention'] / 1e6:5.1f} GB/s")
        row("  norms (two a layer)", parts["norms"])
        row("  RoPE + K/V writes", parts["rope"])
        row("  SiLU x up", parts["silu"])
        row("  the rest of the layer stack's call", rest)
        if model.stack_head.numel():  # the LM head runs in the stack's call
            row(f"  final norm, LM head ({head_bytes / 1e6:.0f} MB)", parts["head"],
                f"   {head_bytes / parts['head'] / 1e6:5.1f} GB/s")
            row("  outside it: embedding, the call from Python",
                parts["forward_mean"] - parts["stack"])
        else:
            row("  final norm", parts["head"])
            row("  outside it: embedding, the call, LM head", parts["forward_mean"] - parts["stack"])
    row("sampling, after a forward", parts["sampling"])
    row(f"the weights ({weights / 1e6:.0f} MB) at the calibrated bandwidth", weights / bandwidth / 1e6)
    if a.seqs > 1:  # the step's floor: every byte it reads, once
        row(f"with the K/V ({(weights + kv) / 1e6:.0f} MB in all)", (weights + kv) / bandwidth / 1e6)


def weight_tensors(model: LlamaModel) -> list[torch.Tensor]:
    """The weights a decode step streams: every layer's matmuls and the LM head."""
    return [t for layer in model.layers for t in (layer.qkv.weight, layer.o.weight,
                                                   layer.gate_up.weight, layer.down.weight)
            ] + [model.lm_head.weight]


if __name__ == "__main__":
    main()
