"""The roofline of the machine the app runs on, for the model it serves: decode tokens/s in
total and per user over batch sizes, from `engine.calibrate` (measured bandwidth and matmul
FLOP/s) and `engine.hardware` (the projection). The sweep page draws it beneath its
measured points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine import hardware
from engine.calibrate import Calibration


@dataclass(frozen=True)
class Roofline:
    """Projected decode tokens/s of this machine over batch sizes, and how it was made."""

    rows: list[dict[str, Any]]  # users, total, per_user, bound
    precision: str
    note: str


def model_profile_key(spec: Any) -> str | None:
    """The `engine.hardware` model profile with this architecture (a ModelSpec), if any."""
    for m in hardware.MODELS.values():
        if (m.layers, m.hidden_size, m.num_kv_heads, m.head_dim) == (
                spec.num_layers, spec.hidden_size, spec.num_kv_heads, spec.head_dim):
            return m.key
    return None


def roofline(calibration: Calibration, model_key: str, dtype: torch.dtype,
             users: Sequence[int], context: int) -> Roofline:
    """Decode ceilings at each batch in `users` for weights and KV in `dtype`.

    engine/hardware.py knows 2-, 1- and 0.5-byte precisions. A 2-byte dtype is its "fp16";
    a 4-byte float32 is projected as "fp16" on half the measured bandwidth (reading 4 bytes
    at B GB/s takes as long as 2 bytes at B/2). The compute roof is the matmul TFLOPS
    measured in the engine's dtype.
    """
    name = str(dtype).removeprefix("torch.")
    nbytes = torch.empty(0, dtype=dtype).element_size()
    fp16 = hardware.PRECISIONS["fp16"]
    base = hardware.this_machine_profile(calibration)
    tflops = calibration.tflops_by_dtype.get(name, base.peak_tflops)
    profile = dataclasses.replace(base, bandwidth_gbs=base.bandwidth_gbs * fp16 / nbytes,
                                  peak_tflops=tflops)
    out = []
    for b in users:
        p = hardware.decode_tokens_per_s(model_key, "fp16", profile, b, context, fp16)
        out.append({"users": b, "total": p.total, "per_user": p.per_user, "bound": p.bound})
    if nbytes == fp16:
        note = (f"{name}: 2-byte weights and KV, projected as engine/hardware.py's fp16; "
                f"{calibration.bandwidth_gbs:.1f} GB/s and {tflops:.2f} TFLOPS ({name} "
                f"matmul) measured on this machine")
    else:
        note = (f"{name}: {nbytes}-byte weights and KV. engine/hardware.py has no {nbytes}-byte "
                f"precision, so this is fp16 on {profile.bandwidth_gbs:.1f} GB/s: the measured "
                f"{calibration.bandwidth_gbs:.1f} GB/s × 2/{nbytes} bytes; compute roof "
                f"{tflops:.2f} TFLOPS ({name} matmul, measured)")
    return Roofline(out, "fp16", f"{note}; context {context} tokens.")


def user_grid(levels: Sequence[float], num: int = 41) -> list[int]:
    """Whole batch sizes spread evenly on a log scale from the smallest to the largest load."""
    lo, hi = max(1, int(min(levels))), max(1, int(max(levels)))
    if lo == hi:
        return [lo]
    return sorted({round(lo * (hi / lo) ** (i / (num - 1))) for i in range(num)})

