"""What callers get back: `RequestOutput` (with the `TokenLogprob` entries of
log-probabilities when asked) and a streaming `RequestHandle`; and what happens when a
token is sampled (`append_token`, `make_output`).

Both the datacenter engine and the local PC return these types and share the token
logic: append the token, time-stamp it, detokenize it, and decide whether the request
is done. So the UI and the benchmark treat the two sides alike.

Parallel sampling (`SamplingParams.n` > 1): the request's `RequestOutput` has candidate
0's fields under the request's id, and `candidates`, every candidate's own output in
index order (empty for n = 1, so a caller reads `out.candidates or [out]`). Its handle
streams nothing itself: `handle.candidate(i)` is candidate i's own handle, streaming its
deltas; `result()` waits for every candidate.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.metrics import RequestMetrics
from engine.sequence import Sequence, TokenLogprob

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    error: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    emulated: str | None = None  # set when the local side is paced to a projected device
    num_drafts: int = 0  # speculative decoding: steps that verified drafts
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    accepted_per_position: tuple[int, ...] = ()  # [i]: drafts accepted at draft position i
    max_tokens: int | None = None  # the request's `SamplingParams.max_tokens`
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, when asked
    candidates: list[RequestOutput] = field(default_factory=list)  # n > 1: each one's own

    @property
    def answers(self) -> list[RequestOutput]:
        """Every candidate's output in index order: `[self]` for n = 1."""
        return self.candidates or [self]

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft

    @property
    def tpot(self) -> float | None:
        return self.metrics.tpot

    @property
    def e2e(self) -> float | None:
        return self.metrics.e2e


class RequestHandle:
    """A submitted request: iterate for text deltas, `result()` for the final output.

    The engine thread feeds it; any number of consumer threads may hold handles.
    `token_logprobs` is the sequence's own list of output-token log-probabilities (empty
    when not asked): each token's entry is appended before its text and count are pushed,
    so `token_logprobs[sent:num_tokens]` after a poll is complete. `prompt_logprobs` is the
    sequence's list for the prompt's tokens (None when not asked), complete by the time
    the first token is pushed. `token_ids` is the sequence's own list of output token ids,
    appended to before a token's text and count are pushed (`token_ids[sent:num_tokens]`
    likewise).
    """

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], cancel: Callable[[str], None],
        token_logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        token_ids: list[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = token_ids if token_ids is not None else []
        self.token_logprobs: list[TokenLogprob] = (
            token_logprobs if token_logprobs is not None else [])
        self.prompt_logprobs = prompt_logprobs
        self._cancel = cancel
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._first = threading.Event()  # set at the first token (or the end)
        self._output: RequestOutput | None = None
        self.text = ""  # text handed out so far by iteration / poll
        self.num_tokens = 0
        self._wake: Callable[[], None] | None = None
        self.candidates: list[RequestHandle] = [self]  # n > 1: each candidate's own handle

    def candidate(self, index: int) -> RequestHandle:
        """Candidate `index`'s handle (for n = 1, candidate 0 is this handle); cancelling
        one cancels the whole request."""
        return self.candidates[index]

    # ---- engine side ---------------------------------------------------------------
    def _push(self, delta: str, num_tokens: int) -> None:
        self._events.put((delta, num_tokens))
        if not self._first.is_set():  # set() takes a lock: once per request is enough
            self._first.set()
        if self._wake is not None:
            self._wake()

    def _finish(self, output: RequestOutput, last_delta: str = "") -> None:
        self._output = output
        self._events.put((last_delta, len(output.token_ids)))
        self._events.put(None)
        self._first.set()
        self._done.set()
        if self._wake is not None:
            self._wake()

    # ---- consumer side -------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def on_progress(self, wake: Callable[[], None]) -> None:
        """Call `wake()` after every push and at the end from now on, on the feeding
        thread: a consumer that waits on many handles at once is told instead of polling.
        `wake` must return at once and not raise; a later call replaces it (a handle has
        one consumer)."""
        self._wake = wake

    def cancel(self) -> None:
        """Ask the engine to stop this request; its blocks are freed at the next step."""
        if not self.done:
            self._cancel(self.request_id)

    def wait_first_token(self, timeout: float | None = None) -> bool:
        """Block until the first token (or the end); False if `timeout` passed first."""
        return self._first.wait(timeout)

    def __iter__(self) -> Iterator[str]:
        while True:
            ev = self._events.get()
            if ev is None:
                return
            delta, n = ev
            self.num_tokens = n
            if delta:
                self.text += delta
                yield delta

    def poll(self) -> str:
        """Text produced since the last poll, without blocking."""
        out = []
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                break
            if ev is None:
                self._events.put(None)  # keep the end marker for iterators
                break
            delta, self.num_tokens = ev
            out.append(delta)
        text = "".join(out)
        self.text += text
        return text

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until finished; the final `RequestOutput`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout}s")
        assert self._output is not None
        return self._output


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
    p = seq.params
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
        num_drafts=seq.num_drafts,
        num_draft_tokens=seq.num_draft_tokens,
        num_accepted_tokens=seq.num_accepted_tokens,
        accepted_per_position=tuple(seq.accepted_per_position),
        max_tokens=seq.params.max_tokens,
        logprobs=list(seq.logprobs) if p.logprobs is not None else None,
        prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None,
    )
