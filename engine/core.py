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

Parallel sampling: a request with `SamplingParams.n` > 1 holds n `Candidate`s, each with
its own sequence, detokenizer, generator and drafts. The first one computes the prompt;
the step that ends it samples every candidate's first token from the prompt's last row
(engine/runner.py), and `update` then forks the others from it (engine/scheduler.py), so
the prompt's L tokens are computed once. Each candidate finishes on its own (an update
tagged with its index); the request ends when every candidate has. Forked candidates
share the prompt's blocks, and a shared partial block is copied on write: `execute`
copies the batch's (src, dst) blocks in the KV tensors before the model runs.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from engine import compute
from engine.config import SamplingParams, candidate_params
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import Matcher
from engine.kv_cache import KVCacheManager
from engine.metrics import RequestMetrics
from engine.outputs import RequestHandle, RequestOutput, append_token, make_output
from engine.sampler import make_generator
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
    ) -> dict[int, int | list[int]]:
        """Entry index -> sampled token; the candidates waiting in the `siblings` of an
        entry that completes its prompt come after the entries, under len(entries) + k."""
        ...


@dataclass(eq=False)
class Candidate:
    """One of a request's answers: its sequence, detokenizer, generator and drafts."""

    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None = None
    proposer: NgramProposer | None = None  # speculative decoding's drafts for it
    index: int = 0
    output: RequestOutput | None = None  # set when it has finished


class Request:
    """Everything the engine keeps about one request: its candidates (one unless
    `SamplingParams.n` > 1) and its handle. `seq`, `detok`, `generator` and `proposer` are
    candidate 0's."""

    def __init__(
        self, seq: Sequence, detok: IncrementalDetokenizer,
        generator: torch.Generator | None = None, handle: RequestHandle | None = None,
        proposer: NgramProposer | None = None, others: Seq[Candidate] = (),
        request_id: str | None = None,
    ) -> None:
        self.candidates = [Candidate(seq, detok, generator, proposer), *others]
        self.handle = handle  # set by the threaded engine; the core ignores it
        self.request_id = request_id or seq.request_id
        seq.siblings = [c.seq for c in others]

    @property
    def seq(self) -> Sequence:
        return self.candidates[0].seq

    @property
    def detok(self) -> IncrementalDetokenizer:
        return self.candidates[0].detok

    @property
    def generator(self) -> torch.Generator | None:
        return self.candidates[0].generator

    @property
    def proposer(self) -> NgramProposer | None:
        return self.candidates[0].proposer

    @property
    def finished(self) -> bool:
        return all(c.output is not None for c in self.candidates)


def candidate_id(request_id: str, index: int, n: int) -> str:
    """The sequence id of candidate `index` of `n`: the request's own id when n is 1."""
    return request_id if n == 1 else f"{request_id}#{index}"


def make_request(
    request_id: str, token_ids: list[int], params: SamplingParams, arrival_time: float,
    tokenizer: Any, grammar: Any = None,
) -> Request:
    """A request of `params.n` candidates, each seeded as `candidate_params` says; with a
    compiled `grammar` (its structured output's), each follows it with a matcher of its own."""
    cands = []
    for i in range(params.n):
        p = candidate_params(params, i)
        seq = Sequence(candidate_id(request_id, i, params.n), token_ids, p,
                       RequestMetrics(arrival_time=arrival_time),
                       matcher=Matcher(grammar) if grammar is not None else None)
        detok = IncrementalDetokenizer(tokenizer, p.stop, p.include_stop_str_in_output,
                                       p.skip_special_tokens)
        cands.append(Candidate(seq, detok, make_generator(p), index=i))
    first = cands[0]
    return Request(first.seq, first.detok, first.generator, others=cands[1:],
                   request_id=request_id)


