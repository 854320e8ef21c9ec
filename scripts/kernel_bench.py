"""Time the native CPU kernels alone: decode attention over SmolLM2's shapes against the
machine's calibrated bandwidth, the layer's elementwise ops, and the greedy argmax of a
step's logits.

Decode attention: 64 requests with contexts of 20-420 tokens (seeded, about the bench mix's
contexts halfway through its outputs), 30 layers, bfloat16 (or float32), K/V blocks of 16
tokens (the engine's default; `--block-size`) placed three ways: shuffled over the pool (as
a long-running engine hands them out), in order, and all requests reading the same few
blocks (K/V in cache: the kernel's compute alone); one request alone (batch 1, its keys cut
over the threads); and the rows of four prompts of 128 tokens after 64 cached ones (a mixed
step's prompt rows, each over its own prefix; their GB/s counts every row's keys, so a
kernel that reads a key once for several rows, or from cache, passes 100%). Each figure is
the median of `--rounds` passes over all layers after a warm-up, in GB/s of K/V read and as
a share of `measure.calibrate`'s bandwidth, measured in the same run. Under the shuffled
blocks, where the kernel reads the packed pool, "loads alone" is `scripts/memory_probe.py`'s
walk over shuffled runs of the same size (a block's K and V for one kv head), every line
prefetched into L2, with no arithmetic: the memory's own ceiling for this layout in that
minute.

The current kernel reads the caches as the engine lays them out here: packed where its
packed path serves (AMX or AVX512_BF16, `native.packed_kv`; BATCHLENS_KV_PACKED=0 keeps
rows), K and V as views of one pool (`attention.packed_caches`), else in rows.
`--against REV` builds the kernel source of a git revision beside the current one and
times the two in alternation, pass by pass, so both see the same load on a shared machine
(the revision's kernel on its engine's layout: packed where it reads them, in one pool where
its kernel has the pool's strides, else in rows); the ratio of
their medians is the figure to trust there.

The layer ops (csrc/layer_ops.cpp: add_rms_norm, rope_write_kv, silu_mul) run at 1, 64 and
512 rows of SmolLM2's widths with their inputs in cache: what a decode step of 1 or 64
requests and a prompt chunk spend on them, less the cache misses of a real step (where
rope_write_kv's K/V stores wait on lines no cache holds). `--against` times the revision's
layer_ops.cpp beside them.

    PYTHONPATH=. python scripts/kernel_bench.py [--dtype bfloat16|float32] [--against REV]
                                                [--rounds N] [--threads N] [--block-size N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch
from kernel_at import build_at, source_at  # scripts/, beside this file
from memory_probe import BUFFER as PROBE_BUFFER
from memory_probe import build as build_probe

from engine import compute
from engine.memory import pages
from engine.models import native
from engine.models.attention import cache_shapes, pack_caches, pool_caches
from measure.calibrate import calibrate

REQUESTS, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 9, 3, 64, 30
BLOCK = 16  # tokens per K/V block: the engine's default
Op = Callable[..., torch.Tensor]
Caches = list[tuple[torch.Tensor, torch.Tensor]]


def layout(lens: list[int], order: str, rng: random.Random, block: int) -> torch.Tensor:
    """Block tables for requests of `lens` keys in blocks of `block` tokens: "shuffled"
    over the pool, "in order", or the "same" first blocks for every request."""
    blocks = [-(-n // block) for n in lens]
    ids = list(range(1, sum(blocks) + 1))
    if order == "shuffled":
        rng.shuffle(ids)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(ids[taken: taken + n] if order != "same"
                                     else range(1, n + 1), dtype=torch.int32)
        taken += n
    return tables


def passes(ops: dict[str, tuple[Op, Caches]], args: tuple, rounds: int) -> dict[str, list[float]]:
    """Seconds per pass over all layers for each op (with its caches), the ops taking turns
    pass by pass (the order flipped every round)."""
    q, tables, context = args
    times: dict[str, list[float]] = {name: [] for name in ops}
    for op, caches in ops.values():  # warm-up
        [op(q, k, v, tables, context, 0.125) for k, v in caches]
    names = list(ops)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            op, caches = ops[name]
            start = time.perf_counter()
            for k, v in caches:
                op(q, k, v, tables, context, 0.125)
            times[name].append(time.perf_counter() - start)
    return times


def attention(dtype: torch.dtype, ops: dict[str, Op], rounds: int, bandwidth: float,
              block: int = BLOCK, pooled: frozenset[str] = frozenset({"this"}),
              packing: frozenset[str] = frozenset()) -> None:
    """Decode attention over the cases of the module docstring; `packing`: the ops whose
    engine packs K and V here; `pooled`: those of them that read packed K and V as views of
    one pool (the engine's layout since it has one), not apart."""
    rng = random.Random(0)
    lens = sorted(rng.randint(20, 420) for _ in range(REQUESTS))
    pool = sum(-(-n // block) for n in lens) + 1
    caches = [(torch.randn(KV_HEADS, pool, block, HEAD_DIM).to(dtype),
               torch.randn(KV_HEADS, pool, block, HEAD_DIM).to(dtype)) for _ in range(LAYERS)]
    per_key = LAYERS * 2 * KV_HEADS * HEAD_DIM * caches[0][0].element_size()
    packed = "this" in packing
    caches = [tuple(pages.gathered(list(kv))) for kv in caches]  # on 2 MiB pages, as the pool
    packs = [tuple(pages.gathered(list(pack_caches(k, v)))) for k, v in caches] if packing \
        else caches
    pools = [pool_caches(k, v) for k, v in caches] if packing else caches
    layouts = {name: (pools if name in pooled else packs) if name in packing else caches
               for name in ops}
    print(f"decode attention, {dtype}: {REQUESTS} requests, {sum(lens):,} keys, {LAYERS} layers, "
          f"{sum(lens) * per_key / 1e6:.0f} MB of K/V in blocks of {block} tokens (this kernel's "
          f"{'packed' if packed else 'in rows'}); medians of {rounds} passes; "
          f"calibrated bandwidth {bandwidth:.1f} GB/s")
    cases = [("shuffled blocks", lens, "shuffled"), ("blocks in order", lens, "in order"),
             ("same blocks (in cache)", lens, "same"), ("batch 1, 400 keys", [400], "shuffled"),
             ("4 prompts x 128 rows", [192] * 4, "prompt")]
    for name, case_lens, order in cases:
        tables = layout(case_lens, "shuffled" if order == "prompt" else order, rng, block)
        if order == "prompt":  # each prompt's rows: its table, each row over its prefix
            tables = tables.repeat_interleave(128, dim=0)
            case_lens = [n - 128 + i + 1 for n in case_lens for i in range(128)]
        n = len(case_lens)
        q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
        context = torch.tensor(case_lens, dtype=torch.int32)
        times = passes({name: (op, layouts[name]) for name, op in ops.items()},
                       (q, tables, context), rounds)
        nbytes = sum(case_lens) * per_key
        cells = []
        for op_name, ts in times.items():
            ms = statistics.median(ts) * 1000
            gbs = nbytes / ms / 1e6
            cells.append(f"{op_name} {ms:7.2f} ms {gbs:5.1f} GB/s ({gbs / bandwidth:4.0%})")
        if len(times) == 2:
            a, b = (statistics.median(ts) for ts in times.values())
            cells.append(f"{b / a:.2f}x")
        print(f"  {name:<24}" + "   ".join(cells))
        if name == "shuffled blocks" and packed and "this" in pooled:
            # a block's K then V for one kv head: one run of the pool
            print(plain_loads(2 * block * HEAD_DIM * caches[0][0].element_size(), rounds,
                              bandwidth))


def plain_loads(run: int, rounds: int, bandwidth: float) -> str:
    """The row of memory_probe's walk over shuffled runs of `run` bytes, every line
    prefetched into L2 three runs ahead, no arithmetic (median of `rounds`): what the
    memory gives a reader of this layout, kernel or not."""
    mod = build_probe()
    buf = pages.empty((PROBE_BUFFER,), torch.uint8).fill_(1)
    order = torch.randperm(PROBE_BUFFER // run, generator=torch.Generator().manual_seed(0))
    order = order.to(torch.int32)
    mod.walk(buf, order, run, 3, 2, 0)  # warm-up
    secs = statistics.median(_seconds(lambda: mod.walk(buf, order, run, 3, 2, 0))
                             for _ in range(rounds))
    gbs = PROBE_BUFFER / secs / 1e9
    return (f"  {'  loads alone':<24}{'':>16}{gbs:5.1f} GB/s ({gbs / bandwidth:4.0%})   "
            f"memory_probe's walk: {PROBE_BUFFER >> 20} MiB in shuffled {run}-byte runs")


def layer_ops(names: list[str], rounds: int, dtype: torch.dtype) -> None:
    """The layer's elementwise ops at a decode step's and a prompt chunk's rows, inputs in
    cache (µs, medians of `rounds` x 50 calls, each op namespace in turn)."""
    packed = native.packed_kv(torch.device("cpu"), dtype, BLOCK, HEAD_DIM, HEADS // KV_HEADS)
    print(f"layer ops, {dtype}, inputs in cache (K/V stored {'packed' if packed else 'in rows'}); "
          f"µs a call, medians of {rounds} x 50 calls")
    for rows in (1, 64, 512):
        cells = []
        for op, call in _layer_op_calls(rows, dtype, packed).items():
            times: dict[str, list[float]] = {n: [] for n in names}
            for r in range(rounds + 1):
                for n in names if r % 2 == 0 else names[::-1]:
                    ns = getattr(torch.ops, n)
                    start = time.perf_counter()
                    for _ in range(50):
                        call(ns)
                    if r:  # the first round warms up
                        times[n].append((time.perf_counter() - start) / 50 * 1e6)
            us = [statistics.median(t) for t in times.values()]
            cells.append(f"{op} " + " / ".join(f"{u:6.1f}" for u in us)
                         + (f" ({us[1] / us[0]:.2f}x)" if len(us) == 2 else ""))
        print(f"  {rows:>3} rows   " + "   ".join(cells))
    if len(names) == 2:
        print(f"  (each: {names[0]} / this, and this one's time as a share of it)")


def _layer_op_calls(rows: int, dtype: torch.dtype,
                    packed: bool) -> dict[str, Callable[[object], object]]:
    """Each layer op on `rows` rows of SmolLM2's widths, as a call taking an op namespace."""
    g = torch.Generator().manual_seed(rows)
    hidden, width = HEADS * HEAD_DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM
    x, delta = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    qkv = torch.randn(rows, width, generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * 1536, generator=g).to(dtype)
    angles = torch.arange(rows + 100)[:, None] * 0.01 * torch.ones(HEAD_DIM)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [torch.zeros(s, dtype=dtype)
              for s in cache_shapes(KV_HEADS, -(-rows // BLOCK), BLOCK, HEAD_DIM, packed)]
    positions, slots = torch.arange(rows) + 100, torch.arange(rows)
    return {
        "add_rms_norm": lambda ns: ns.add_rms_norm(x, delta, w, 1e-5),
        "rope_write_kv": lambda ns: ns.rope_write_kv(qkv, cos, sin, positions, *caches, slots,
                                                     HEADS, KV_HEADS),
        "silu_mul": lambda ns: ns.silu_mul(gate_up),
    }


def _packs(ops: object, dtype: torch.dtype, block: int) -> bool:
    """Whether the engine of a build (its op namespace) packs K and V here: its kernel has a
    packed path for these shapes on this CPU (a revision before the packed layout has none,
    one before the AVX512_BF16 packed path only with AMX). BATCHLENS_KV_PACKED=0: none."""
    supported = getattr(ops, "paged_packed_supported", None)
    return (dtype == torch.bfloat16 and supported is not None
            and os.environ.get("BATCHLENS_KV_PACKED", "1") != "0"
            and bool(supported(HEAD_DIM, HEADS // KV_HEADS, block)))


def argmax() -> None:
    logits = torch.randn(REQUESTS, 49152).bfloat16()

    def best_ms(fn: Callable[[], object], reps: int = 20) -> float:
        fn()
        return min(_seconds(fn) for _ in range(reps)) * 1000

    native_ms = best_ms(lambda: torch.ops.batchlens.argmax_rows(logits))
    torch_ms = best_ms(lambda: logits.float().argmax(dim=-1))
    print(f"greedy argmax of {REQUESTS} x 49,152 bfloat16 logits: argmax_rows {native_ms:.2f} ms, "
          f".float().argmax() {torch_ms:.2f} ms")


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--against", metavar="REV", help="also time the kernel of git revision REV")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads")
    ap.add_argument("--block-size", type=int, default=BLOCK,
                    help=f"tokens per K/V block (default {BLOCK}, the engine's)")
    a = ap.parse_args()
    if a.block_size < 1:
        raise SystemExit(f"--block-size must be >= 1, got {a.block_size}")
    if a.threads:
        torch.set_num_threads(a.threads)
    built, reason = native._build()
    if not built:
        raise SystemExit(f"the native kernels are not built here: {reason}")
    print(native.status(getattr(torch, a.dtype)) + f"; {torch.get_num_threads()} threads")
    ops: dict[str, Op] = {"this": torch.ops.batchlens.paged_decode_attention}
    if a.against:
        build_at(a.against, "paged_attention.cpp")
        ops = {a.against: torch.ops.batchlens_ab.paged_decode_attention, **ops}
    cal = calibrate()
    # a revision from before the pool reads K and V apart (its engine's layout; given views
    # of a pool it would copy them whole every call)
    pooled = {"this"} | ({a.against} if a.against and "block_strides" in source_at(
        a.against, "kernels.h") else set())
    # on the compute thread, as the engine runs them and as `calibrate` measured: ops from a
    # second thread would start a second OpenMP team, and the two slow each other down
    dtype = getattr(torch, a.dtype)
    packing = {"this"} if _packs(torch.ops.batchlens, dtype, a.block_size) else set()
    if a.against and _packs(torch.ops.batchlens_ab, dtype, a.block_size):
        packing.add(a.against)
    compute.run(attention, dtype, ops, a.rounds, cal.bandwidth_gbs, a.block_size,
                frozenset(pooled), frozenset(packing))
    names = ["batchlens"]
    if a.against:
        build_at(a.against, "layer_ops.cpp")
        names = ["batchlens_ab", "batchlens"]
    compute.run(layer_ops, names, a.rounds, getattr(torch, a.dtype))
    compute.run(argmax)


if __name__ == "__main__":
    main()
