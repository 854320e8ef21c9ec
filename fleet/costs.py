"""Step times: how long one engine step of a given shape takes on a replica.

A `StepCost` answers one question, the seconds of a step that computes `num_seqs`
sequences, `prefill_tokens` prompt tokens and `decode_tokens` decode tokens over
`context_tokens` tokens of KV cache. The replicas ask it once per simulated step (or once
per stretch of identical decode steps, at the stretch's mean context).

- `LinearStepCost`: fixed + per sequence + per prompt token + per context token, fitted
  (`fit_step_cost`) by least squares to the live engine's measured steps (`StepStats`),
  the model the bench prints for decode-only steps, with the prompt and KV terms added;
- `RooflineStepCost`: `measure.hardware.step_cost`, the one roofline cost model, with an
  efficiency and a fixed overhead per step, for hardware this machine is not;
- the datacenter projection's estimates come in through `fleet.projection`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.core import StepStats
from measure import hardware


class StepCost(Protocol):
    """Seconds of one engine step of this shape."""

    def step_seconds(self, num_seqs: int, prefill_tokens: int, decode_tokens: int,
                     context_tokens: int) -> float: ...


@dataclass(frozen=True)
class LinearStepCost:
    """t = fixed + per_seq x sequences + per_prompt_token x prompt tokens
    + per_context_token x tokens of KV cache."""

    fixed_s: float
    per_seq_s: float
    per_prompt_token_s: float = 0.0
    per_context_token_s: float = 0.0
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_seq_s", "per_prompt_token_s", "per_context_token_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0 s, got {getattr(self, name)!r}")
        if self.fixed_s + self.per_seq_s <= 0:
            raise ValueError("fixed_s + per_seq_s: a step must take some time")

    def step_seconds(self, num_seqs: int, prefill_tokens: int, decode_tokens: int,
                     context_tokens: int) -> float:
        return (self.fixed_s + self.per_seq_s * num_seqs
                + self.per_prompt_token_s * prefill_tokens
                + self.per_context_token_s * context_tokens)

    def describe(self) -> str:
        return (f"{self.fixed_s * 1e3:.1f} ms + {self.per_seq_s * 1e3:.2f} ms/sequence + "
                f"{self.per_prompt_token_s * 1e3:.3f} ms/prompt token + "
                f"{self.per_context_token_s * 1e6:.2f} µs/context token ({self.source})")


CONTEXT_GRAIN = 256  # tokens: the roofline step cost's lookup granularity
TERMS = ("fixed_s", "per_seq_s", "per_prompt_token_s", "per_context_token_s")


def fit_step_cost(steps: Sequence[StepStats], source: str = "fitted") -> LinearStepCost:
    """Least squares over measured steps: duration against 1, sequences, prompt tokens and
    KV slots in use (the context the step attended to). A term fitted below zero (noise on
    a small sample) is dropped and the rest refitted, so every cost stays >= 0."""
    if len(steps) < 4:
        raise ValueError(f"steps: at least 4 measured steps are needed to fit, got {len(steps)}")
    x = np.array([[1.0, s.num_seqs, s.num_prefill_tokens, s.kv_used_slots] for s in steps])
    y = np.array([s.duration for s in steps])
    keep = [i for i in range(4) if i == 0 or x[:, i].std() > 0]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        neg = [k for k, c in zip(keep, coef, strict=True) if c < 0 and k != 0]
        if not neg:
            break
        keep.remove(min(neg, key=lambda k: coef[keep.index(k)]))
    values = dict.fromkeys(TERMS, 0.0)
    for k, c in zip(keep, coef, strict=True):
        values[TERMS[k]] = max(float(c), 0.0)
    if values["fixed_s"] + values["per_seq_s"] <= 0:
        values["fixed_s"] = float(y.min())
    return LinearStepCost(**values, source=f"{source}, {len(steps)} steps")


@dataclass(frozen=True)
class RooflineStepCost:
    """`measure.hardware.step_cost` of `model` in `precision` on `hw`, divided by
    `efficiency`, plus `overhead_s` per step (launches, the host's scheduling)."""

    model: str
    hw: str
    precision: str = "fp16"
    efficiency: float = 0.6
    overhead_s: float = 0.002

    def __post_init__(self) -> None:
        hardware.get_model(self.model)
        hardware.get_hardware(self.hw)
        if self.precision not in hardware.PRECISIONS:
            raise ValueError(f"precision: one of {list(hardware.PRECISIONS)}, "
                             f"got {self.precision!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency: must be in (0, 1], got {self.efficiency!r}")

    def step_seconds(self, num_seqs: int, prefill_tokens: int, decode_tokens: int,
                     context_tokens: int) -> float:
        # the context is rounded to CONTEXT_GRAIN tokens so that repeated shapes are
        # looked up, not recomputed: a day of steps asks for a few thousand shapes
        grain = -(-max(context_tokens, 0) // CONTEXT_GRAIN) * CONTEXT_GRAIN
        return self._seconds(num_seqs, prefill_tokens + decode_tokens, grain)

    @functools.lru_cache(maxsize=65536)  # noqa: B019  (frozen, hashable, few instances)
    def _seconds(self, num_seqs: int, tokens: int, context_tokens: int) -> float:
        tokens = max(tokens, 1)
        cost = hardware.step_cost(self.model, self.precision, self.hw, tokens,
                                  min(num_seqs, tokens), context_tokens)
        return cost.seconds / self.efficiency + self.overhead_s

    def describe(self) -> str:
        return (f"roofline of {self.model} {self.precision} on {self.hw} at "
                f"{self.efficiency:.0%} efficiency + {self.overhead_s * 1e3:.1f} ms per step")
