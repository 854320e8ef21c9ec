"""The roofline of the machine the app runs on, for the model it serves: decode tokens/s over
batch sizes (`roofline`, drawn by the sweep page beneath its measured points) and the least
time a request mix could take (`mix_floor`, printed by the bench), from `measure.calibrate`
(measured bandwidth and matmul FLOP/s) and `measure.hardware.step_cost`, the one cost model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from measure import hardware
from measure.calibrate import Calibration


@dataclass(frozen=True)
class Roofline:
    """Projected decode tokens/s of this machine over batch sizes, and how it was made."""

    rows: list[dict[str, Any]]  # users, total, per_user, bound
    precision: str
    note: str


def model_profile_key(arch: Any) -> str | None:
    """The `measure.hardware` model profile with this architecture (a ModelArch), if any."""
    for m in hardware.MODELS.values():
        if (m.layers, m.hidden_size, m.num_kv_heads, m.head_dim) == (
                arch.num_layers, arch.hidden_size, arch.num_kv_heads, arch.head_dim):
            return m.key
    return None


def roofline(calibration: Calibration, model_key: str, dtype: torch.dtype,
             users: Sequence[int], context: int) -> Roofline:
    """Decode ceilings at each batch in `users` for weights and KV in `dtype`.

    measure/hardware.py knows 2-, 1- and 0.5-byte precisions. A 2-byte dtype is its "fp16";
    a 4-byte float32 is projected as "fp16" on half the measured bandwidth (reading 4 bytes
    at B GB/s takes as long as 2 bytes at B/2). The compute roof is the matmul TFLOPS
    measured in the engine's dtype.
    """
    name = str(dtype).removeprefix("torch.")
    nbytes = torch.empty(0, dtype=dtype).element_size()
    fp16 = hardware.PRECISIONS["fp16"]
    profile = machine_profile(calibration, dtype)
    tflops = profile.peak_tflops
    out = []
    for b in users:
        p = hardware.decode_tokens_per_s(model_key, "fp16", profile, b, context, fp16)
        out.append({"users": b, "total": p.total, "per_user": p.per_user, "bound": p.bound})
    if nbytes == fp16:
        note = (f"{name}: 2-byte weights and KV, projected as measure/hardware.py's fp16; "
                f"{calibration.bandwidth_gbs:.1f} GB/s and {tflops:.2f} TFLOPS ({name} "
                f"matmul) measured on this machine")
    else:
        note = (f"{name}: {nbytes}-byte weights and KV. measure/hardware.py has no {nbytes}-byte "
                f"precision, so this is fp16 on {profile.bandwidth_gbs:.1f} GB/s: the measured "
                f"{calibration.bandwidth_gbs:.1f} GB/s × 2/{nbytes} bytes; compute roof "
                f"{tflops:.2f} TFLOPS ({name} matmul, measured)")
    return Roofline(out, "fp16", f"{note}; context {context} tokens.")


def machine_profile(calibration: Calibration, dtype: torch.dtype) -> hardware.HardwareProfile:
    """This machine as an "fp16" profile for weights and KV in `dtype`: bandwidth scaled by
    2 / bytes per element, compute roof the matmul FLOP/s measured in `dtype`."""
    name = str(dtype).removeprefix("torch.")
    nbytes = torch.empty(0, dtype=dtype).element_size()
    base = hardware.this_machine_profile(calibration)
    return dataclasses.replace(
        base, bandwidth_gbs=base.bandwidth_gbs * hardware.PRECISIONS["fp16"] / nbytes,
        peak_tflops=calibration.tflops_by_dtype.get(name, base.peak_tflops))


@dataclass(frozen=True)
class MixFloor:
    """The least wall time one request mix can take on one device, by the roofline."""

    hardware: str  # the profile's name
    batched_s: float  # up to `concurrency` requests per step
    sequential_s: float  # one request at a time at batch 1, as on the local side
    output_tokens: int

    @property
    def ratio(self) -> float:
        """Batched over one-at-a-time output tokens/s, both at the roofline."""
        return self.sequential_s / self.batched_s


def mix_floor(prompt_lens: Sequence[int], output_lens: Sequence[int], concurrency: int,
              model: hardware.ModelProfile | str, hw: hardware.HardwareProfile | str) -> MixFloor:
    """Wall-time floors for requests that all arrive at once, with fp16 weights and KV.

    Batched: first come, first served, at most `concurrency` running; a request's whole
    prompt is computed in the step that admits it (which also yields its first token), then
    one token per step. Sequential: the same steps at batch 1, request after request. A
    step takes `hardware.step_cost` (matmul FLOPs only, no attention, no overheads) with
    every prompt token computed (no prefix cache), so the ratio is what batching alone can buy.
    """
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError("prompt_lens and output_lens must be non-empty and of one length")
    if min(prompt_lens) < 1 or min(output_lens) < 1:
        raise ValueError("prompt_lens and output_lens must be >= 1")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    m, h = hardware.get_model(model), hardware.get_hardware(hw)

    def step_s(tokens: int, logits: int, kv_tokens: int) -> float:
        return hardware.step_cost(m, "fp16", h, tokens, logits, kv_tokens).seconds

    sequential = 0.0
    for p, n in zip(prompt_lens, output_lens, strict=True):
        sequential += step_s(p, 1, p)  # the prompt, logits for its last token
        sequential += sum(step_s(1, 1, c) for c in range(p, p + n - 1))
    waiting = list(range(len(prompt_lens)))[::-1]
    running: dict[int, int] = {}  # request -> tokens in its context
    batched = 0.0
    while waiting or running:
        new = [waiting.pop() for _ in range(min(len(waiting), concurrency - len(running)))]
        prompts = sum(prompt_lens[i] for i in new)
        batched += step_s(len(running) + prompts, len(running) + len(new),
                          sum(running.values()) + prompts)
        running = {i: c + 1 for i, c in running.items()} | {i: prompt_lens[i] for i in new}
        running = {i: c for i, c in running.items()
                   if c - prompt_lens[i] + 1 < output_lens[i]}  # tokens out so far: c - p + 1
    return MixFloor(h.name, batched, sequential, sum(output_lens))


def user_grid(levels: Sequence[float], num: int = 41) -> list[int]:
    """Whole batch sizes spread evenly on a log scale from the smallest to the largest load."""
    lo, hi = max(1, int(min(levels))), max(1, int(max(levels)))
    if lo == hi:
        return [lo]
    return sorted({round(lo * (hi / lo) ** (i / (num - 1))) for i in range(num)})

