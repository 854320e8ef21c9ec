"""The one adapter between the fleet and the datacenter projection (`measure.projection`):
a projected serving layout (model, system, backend, TP x PP, dtype) as a fleet `Layout`,
its step times from the projection's measured kernels.

A simulated step is decode and prefill together (continuous batching mixes them); the
projection prices the two apart, so a mixed step costs the decode step of its decoding
sequences plus the prefill of its prompt tokens. Shapes are rounded (context to
`CONTEXT_GRAIN`, prompt tokens to `PREFILL_GRAIN`) so that the projection's caches answer
most steps of a day.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.layouts import DEFAULT_BLOCK_SIZE, Layout
from measure import projection

CONTEXT_GRAIN = 256
PREFILL_GRAIN = 64
IDLE_SHARE = 0.15  # idle power as a share of board power (an assumption)


def _up(x: float, grain: int) -> int:
    return max(grain, -(-int(x) // grain) * grain)


@dataclass(frozen=True)
class ProjectedStepCost:
    """Step seconds of one replica of `layout` by `measure.projection`."""

    layout: projection.Layout

    def step_seconds(self, num_seqs: int, prefill_tokens: int, decode_tokens: int,
                     context_tokens: int) -> float:
        t = 0.0
        if decode_tokens:
            ctx = _up(context_tokens / max(num_seqs, 1), CONTEXT_GRAIN)
            t += projection.decode_step_seconds(self.layout, decode_tokens, ctx)
        if prefill_tokens:
            prompts = max(num_seqs - decode_tokens, 1)
            tokens = _up(prefill_tokens, PREFILL_GRAIN)
            t += projection.prefill_seconds(self.layout, tokens, min(prompts, tokens))
        return t

    def describe(self) -> str:
        return f"{self.layout.label()}: {projection.source_note(self.layout)}"


def projected_layout(layout: projection.Layout, max_num_seqs: int = 256,
                     dollars_per_gpu_hour: float = 2.5) -> Layout:
    """A fleet replica of a projected layout: its KV pool, weights and board power as the
    projection gives them; `ValueError` with the projection's reason if it cannot run."""
    why = projection.check(layout)
    if not why.ok:
        raise ValueError(f"layout: {layout.label()}: {why.reason}")
    gpus = layout.gpus
    watts = projection.power_per_gpu_w(layout) * gpus
    profile = projection.get_model(layout.model).profile  # what the local PCs run
    return Layout(layout.label(), profile, ProjectedStepCost(layout),
                  projection.kv_capacity_blocks(layout, DEFAULT_BLOCK_SIZE),
                  projection.weights_bytes(layout), gpus=gpus, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=8192, busy_watts=watts, idle_watts=watts * IDLE_SHARE,
                  dollars_per_hour=dollars_per_gpu_hour * gpus)


# The projected layouts the page and `batchlens fleet` offer: (model, system, TP).
OFFERED = (("llama-3.1-8b", "h100_sxm", 1), ("llama-3.1-70b", "h100_sxm", 8),
           ("llama-3.1-70b", "h200_sxm", 4), ("llama-3.1-8b", "l40s", 1))


def offered_layouts() -> dict[str, projection.Layout]:
    """Label -> projected layout, for the choices; those that cannot run are left out."""
    out = {}
    for model, system, tp in OFFERED:
        lay = projection.Layout(model, system, "trtllm", tp=tp)
        if projection.check(lay).ok:
            out[lay.label()] = lay
    return out
