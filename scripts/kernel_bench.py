"""Time the native CPU kernels alone: decode attention over SmolLM2's shapes, and the
greedy argmax of a step's logits.

Decode attention: 64 requests with contexts of 20-420 tokens (seeded), 30 layers, bfloat16
(or float32), K/V blocks of 16 tokens placed three ways: shuffled over the pool (as a
long-running engine hands them out), in order, and all requests reading the same few
blocks (K/V in cache: the kernel's compute alone). Best of 7 after a warm-up.

    python scripts/kernel_bench.py [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from engine.models import native

REQUESTS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 64, 9, 3, 64, 16, 30


def best_ms(fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def attention(dtype: torch.dtype) -> None:
    op = torch.ops.batchlens.paged_decode_attention
    rng = random.Random(0)
    lens = sorted(rng.randint(20, 420) for _ in range(REQUESTS))
    blocks = [-(-n // BLOCK) for n in lens]
    pool = sum(blocks) + 1
    caches = [(torch.randn(KV_HEADS, pool, BLOCK, HEAD_DIM).to(dtype),
               torch.randn(KV_HEADS, pool, BLOCK, HEAD_DIM).to(dtype)) for _ in range(LAYERS)]
    q = torch.randn(REQUESTS, HEADS, HEAD_DIM).to(dtype)
    context = torch.tensor(lens, dtype=torch.int32)
    nbytes = sum(lens) * LAYERS * 2 * KV_HEADS * HEAD_DIM * q.element_size()
    shuffled = list(range(1, pool))
    rng.shuffle(shuffled)
    placements = {"shuffled blocks": shuffled, "blocks in order": list(range(1, pool)),
                  "same blocks (in cache)": None}
    print(f"decode attention, {dtype}: {REQUESTS} requests, {sum(lens):,} keys, {LAYERS} layers, "
          f"{nbytes / 1e6:.0f} MB of K/V")
    for name, order in placements.items():
        tables = torch.zeros(REQUESTS, max(blocks), dtype=torch.int32)
        taken = 0
        for i, n in enumerate(blocks):
            ids = order[taken: taken + n] if order is not None else range(1, n + 1)
            tables[i, :n] = torch.tensor(list(ids), dtype=torch.int32)
            taken += n
        ms = best_ms(lambda t=tables: [op(q, k, v, t, context, 0.125) for k, v in caches])
        print(f"  {name:<24}{ms:7.2f} ms  {nbytes / ms / 1e6:5.1f} GB/s")


def argmax() -> None:
    logits = torch.randn(REQUESTS, 49152).bfloat16()
    native_ms = best_ms(lambda: torch.ops.batchlens.argmax_rows(logits), 20)
    torch_ms = best_ms(lambda: logits.float().argmax(dim=-1), 20)
    print(f"greedy argmax of {REQUESTS} x 49,152 bfloat16 logits: argmax_rows {native_ms:.2f} ms, "
          f".float().argmax() {torch_ms:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = ap.parse_args()
    built, reason = native._build()
    if not built:
        raise SystemExit(f"the native kernels are not built here: {reason}")
    print(native.status(getattr(torch, a.dtype)))
    attention(getattr(torch, a.dtype))
    argmax()


if __name__ == "__main__":
    main()
