"""Which dtype a CPU runs this model faster in, timed on what the engine runs: one decode
step of 64 sequences and one of a single sequence, each through `ModelRunner.execute`
(prepare, forward with the decode-attention path the dtype gets, sampling), in bfloat16
and in float32.

A lone matmul is the wrong test: on a CPU with avx512_bf16 but no AMX it can make
bfloat16 look slower, since the packed-weight path and the native kernels the engine runs
in bfloat16 are not part of it. Called once per machine and model (`device.pick_dtype`
keeps the answer); a few seconds, both models built (~1 GiB for SmolLM2-135M) and
dropped.

On one thread: the answer is kept for good, so it must not depend on what else runs at
that moment. With two threads on a machine where another process holds a core, every
op's OpenMP team waits for its descheduled thread, and bfloat16 steps (more, shorter ops)
suffer most, enough to pick the wrong dtype; one thread per step, the steps interleaved,
sees each dtype's work alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.models.llama import LlamaModel

BATCH = 64  # sequences in the batched step (the engine's default max_num_seqs)
CONTEXT = 64  # tokens of KV per sequence: small, so the probe's pool stays small
BLOCK_SIZE = 16
REPS = 5


def decode_step(model: LlamaModel, batch: int, context: int = CONTEXT) -> Callable[[], None]:
    """A greedy decode step of `batch` sequences of `context` tokens through a runner of
    its own, as a function to call (`model` a `LlamaModel`; the KV cache holds zeros: the
    time does not depend on them)."""
    from engine.config import SamplingParams
    from engine.metrics import RequestMetrics
    from engine.runner import ModelRunner
    from engine.sequence import Sequence

    per_seq = -(-(context + 1) // BLOCK_SIZE)
    runner = ModelRunner(model, batch * per_seq, BLOCK_SIZE)
    entries, tables = [], {}
    for i in range(batch):
        seq = Sequence(f"probe-{i}", [(7 * i + t) % 1000 + 3 for t in range(context + 1)],
                       SamplingParams(max_tokens=1, ignore_eos=True), RequestMetrics(0.0))
        seq.num_computed_tokens = context
        tables[seq.request_id] = list(range(i * per_seq, (i + 1) * per_seq))
        entries.append((seq, 1))
    return lambda: runner.execute(entries, tables, {}) and None


def fastest_seconds(steps: dict[str, Callable[[], None]], reps: int = REPS) -> dict[str, float]:
    """Best wall time of each step over `reps` rounds, the steps interleaved in each round
    (another process taking the cores for a moment slows one round, not one step), after
    two warm-up rounds (oneDNN picks and caches its kernels)."""
    best = dict.fromkeys(steps, float("inf"))
    for k in range(reps + 2):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if k >= 2:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure_cpu_dtype(folder: Path, device: torch.device) -> tuple[torch.dtype, str]:
    """bfloat16 or float32, whichever runs the two decode steps faster together (the
    geometric mean of the two speed-ups), and the reason in words."""
    from engine.models import loader
    from engine.models.llama import LlamaModel, ModelArch, rope_inv_freq

    cfg = loader.read_config(folder)
    arch = ModelArch.from_config(cfg)
    inv, scaling = rope_inv_freq(cfg, arch)
    state = loader.read_state_dict(folder)
    steps = {}
    for dtype in ("bfloat16", "float32"):
        model = LlamaModel(arch, state, inv, scaling, device, getattr(torch, dtype))
        steps[f"{dtype}@{BATCH}"] = decode_step(model, BATCH)
        steps[f"{dtype}@1"] = decode_step(model, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the module docstring
    try:
        t = fastest_seconds(steps)
    finally:
        torch.set_num_threads(threads)
    return pick(t[f"bfloat16@{BATCH}"], t["bfloat16@1"], t[f"float32@{BATCH}"], t["float32@1"])


def pick(bf16_batched: float, bf16_single: float, f32_batched: float,
         f32_single: float) -> tuple[torch.dtype, str]:
    """The faster dtype by the geometric mean of the batched and single-sequence speed-ups."""
    batched, single = f32_batched / bf16_batched, f32_single / bf16_single
    if batched * single >= 1.0:
        return torch.bfloat16, (f"bfloat16: decode steps {batched:.1f}x ({BATCH} sequences) "
                                f"and {single:.1f}x (1) as fast as float32 on one core here")
    return torch.float32, (f"float32: decode steps {1 / batched:.1f}x ({BATCH} sequences) "
                           f"and {1 / single:.1f}x (1) as fast as bfloat16 on one core here")
