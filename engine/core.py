"""The engine core: continuous batching as a plain object, with no thread and no lock.

One step is three calls, and `step()` makes them in order::

    batch = core.schedule()          which requests run, how many tokens each
    out   = core.execute(batch)      the model's forward and sampling (never raises)
    done  = core.update(batch, out)  tokens appended, text decoded, finished requests freed

With speculative decoding (`speculation` set), `update` also proposes each continuing
request's drafts for the next step, and applies verifications (engine/speculative.py).

A test drives `add`, `abort` and `step()` directly with a stand-in model runner; the
threaded `engine.engine.Engine` wraps the same calls with an inbox, a lock and streaming
handles. Every request is one `Request` (its sequence, detokenizer and generator), so
finishing it is one removal from `requests`.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheManager
from engine.outputs import RequestHandle, RequestOutput, append_token, make_output
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.speculative import (
    NgramProposer,
    SpecDecodeStats,
    Speculation,
    append_verified,
    draft_limit,
)

MAX_RECORDED_STEPS = 16384
# With CUDA graphs for decode, new requests are admitted once 1/8 of the slots are free
# (a step with prompt tokens runs eagerly, so admitting one request per step as others
# finish would make nearly every step eager at high concurrency)
ADMIT_WAVE_DIVISOR = 8


class StepRunner(Protocol):
    """What the core needs of a model runner (`engine.runner.ModelRunner`, or a stand-in)."""

    def execute(
        self, entries: list[tuple[Sequence, int]], block_tables: dict[str, list[int]],
        generators: dict[str, torch.Generator | None],
    ) -> dict[int, int | list[int]]: ...


@dataclass(eq=False)
class Request:
    """Everything the engine keeps about one request."""

    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None = None
    handle: RequestHandle | None = None  # set by the threaded engine; the core ignores it
    proposer: NgramProposer | None = None  # speculative decoding's drafts for this request

    @property
    def request_id(self) -> str:
        return self.seq.request_id


@dataclass(frozen=True)
class StepStats:
    """One engine step, for the per-step timeline."""

    start: float
    duration: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_usage: float
    kv_used_slots: int
    kv_reserved_slots: int
    num_draft_tokens: int = 0  # speculative drafts verified in this step
    num_accepted_tokens: int = 0  # of those, accepted


@dataclass
class ModelOutput:
    """What `execute` produced: entry index -> sampled token (a verification: the accepted
    drafts, then one sampled token), or the error that failed it."""

    start: float
    end: float
    sampled: dict[int, int | list[int]]
    error: str | None = None


@dataclass(slots=True)
class RequestUpdate:
    """What one request produced in a step: new text, its token count, and its final
    output when the step finished it."""

    request: Request
    delta: str
    num_tokens: int
    output: RequestOutput | None = None


class EngineCore:
    """Scheduler, KV cache and model runner, stepped by the caller."""

    def __init__(
        self, runner: StepRunner, kv: KVCacheManager, scheduler: Scheduler, tokenizer: Any,
        eos_token_ids: frozenset[int], max_model_len: int,
        speculation: Speculation | None = None,
    ) -> None:
        self.runner, self.kv, self.scheduler = runner, kv, scheduler
        self.speculation = speculation
        self.spec_decode = SpecDecodeStats()
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.generators: dict[str, torch.Generator] = {}  # sampled requests' own generators
        self.steps: deque[StepStats] = deque(maxlen=MAX_RECORDED_STEPS)
        self.num_steps = self.num_finished = self.num_output_tokens = 0
        if getattr(runner, "graphs", None):  # decode-only steps replay CUDA graphs
            scheduler.min_admit_slots = max(1, scheduler.max_num_seqs // ADMIT_WAVE_DIVISOR)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, request: Request) -> None:
        """Queue a request (validated by the caller)."""
        assert request.request_id not in self.requests, request.request_id
        if self.speculation is not None and request.proposer is None:
            request.proposer = self.speculation.proposer()
        self.requests[request.request_id] = request
        if request.generator is not None:
            self.generators[request.request_id] = request.generator
        self.scheduler.add(request.seq)

    def abort(self, request_id: str) -> RequestUpdate | None:
        """End a request as cancelled and free its blocks; None if it is not here."""
        request = self.requests.get(request_id)
        return self._finish(request, "cancelled") if request is not None else None

    def step(self) -> list[RequestUpdate]:
        """Schedule, execute and update once; what each request produced."""
        batch = self.schedule()
        if batch.is_empty:
            return []
        return self.update(batch, self.execute(batch))

    # ---- the three calls ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        return self.scheduler.schedule()

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run the batch on the model; an exception fails only this step's requests."""
        start = time.monotonic()
        entries = batch.entries
        for seq, _ in entries[len(entries) - batch.num_admitted :]:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
        try:
            sampled = self.runner.execute(entries, self.kv.block_tables, self.generators)
        except Exception as exc:  # fail only this step's requests; keep serving
            traceback.print_exc()
            return ModelOutput(start, time.monotonic(), {}, f"{type(exc).__name__}: {exc}")
        return ModelOutput(start, time.monotonic(), sampled)

    def update(self, batch: ScheduledBatch, out: ModelOutput) -> list[RequestUpdate]:
        """Apply a step's results: computed tokens, sampled tokens, finished requests."""
        if out.error is not None:
            return [self._finish(self.requests[s.request_id], "error", out.error)
                    for s, _ in batch.entries]
        entries, record = batch.entries, self.kv.record_computed
        sampled, requests, end = out.sampled, self.requests, out.end
        eos, max_len = self.eos_token_ids, self.max_model_len
        updates: list[RequestUpdate | None] = []
        finished: list[tuple[int, Request, str]] = []  # freed after the step's KV stats
        n_dec = n_tokens = n_draft = n_accepted = n_out = 0
        for i, (seq, n) in enumerate(entries):  # one pass: this runs for every request
            n_tokens += n
            if seq.spec_token_ids:  # a verification of drafts (speculative decoding)
                tokens = sampled[i]
                n_dec += 1
                n_draft += len(seq.spec_token_ids)
                n_accepted += len(tokens) - 1
                self.spec_decode.observe(len(seq.spec_token_ids), len(tokens) - 1)
                request = requests[seq.request_id]
                before = len(seq.output_token_ids)
                reason = append_verified(seq, tokens, end, request.detok, eos, max_len)
                n_out += len(seq.output_token_ids) - before
                record(seq.request_id, seq.token_ids, seq.num_computed_tokens)
                if not reason:  # roll back: blocks past the verified tokens are freed
                    self.kv.truncate(seq.request_id, seq.num_computed_tokens)
            else:
                computed = seq.num_computed_tokens + n
                if n == 1 and computed == seq.num_tokens:
                    n_dec += 1  # a decode token: the request's last token, computed alone
                seq.num_computed_tokens = computed
                record(seq.request_id, seq.token_ids, computed)
                token = sampled.get(i)
                if token is None:
                    continue
                request = requests[seq.request_id]
                reason = append_token(seq, token, end, request.detok, eos, max_len)
                n_out += 1
            detok = request.detok
            if reason:
                finished.append((len(updates), request, reason))
                updates.append(None)
            else:
                updates.append(RequestUpdate(request, detok.delta(), len(seq.output_token_ids)))
                if request.proposer is not None:  # the drafts the next step verifies
                    limit = draft_limit(seq, max_len)
                    if limit > 0:
                        seq.spec_token_ids = request.proposer.propose(seq.token_ids, limit)
        self.num_output_tokens += n_out
        kvs = self.kv.stats()  # as the step left it, before finished requests free blocks
        self.steps.append(StepStats(
            start=out.start, duration=out.end - out.start, num_seqs=len(entries),
            num_prefill_tokens=n_tokens - n_dec - n_draft, num_decode_tokens=n_dec,
            num_preempted=batch.num_preempted, kv_usage=kvs.usage,
            kv_used_slots=kvs.used_slots, kv_reserved_slots=kvs.reserved_slots,
            num_draft_tokens=n_draft, num_accepted_tokens=n_accepted,
        ))
        self.num_steps += 1
        for k, request, reason in finished:
            updates[k] = self._finish(request, reason)
        return updates  # type: ignore[return-value]  # every None was replaced

    def _finish(self, request: Request, reason: str, error: str | None = None) -> RequestUpdate:
        """End a request: free its blocks, build its final output."""
        seq = request.seq
        self.scheduler.finish(seq)
        seq.finish_reason, seq.error = reason, error
        seq.metrics.finish_time = time.monotonic()
        del self.requests[seq.request_id]
        self.generators.pop(seq.request_id, None)
        self.num_finished += 1
        output = make_output(seq, request.detok, reason, error)
        return RequestUpdate(request, request.detok.delta(final=True),
                             len(seq.output_token_ids), output)
