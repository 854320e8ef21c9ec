"""The bfloat16 matmul kernel (csrc/bf16_gemm.cpp) against oneDNN's packed weights.

Times SmolLM2-135M's 120 layer matmuls (QKV, O, gate/up, down of 30 layers; random weights
far past the caches) at each row count both ways, through `engine.models.linear.Linear`:
oneDNN's packed weights (`pack=True`, what a bfloat16 step runs on CPUs with AMX or with
BATCHLENS_BF16_KERNEL=0) and the kernel (`kernel=True`). Prints ms, TFLOPS and the ratio, and
the kernel's largest error against the exact product. Needs a CPU with AVX512_BF16 or AVX2.

    python scripts/bf16_matmul_bench.py [--rows 1,4,16,64,512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.models import native
from engine.models.linear import Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer
LAYERS = 30


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
    a = ap.parse_args()
    if not native.bf16_linear_built():
        raise SystemExit("this CPU or build has no bfloat16 matmul kernel: "
                         + native.status(torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    raw = [[torch.randn(o, i, generator=gen).bfloat16() for o, i in SHAPES]
           for _ in range(LAYERS)]
    onednn = [[Linear(w, pack=True) for w in layer] for layer in raw]
    ours = [[Linear(w, kernel=True) for w in layer] for layer in raw]
    x = torch.randn(37, 576, generator=gen).bfloat16()
    exact = x.double() @ raw[0][2].double().T
    err = ((ours[0][2](x).double() - exact).abs() / exact.abs().clamp_min(1)).max().item()
    params = sum(o * i for o, i in SHAPES) * LAYERS
    print(f"{LAYERS * len(SHAPES)} layer matmuls of SmolLM2-135M ({params / 1e6:.0f}M weights), "
          f"bfloat16, {torch.get_num_threads()} threads; kernel's largest error against the "
          f"exact product {err:.1e} (relative, bfloat16 rounds at 3.9e-3)")
    print(" rows   oneDNN packed            kernel                   kernel / oneDNN")
    for m in (int(r) for r in a.rows.split(",")):
        xs = {i: torch.randn(m, i, generator=gen).bfloat16() for _, i in SHAPES}

        def run(lins: list[list[Linear]], xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in lins:
                for lin, (_, i) in zip(layer, SHAPES, strict=True):
                    lin(xs[i])

        t_onednn = median_ms(lambda: run(onednn))
        t_ours = median_ms(lambda: run(ours))
        tf = 2 * m * params / 1e12
        print(f"{m:5d}   {t_onednn:8.2f} ms {tf / t_onednn * 1e3:5.2f} TFLOPS   "
              f"{t_ours:8.2f} ms {tf / t_ours * 1e3:5.2f} TFLOPS   {t_onednn / t_ours:5.2f}x")


if __name__ == "__main__":
    main()
