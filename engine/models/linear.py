"""Linear layers, with weights prepacked for oneDNN where that is faster.

On CPU in bfloat16, oneDNN's blocked weight layout (the one torch.compile's CPU backend
packs weights into) reads the weights faster than `F.linear` on plain row-major weights:
measured on the 2-core EPYC, the SmolLM2 matmuls of one decode step take 13.6 ms instead
of 18.3, and the packed path stays faster up to 256 rows. Results are bit-identical there.
float32 keeps plain `F.linear`, whose sums match transformers' to the last bit, for every
layer but the LM head (`should_pack_lm_head`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# oneDNN (bfloat16 matmuls on a CPU) keeps a compiled primitive per matmul shape in two
# caches, its own and ideep's, 1,024 entries each by default, each entry holding memory that
# grows with the shape (~1 MiB at 512 x 3072): a server meeting every row count grew by
# ~500 MiB in a 10-minute soak, and 600 row counts of one weight by ~600 MiB (2-core EPYC).
# Bounded here, with the runner's row buckets (`engine.runner.row_bucket`) keeping the
# shapes a step meets few enough to stay cached. Read when oneDNN first runs; set either
# variable yourself to override.
ONEDNN_CACHE_ENTRIES = "64"
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
os.environ.setdefault("LRU_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)


class Linear:
    """y = x W^T + b, with W [out, in] as in a checkpoint."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool = False) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = pack and _packing_works(weight, bias)
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepack on CPU in bfloat16 when this torch build has oneDNN."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available())


def should_pack_lm_head(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepack the LM head on CPU in float32 too: at 64 rows MKL's `F.linear` ran it at 39
    GFLOP/s on the 2-core EPYC, oneDNN's packed weights at 83. It is the last matmul, so
    its last-bit differences from `F.linear` reach only the logits, never a later layer."""
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
