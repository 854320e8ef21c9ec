"""Beam search (vLLM's `use_beam_search`), as vLLM's server runs it: over the engine, one
token a step.

Each step sends every beam (the prompt and its tokens so far) to the engine as a request
for one token with the top 2 x width log-probabilities; each beam grows by each of those
tokens, and the `width` best of all of them by their summed log-probability go on. A beam
that takes an end-of-text token is set aside as finished. After `max_tokens` steps the
finished and the running beams are ranked by their summed log-probability over their
length (prompt included, the end token not) to the power `length_penalty`, and the
`width` best are the answers. The requests of one step run in one engine batch, beside
everyone else's, and the prefix cache holds each beam's prompt and earlier tokens, so a
step computes little more than each beam's last block.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.config import MAX_LOGPROBS, SamplingParams
from engine.outputs import RequestHandle, RequestOutput

MAX_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 x width log-probabilities


@dataclass(frozen=True)
class Beam:
    """One hypothesis: its tokens after the prompt and their summed log-probability."""

    token_ids: tuple[int, ...]
    logprob: float
    finished: bool = False  # ended on an end-of-text token (the last of `token_ids`)

    def score(self, prompt_len: int, length_penalty: float) -> float:
        """vLLM's ranking: the summed log-probability over the length to a power."""
        length = prompt_len + len(self.token_ids) - (1 if self.finished else 0)
        return self.logprob / max(length, 1) ** length_penalty


class Cancelled(Exception):
    """The client went away; the search stopped between steps."""


class StepFailed(Exception):
    """A step's request did not finish (the engine failed it, or is shutting down)."""

    def __init__(self, out: RequestOutput) -> None:
        super().__init__(f"a beam's step ended {out.finish_reason}: {out.error}")
        self.out = out


Submit = Callable[[list[list[int]], list[SamplingParams]], list[RequestHandle]]


def search(submit: Submit, prompt_ids: Sequence[int], width: int, max_tokens: int,
           length_penalty: float = 1.0, end_ids: frozenset[int] = frozenset(),
           cancelled: threading.Event | None = None, cache_salt: str | None = None
           ) -> list[Beam]:
    """The `width` best beams after `max_tokens` steps (fewer where every beam finished
    early), best first. `submit` queues requests at one moment (`Engine.submit_many`);
    `end_ids` finish a beam (empty: `ignore_eos`); `cancelled` set stops the search
    between steps (`Cancelled`)."""
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"beam width (n) must be in [1, {MAX_WIDTH}], got {width}")
    params = SamplingParams(max_tokens=1, logprobs=2 * width, ignore_eos=True,
                            cache_salt=cache_salt)
    prompt = list(prompt_ids)
    beams, finished = [Beam((), 0.0)], []

    def rank(beam: Beam) -> float:
        return beam.score(len(prompt), length_penalty)

    for _ in range(max_tokens):
        if cancelled is not None and cancelled.is_set():
            raise Cancelled
        handles = submit([prompt + list(b.token_ids) for b in beams], [params] * len(beams))
        outs = [h.result() for h in handles]
        grown = []
        for beam, out in zip(beams, outs, strict=True):
            for token, logprob in _top(out):
                child = Beam(beam.token_ids + (token,), beam.logprob + logprob,
                             finished=token in end_ids)
                (finished if child.finished else grown).append(child)
        beams = sorted(grown, key=rank, reverse=True)[:width]
        if not beams:
            break
    return sorted(finished + beams, key=rank, reverse=True)[:width]


def _top(out: RequestOutput) -> tuple[tuple[int, float], ...]:
    """The top log-probabilities of a one-token request's token (`StepFailed` where the
    request did not finish)."""
    if out.finish_reason not in ("stop", "length") or not out.logprobs:
        raise StepFailed(out)
    return out.logprobs[0].top
