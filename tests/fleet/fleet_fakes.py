"""Fleet tests run on a fake step cost: fixed per step plus per sequence and per prompt
token, the shape the live engine's steps fit, with round numbers."""

from __future__ import annotations

from fleet.costs import LinearStepCost
from fleet.layouts import Layout


def fake_cost(fixed_ms: float = 10.0, per_seq_ms: float = 0.5,
              per_prompt_token_ms: float = 0.05) -> LinearStepCost:
    return LinearStepCost(fixed_ms / 1e3, per_seq_ms / 1e3, per_prompt_token_ms / 1e3, 0.0,
                          source="fake")


def fake_layout(num_blocks: int = 4096, max_num_seqs: int = 32, **kw: object) -> Layout:
    """A replica of about 32 / (10 + 16) ms = 1,200 decode tokens/s at full batch."""
    args = dict(name="fake", model="smollm2-135m", cost=fake_cost(), num_blocks=num_blocks,
                weights_bytes=4e9, max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    args.update(kw)
    return Layout(**args)  # type: ignore[arg-type]
