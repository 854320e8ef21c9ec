"""What happens when a token is sampled, shared by the engine and the local PC:
append it, time-stamp it, detokenize it, and decide whether the request is done."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput
from engine.sequence import Sequence


def append_token(
    seq: Sequence, token: int, now: float, detok: IncrementalDetokenizer,
    eos_token_ids: frozenset[int], max_model_len: int,
) -> str | None:
    """Record one sampled token; return a finish reason ("stop"/"length") or None."""
    seq.output_token_ids.append(token)
    seq.metrics.token_times.append(now)
    p = seq.params
    may_stop = len(seq.output_token_ids) > p.min_tokens  # vLLM's min_tokens
    if may_stop and (token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)):
        return "stop"
    detok.add(token)
    if detok.stopped:
        return "stop"
    if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def make_output(
    seq: Sequence, detok: IncrementalDetokenizer, reason: str, error: str | None = None,
    emulated: str | None = None,
) -> RequestOutput:
    """The final `RequestOutput` of a finished request."""
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=detok.text,
        finish_reason=reason,
        metrics=seq.metrics,
        error=error,
        num_cached_tokens=seq.num_cached_tokens,
        num_preemptions=seq.num_preemptions,
        emulated=emulated,
    )
