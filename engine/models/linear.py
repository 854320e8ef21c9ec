"""Linear layers: bfloat16 by this project's kernel or oneDNN's packed weights, float32 by
`F.linear`.

bfloat16 goes to csrc/bf16_gemm.cpp (`native.bf16_linear`), whose weights are laid out
for one VDPBF16PS per 64-byte load (AVX512_BF16), two FMAs per 32-byte load on a CPU with
AVX2 only, where torch has no fast bfloat16 matmul, or, on a CPU with AMX, two B tiles per
32 K of a 32-output block. At the few rows of a decode step a matmul only streams its
weights once, and this layout streams them faster than oneDNN's packed one; at a prompt's
hundreds of rows the two are about equally fast (`python scripts/bf16_matmul_bench.py`;
figures in docs/benchmarks.md). A row's result does not depend on the other rows of the
batch, and no memory is kept per row count. `BATCHLENS_BF16_KERNEL=0` keeps oneDNN's
packed weights, which read faster than `F.linear` on plain row-major weights.

float32 keeps plain `F.linear`, whose sums match transformers' to the last bit, for every
layer but the LM head (`should_pack_lm_head`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# oneDNN (bfloat16 matmuls on a CPU) keeps a compiled primitive per matmul shape in two
# caches, its own and ideep's, 1,024 entries each by default, each entry holding memory that
# grows with the shape (~1 MiB at 512 x 3072): unbounded, a server meeting every row count
# grows by hundreds of MiB over minutes (docs/engine.md). Bounded here, with the row
# buckets (`engine.attention.common.row_bucket`) keeping the shapes a step meets few enough
# to stay cached. Read when oneDNN first runs; set either variable yourself to override.
ONEDNN_CACHE_ENTRIES = "64"
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
os.environ.setdefault("LRU_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)


class Linear:
    """y = x W^T + b, with W [out, in] as in a checkpoint."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool = False, kernel: bool = False) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        # kernel: the weight in csrc/bf16_gemm.cpp's layout [N/32, K/2, 32, 2]
        self.kernel = kernel and kernel_fits(weight, bias)
        self.packed = not self.kernel and pack and _packing_works(weight, bias)
        if self.kernel:
            self.weight = pack_for_kernel(weight)
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            rows = x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1 or rows.stride(0) % 2:
                rows = rows.contiguous()
            y = torch.ops.batchlens.bf16_linear(rows, self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepack on CPU in bfloat16 when this torch build has oneDNN."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available())


def pack_for_kernel(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [N/32, K/2, 32, 2]: one 128-byte row holds a pair of K for 32 outputs."""
    n, k = weight.shape
    return weight.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def kernel_fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The kernel's shapes: bfloat16, outputs a multiple of 32, inputs of 2."""
    n, k = weight.shape
    return (weight.dtype == torch.bfloat16 and n % 32 == 0 and k % 2 == 0
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())))


def should_pack_lm_head(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepack the LM head on CPU in float32 too: at 64 rows oneDNN's packed weights run it
    about twice as fast as MKL's `F.linear`. It is the last matmul, so its last-bit
    differences from `F.linear` reach only the logits, never a later layer."""
    return should_pack(device, torch.bfloat16) and dtype in (torch.bfloat16, torch.float32)


def _packing_works(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Pack only if this build's oneDNN ops exist and agree with F.linear on a probe."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype,
                            generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    want = F.linear(probe, weight, bias)
    return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