def copy_blocks(kv_caches: Seq[tuple[torch.Tensor, torch.Tensor]],
                pairs: Seq[tuple[int, int]]) -> None:
    """Copy block src to block dst in every layer's K and V (copy on write). The KV
    tensors are laid out (kv_heads, num_blocks, block_size, head_dim): blocks on dim 1."""
    if not kv_caches:
        return
    dev = kv_caches[0][0].device  # every layer's tensors live on one device
    src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=dev)
    dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=dev)
    for k, v in kv_caches:
        k.index_copy_(1, dst, k.index_select(1, src))
        v.index_copy_(1, dst, v.index_select(1, src))


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
    """What one candidate of a request (the request itself when n is 1) produced in a
    step: new text, its token count, its final output when the step finished it, and
    the request's final output when that ended the request (for n = 1 the same)."""

    request: Request
    delta: str
    num_tokens: int
    output: RequestOutput | None = None
    index: int = 0  # the candidate's
    request_output: RequestOutput | None = None


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
        self.candidates: dict[str, Candidate] = {}  # sequence id -> its candidate
        self.owners: dict[str, Request] = {}  # sequence id -> its request
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
        self.requests[request.request_id] = request
        for cand in request.candidates:
            rid = cand.seq.request_id
            assert rid not in self.candidates, rid
            self.candidates[rid], self.owners[rid] = cand, request
            if self.speculation is not None and cand.proposer is None:
                cand.proposer = self.speculation.proposer()
            if cand.generator is not None:
                self.generators[rid] = cand.generator
        self.scheduler.add(request.seq)

    def abort(self, request_id: str) -> RequestUpdate | None:
        """End a request (every candidate) as cancelled and free its blocks; None if it
        is not here."""
        request = self.requests.get(request_id)
        return self._end(request, "cancelled") if request is not None else None

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
        """Run the batch on the model, after its copies on write; an exception fails only
        this step's requests."""
        start = time.monotonic()
        entries = batch.entries
        for seq, _ in entries[len(entries) - batch.num_admitted :]:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
        try:
            if batch.copies:
                self._copy(batch.copies)
            sampled = self.runner.execute(entries, self.kv.block_tables, self.generators)
        except Exception as exc:  # fail only this step's requests; keep serving
            traceback.print_exc()
            return ModelOutput(start, time.monotonic(), {}, f"{type(exc).__name__}: {exc}")
        return ModelOutput(start, time.monotonic(), sampled)

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst in the runner's tensors (a stand-in may hold none)."""
        caches = getattr(self.runner, "kv_caches", None)
        if caches:
            compute.run(copy_blocks, caches, pairs)

    def update(self, batch: ScheduledBatch, out: ModelOutput) -> list[RequestUpdate]:
        """Apply a step's results: computed tokens, sampled tokens, finished requests."""
        if out.error is not None:
            failed = dict.fromkeys(self.owners[s.request_id] for s, _ in batch.entries)
            return [self._end(r, "error", out.error) for r in failed]
        entries, record = batch.entries, self.kv.record_computed
        sampled, cands, end = out.sampled, self.candidates, out.end
        eos, max_len = self.eos_token_ids, self.max_model_len
        updates: list[RequestUpdate | None] = []
        finished: list[tuple[int, Candidate, str]] = []  # freed after the step's KV stats
        forking: list[Sequence] = []  # their prompt done: the other candidates fork now
        n_dec = n_tokens = n_draft = n_accepted = n_out = 0
        for i, (seq, n) in enumerate(entries):  # one pass: this runs for every request
            n_tokens += n
            if seq.spec_token_ids:  # a verification of drafts (speculative decoding)
                tokens = sampled[i]
                n_dec += 1
                n_draft += len(seq.spec_token_ids)
                n_accepted += len(tokens) - 1
                self.spec_decode.observe(len(seq.spec_token_ids), len(tokens) - 1)
                cand = cands[seq.request_id]
                before = len(seq.output_token_ids)
                reason = append_verified(seq, tokens, end, cand.detok, eos, max_len)
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
                cand = cands[seq.request_id]
                reason = append_token(seq, token, end, cand.detok, eos, max_len)
                n_out += 1
                if seq.siblings:
                    forking.append(seq)
            detok = cand.detok
            if reason:
                finished.append((len(updates), cand, reason))
                updates.append(None)
            else:
                updates.append(RequestUpdate(self.owners[seq.request_id], detok.delta(),
                                             len(seq.output_token_ids), index=cand.index))
                if cand.proposer is not None:  # the drafts the next step verifies
                    limit = draft_limit(seq, max_len)
                    if limit > 0:
                        seq.spec_token_ids = cand.proposer.propose(seq.token_ids, limit)
        key = len(entries)  # the forked candidates' tokens follow the entries'
        for seq in forking:
            for sib in self.scheduler.fork(seq):
                self._first_token(self.candidates[sib.request_id], sampled[key], end,
                                  updates, finished)
                key += 1
                n_out += 1
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
        for k, cand, reason in finished:
            updates[k] = self._finish(cand, reason)
        return updates  # type: ignore[return-value]  # every None was replaced

    def _first_token(self, cand: Candidate, token: int, end: float,
                     updates: list[RequestUpdate | None],
                     finished: list[tuple[int, Candidate, str]]) -> None:
        """A just-forked candidate's first token, as `update` takes any other token."""
        seq, max_len = cand.seq, self.max_model_len
        reason = append_token(seq, token, end, cand.detok, self.eos_token_ids, max_len)
        if reason:
            finished.append((len(updates), cand, reason))
            updates.append(None)
            return
        updates.append(RequestUpdate(self.owners[seq.request_id], cand.detok.delta(),
                                     len(seq.output_token_ids), index=cand.index))
        if cand.proposer is not None:
            limit = draft_limit(seq, max_len)
            if limit > 0:
                seq.spec_token_ids = cand.proposer.propose(seq.token_ids, limit)

    def _finish(self, cand: Candidate, reason: str, error: str | None = None) -> RequestUpdate:
        """End a candidate: free its blocks, build its final output, and the request's
        when it was the last one running."""
        seq = cand.seq
        rid = seq.request_id
        self.scheduler.finish(seq)
        seq.finish_reason, seq.error = reason, error
        seq.metrics.finish_time = time.monotonic()
        request = self.owners.pop(rid)
        del self.candidates[rid]
        self.generators.pop(rid, None)
        cand.output = make_output(seq, cand.detok, reason, error)
        update = RequestUpdate(request, cand.detok.delta(final=True),
                               len(seq.output_token_ids), cand.output, cand.index)
        if request.finished:
            del self.requests[request.request_id]
            self.num_finished += 1
            update.request_output = request_output(request)
        return update

    def _end(self, request: Request, reason: str, error: str | None = None) -> RequestUpdate:
        """End every candidate of a request still running; the update of the last one
        (which carries the request's output, every candidate's in it)."""
        update = None
        for cand in request.candidates:
            if cand.output is None:
                update = self._finish(cand, reason, error)
        assert update is not None and update.request_output is not None
        return update


def request_output(request: Request) -> RequestOutput:
    """A finished request's output: candidate 0's for n = 1; for n > 1 candidate 0's fields
    under the request's id, with every candidate's own output in `candidates`."""
    outs = [c.output for c in request.candidates]
    assert all(o is not None for o in outs)
    if len(outs) == 1:
        return outs[0]  # type: ignore[return-value]
    return replace(outs[0], request_id=request.request_id, candidates=outs)
