"""The bfloat16 matmul kernel (csrc/bf16_gemm.cpp) against oneDNN's packed weights.

Times SmolLM2-135M's 120 layer matmuls (QKV, O, gate/up, down of 30 layers; random weights
far past the caches) at each row count both ways, through `engine.models.linear.Linear`:
oneDNN's packed weights (`pack=True`, what a bfloat16 step runs on CPUs with AMX or with
BATCHLENS_BF16_KERNEL=0) and the kernel (`kernel=True`). Prints ms, TFLOPS and the ratio, the
kernel with each layer's weights kept in cache (its compute alone: one layer's matmuls called
over and over, times 30), and the kernel's largest error against the exact product. Needs a
CPU with AVX512_BF16 or AVX2.

    python scripts/bf16_matmul_bench.py [--rows 1,4,16,64,512] [--against REV]

`--against REV` times the kernel of git revision REV instead of oneDNN, the two taking turns
pass by pass (--rounds of them), so both see the same load on a shared machine: the ratio of
their medians is the figure to trust there. Each pass runs the 120 layer matmuls and the LM
head in a model's order.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from kernel_at import build_at  # scripts/, beside this file

from engine.memory import pages
from engine.models import native
from engine.models.linear import Linear, pack_for_kernel

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer
LAYERS = 30
LM_HEAD = (49152, 576)


def median_ms(fn: Callable[[], object], reps: int = 11) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,128,256,512,1024",
                    help="comma-separated row counts")
    ap.add_argument("--against", metavar="REV", help="time the kernel of git revision REV "
                    "against the current one instead of oneDNN")
    ap.add_argument("--rounds", type=int, default=9, help="passes per kernel with --against")
    a = ap.parse_args()
    if not native.bf16_linear_built():
        raise SystemExit("this CPU or build has no bfloat16 matmul kernel: "
                         + native.status(torch.bfloat16))
    if a.against:
        return against(a.against, [int(r) for r in a.rows.split(",")], a.rounds)
    gen = torch.Generator().manual_seed(0)
    raw = [[torch.randn(o, i, generator=gen).bfloat16() for o, i in SHAPES]
           for _ in range(LAYERS)]
    onednn = [[Linear(w, pack=True) for w in layer] for layer in raw]
    ours = [[Linear(w, kernel=True) for w in layer] for layer in raw]
    flat = [lin for layer in ours for lin in layer]
    for lin, w in zip(flat, pages.gathered([lin.weight for lin in flat]), strict=True):
        lin.weight = w  # on 2 MiB pages in one buffer, as a model's are
    x = torch.randn(37, 576, generator=gen).bfloat16()
    exact = x.double() @ raw[0][2].double().T
    err = ((ours[0][2](x).double() - exact).abs() / exact.abs().clamp_min(1)).max().item()
    params = sum(o * i for o, i in SHAPES) * LAYERS
    print(f"{LAYERS * len(SHAPES)} layer matmuls of SmolLM2-135M ({params / 1e6:.0f}M weights), "
          f"bfloat16, {torch.get_num_threads()} threads; kernel's largest error against the "
          f"exact product {err:.1e} (relative, bfloat16 rounds at 3.9e-3)")
    print(" rows   oneDNN packed            kernel                   kernel / oneDNN   "
          "kernel, weights in cache")
    for m in (int(r) for r in a.rows.split(",")):
        xs = {i: torch.randn(m, i, generator=gen).bfloat16() for _, i in SHAPES}

        def run(lins: list[list[Linear]], xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in lins:
                for lin, (_, i) in zip(layer, SHAPES, strict=True):
                    lin(xs[i])

        t_onednn = median_ms(lambda: run(onednn))
        t_ours = median_ms(lambda: run(ours))
        t_warm = in_cache_ms(ours[0], xs)
        tf = 2 * m * params / 1e12
        print(f"{m:5d}   {t_onednn:8.2f} ms {tf / t_onednn * 1e3:5.2f} TFLOPS   "
              f"{t_ours:8.2f} ms {tf / t_ours * 1e3:5.2f} TFLOPS   {t_onednn / t_ours:5.2f}x   "
              f"        {t_warm:8.2f} ms {tf / t_warm * 1e3:5.2f} TFLOPS")


def in_cache_ms(layer: list[Linear], xs: dict[int, torch.Tensor], calls: int = 20) -> float:
    """A layer's matmuls, each called over and over on its own weights, which then stay in
    the caches, times LAYERS: the kernel's compute without the weights' trip from memory
    (ms). Beside the pass over all layers it shows how much of a pass the products take on
    top of the streaming; the streaming alone is about the one-row pass."""
    total = 0.0
    for lin, (_, i) in zip(layer, SHAPES, strict=True):
        def repeat(lin: Linear = lin, x: torch.Tensor = xs[i]) -> None:
            for _ in range(calls):
                lin(x)
        total += median_ms(repeat) / calls
    return LAYERS * total


def against(rev: str, rows: list[int], rounds: int) -> None:
    """The current kernel and the kernel at `rev` over the same packed weights, pass by pass."""
    build_at(rev, "bf16_gemm.cpp")
    ops = {rev: torch.ops.batchlens_ab.bf16_linear, "this": torch.ops.batchlens.bf16_linear}
    gen = torch.Generator().manual_seed(0)
    weights = [pack_for_kernel(torch.randn(o, i, generator=gen).bfloat16())
               for _ in range(LAYERS) for o, i in SHAPES]
    weights.append(pack_for_kernel(torch.randn(*LM_HEAD, generator=gen).bfloat16()))
    weights = pages.gathered(weights)  # on 2 MiB pages in one buffer, as a model's are
    nbytes = sum(w.numel() * 2 for w in weights)
    print(f"{len(weights)} matmuls of SmolLM2-135M (the layers and the LM head, "
          f"{nbytes / 1e6:.0f} MB), bfloat16, {torch.get_num_threads()} threads; medians of "
          f"{rounds} passes, the two kernels taking turns")
    for m in rows:
        xs = {i: torch.randn(m, i, generator=gen).bfloat16() for i in (576, 1536)}
        ins = [xs[w.shape[1] * 2] for w in weights]
        times: dict[str, list[float]] = {name: [] for name in ops}
        for op in ops.values():  # warm-up
            [op(x, w, None) for x, w in zip(ins, weights, strict=True)]
        for r in range(rounds):
            for name in list(ops) if r % 2 == 0 else list(ops)[::-1]:
                start = time.perf_counter()
                for x, w in zip(ins, weights, strict=True):
                    ops[name](x, w, None)
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(ts) * 1000 for name, ts in times.items()}
        cells = "   ".join(f"{name} {t:7.2f} ms {nbytes / t / 1e6:5.1f} GB/s"
                           for name, t in ms.items())
        print(f"{m:5d} rows   {cells}   {ms[rev] / ms['this']:.2f}x")


if __name__ == "__main__":
    main()
