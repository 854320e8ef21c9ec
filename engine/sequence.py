"""A request's state inside the engine.

Progress is tracked only by `num_computed_tokens` against `num_tokens` (prompt plus
output so far), so chunked prefill, prefix-cache hits and preemption need no special
cases: a request needs `num_tokens - num_computed_tokens` more tokens computed, and is
sampled in the step where that reaches zero.

Speculative decoding adds `spec_token_ids`: drafts proposed for the positions after the
last token, computed in the same step as it (their K/V written past `num_tokens`) and
verified there; only accepted ones join `output_token_ids`, and `num_computed_tokens`
counts only verified tokens.

Log-probabilities, where the params ask for them, are recorded by the model runner as it
computes them: `logprobs` one per output token, `prompt_logprobs` one per prompt token
(the first None, set at creation; the list's length says which prompt tokens are done,
so a recompute after preemption records none twice).

A structured output (`SamplingParams.structured`) gives each sequence its own `matcher`,
which the sampler moves along the output to mask each step's logits (engine/grammar).

Parallel sampling (`SamplingParams.n` > 1) gives a request n sequences, its candidates.
Only the first is scheduled at first; the others wait in its `siblings` until it has
computed all of the prompt but the last token, then fork from it (engine/scheduler.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.config import SamplingParams
from engine.grammar import Matcher
from engine.metrics import RequestMetrics


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability under the raw distribution, its rank, and the top k."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id in the raw distribution (1 = argmax)
    top: tuple[tuple[int, float], ...]  # the top-k (token id, logprob), best first


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # one object per request: compared by identity (fast `in` / `remove`)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit on its latest admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    cancel_requested: bool = False
    spec_token_ids: list[int] = field(default_factory=list)  # drafts for the next step
    num_drafts: int = 0  # steps that verified drafts of this request
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts i accepted
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    siblings: list[Sequence] = field(default_factory=list)  # candidates not forked yet
    matcher: Matcher | None = None  # where its structured output is (`params.structured`)
    _all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs.append(None)  # the first prompt token: nothing predicts it

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt log-probabilities are asked for and some are not recorded yet: its prefill
        needs the logits of every prompt position (so it takes no prefix-cache hit)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output ids: one list, extended by the new outputs on each read
        instead of rebuilt (a step reads it for every request). Read it; never change it."""
        ids, n = self._all_token_ids, len(self.prompt_token_ids)
        if not ids:
            ids.extend(self.prompt_token_ids)
        if len(ids) < n + len(self.output_token_ids):
            ids.extend(self.output_token_ids[len(ids) - n :])
        return ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before this request can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
