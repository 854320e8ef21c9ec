"""The local-PC side: one user at a time, batch size 1, a contiguous KV reservation.

As llama.cpp-style runtimes do, the KV cache is one contiguous buffer reserved for the
whole context window (`n_ctx`) of the request being served; other users' requests wait
in a FIFO queue, and that wait counts in their TTFT.

The math is the engine's own: the contiguous buffer is the paged cache with its blocks
laid end to end, so the same `ModelRunner` and forward serve both sides::

    contiguous buffer of n_ctx slots = blocks 0, 1, 2, ... n_ctx/16-1 in order
    request using 37 tokens          -> block table [0, 1, 2]; slots 37..n_ctx-1 reserved, unused

With `speculative="ngram"` it decodes speculatively as the engine does (n-gram prompt
lookup, engine/speculative.py): the drafts and the last token are one short chunk on the
contiguous cache; rejected drafts' K/V lie past `num_computed_tokens` and are overwritten
later (the buffer is reserved whole, so nothing is freed).

Parallel sampling (`SamplingParams.n` > 1) runs as a single-user runtime with n slots
does (llama.cpp's `--parallel n`): n contiguous n_ctx reservations, one per candidate,
served one after another, each processing the prompt again into its own slot (nothing is
shared), each with its own generator seeded as on the engine
(`engine.config.candidate_params`). A finished candidate's slot keeps its K/V until the
request ends, so the memory held is n prompts' worth::

    n = 3   slot 0 = blocks 0 .. S-1   slot 1 = blocks S .. 2S-1   slot 2 = 2S .. 3S-1
            reserved 3 x n_ctx while the request is served; S = n_ctx / 16

With a device and model profile the local PC is *emulated*: it still computes real tokens
with the bundled model but releases them no faster than the roofline projection for that
pair ("a 7B model on an RTX 4060 laptop"), and labels its outputs so.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from engine.config import SamplingParams
from engine.core import Candidate, Request, request_output
from engine.models.loaded import LoadedModel
from engine.outputs import append_token, make_output
from engine.runner import ModelRunner
from engine.sequence import Status
from engine.serving import ALL_STEPS, ServingBase, ServingStats, check_fit
from engine.speculative import SpecDecodeStats, Speculation, append_verified, draft_limit

DEFAULT_N_CTX = 2048  # the local PC's context window, reserved whole per request
LOCAL_BLOCK = 16
PREFILL_CHUNK = 512  # llama.cpp's default micro-batch for prompt processing


class Pacing(Protocol):
    """A projected device speed that local tokens are released no faster than (see
    `measure.hardware.Emulation`)."""

    label: str

    def prefill_seconds(self, prompt_tokens: int) -> float: ...

    def decode_seconds(self, context: int) -> float: ...


class Release:
    """When a paced request's next tokens may go out: the first once the projected device
    would have processed the prompt, each later one the projected decode time after the
    one before. A step slower than the projection is not paid for twice: the next token is
    due a decode time after the slow one went out, not earlier to catch up."""

    def __init__(self, pace: Pacing, prompt_tokens: int, start: float) -> None:
        self.pace = pace
        self.at = start + pace.prefill_seconds(prompt_tokens)
        self._first = True

    def due(self, contexts: range) -> float:
        """The time the tokens decoded at these contexts may go out (the first token, which
        ends the prefill, is due at `at` whatever its context)."""
        if not self._first:
            self.at += sum(self.pace.decode_seconds(c) for c in contexts)
        self._first = False
        return self.at

    def sent(self, now: float) -> None:
        """The tokens went out at `now` (no earlier than `due`)."""
        self.at = max(self.at, now)


class LocalPC(ServingBase):
    """One user at a time; the same surface as `Engine` (`engine.serving.ServingSide`)."""

    _id_prefix = "local"

    def __init__(
        self, loaded: LoadedModel | None = None, *, n_ctx: int = DEFAULT_N_CTX,
        pacing: Pacing | None = None, model: str | None = None, device: str = "auto",
        dtype: str = "auto", speculative: str | None = None, num_speculative_tokens: int = 4,
        prompt_lookup_min: int = 2, prompt_lookup_max: int = 4,
    ) -> None:
        if not isinstance(n_ctx, int) or n_ctx < 2:
            raise ValueError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
        self.speculation = Speculation.of(speculative, num_speculative_tokens,
                                          prompt_lookup_min, prompt_lookup_max)
        self.spec_decode = SpecDecodeStats()
        self.pacing = pacing
        self.loaded = loaded or LoadedModel.load(model, device, dtype)
        arch = self.loaded.model.arch
        if n_ctx > arch.max_position_embeddings:
            raise ValueError(
                f"n_ctx must be <= the model context of {arch.max_position_embeddings}, "
                f"got {n_ctx}")
        self.n_ctx = n_ctx
        self.kv_bytes_per_token = arch.kv_bytes_per_token(self.loaded.model.dtype)
        self.slot_blocks = -(-n_ctx // LOCAL_BLOCK)  # one n_ctx reservation
        self.num_slots = 1
        self.runner = self._make_runner(1)
        self._queue: deque[Request] = deque()
        self._current: Request | None = None
        self._num_finished = self._num_output_tokens = 0
        self._start_loop(self._loop, "batchlens-local")

    # ---- public API ----------------------------------------------------------------
    def stats(self, steps_after: float | None = ALL_STEPS) -> ServingStats:
        """What is being served and queued, and the KV memory reserved for it (the local
        side records no per-step timeline, so `steps_after` is accepted and unused)."""
        with self._cond:
            cur = self._current
            # every candidate's slot holds its K/V until the request ends
            used = sum(c.seq.num_computed_tokens for c in cur.candidates) if cur else 0
            slots = len(cur.candidates) if cur is not None else 0
            per_token = self.kv_bytes_per_token
            return ServingStats(
                **self._model_figures(),
                num_running=int(cur is not None),
                num_waiting=len(self._queue),
                running_ids=(cur.request_id,) if cur is not None else (),
                waiting_ids=tuple(r.request_id for r in self._queue),
                num_finished=self._num_finished,
                num_output_tokens=self._num_output_tokens,
                kv_bytes_per_token=per_token,
                kv_reserved_bytes=slots * self.n_ctx * per_token,
                kv_used_bytes=used * per_token,
                max_num_running=1,
                n_ctx=self.n_ctx,
                emulated=self.pacing.label if self.pacing else None,
                spec_decode=self.spec_decode.copy() if self.speculation is not None else None,
            )

    def shutdown(self) -> None:
        self._stop_loop()
        with self._cond:
            while self._queue:
                self._finish(self._queue.popleft(), "cancelled")
        self.runner.release_kv()  # a finished race kept on screen holds no reservation

    # ---- internals -----------------------------------------------------------------
    def _make_runner(self, slots: int) -> ModelRunner:
        runner = ModelRunner(self.loaded.model, slots * self.slot_blocks, LOCAL_BLOCK)
        runner.speculative = self.speculation is not None
        return runner

    def _reserve_slots(self, slots: int) -> None:
        """Size the KV buffer to `slots` n_ctx reservations (one per candidate), as a
        runtime started with that many slots holds them; the old buffer goes first."""
        if slots != self.num_slots:
            self.runner.release_kv()
            self.num_slots = 0  # none, should the new buffer fail to allocate
            self.runner = self._make_runner(slots)
            self.num_slots = slots

    def _check_fits(self, token_ids: list[int], p: SamplingParams) -> None:
        check_fit(len(token_ids), p.max_tokens, self.n_ctx, "context window (n_ctx)")

    def _enqueue(self, request: Request) -> None:
        request.seq.siblings = []  # served one after another: nothing forks from candidate 0
        self._queue.append(request)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._queue):
                    self._cond.wait()
                if self._stopped:
                    return
                request = self._queue.popleft()
                if request.request_id in self._cancels:
                    self._cancels.discard(request.request_id)
                    self._finish(request, "cancelled")
                    continue
                self._current = request
            self._serve(request)

    def _serve(self, request: Request) -> None:
        """Serve each candidate in turn; a cancel or a failure ends the rest with it."""
        reason, error = None, None
        try:
            self._reserve_slots(len(request.candidates))
        except Exception as exc:  # e.g. out of memory: this request fails, the queue goes on
            reason, error = "error", f"{type(exc).__name__}: {exc}"
        for cand in request.candidates if error is None else ():
            reason, error = self._serve_one(request, cand)
            if reason in ("cancelled", "error"):
                break
            with self._cond:
                self._finish_candidate(request, cand, reason)
        with self._cond:
            self._current = None
            self._finish(request, reason, error)

    def _serve_one(self, request: Request, cand: Candidate) -> tuple[str, str | None]:
        """Prefill, then decode one token per step, alone on the machine; the finish
        reason and error."""
        seq, detok = cand.seq, cand.detok
        handle = request.handle.candidate(cand.index) if request.handle is not None else None
        gens = {seq.request_id: cand.generator}
        per = self.slot_blocks  # candidate i's own slot
        table = {seq.request_id: list(range(cand.index * per, (cand.index + 1) * per))}
        eos = self.loaded.eos_token_ids
        seq.status = Status.RUNNING
        start = seq.metrics.first_scheduled_time = time.monotonic()
        release = (Release(self.pacing, len(seq.prompt_token_ids), start)
                   if self.pacing else None)
        proposer = self.speculation.proposer() if self.speculation is not None else None
        reason, error = None, None
        try:
            while reason is None:
                with self._cond:
                    if request.request_id in self._cancels:
                        self._cancels.discard(request.request_id)
                        reason = "cancelled"
                        break
                n = min(seq.num_remaining, PREFILL_CHUNK)
                if proposer is not None and n == 1:
                    seq.spec_token_ids = proposer.propose(seq.token_ids,
                                                          draft_limit(seq, self.n_ctx))
                    n += len(seq.spec_token_ids)
                sampled = self.runner.execute([(seq, n)], table, gens)
                if not sampled:
                    with self._cond:
                        seq.num_computed_tokens += n
                    continue
                tokens = sampled[0] if isinstance(sampled[0], list) else [sampled[0]]
                if release is not None:
                    due = release.due(range(seq.num_tokens, seq.num_tokens + len(tokens)))
                    delay = due - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                before, now = len(seq.output_token_ids), time.monotonic()
                if release is not None:
                    release.sent(now)
                if seq.spec_token_ids:
                    self.spec_decode.observe(len(seq.spec_token_ids), len(tokens) - 1)
                    reason = append_verified(seq, tokens, now, detok, eos, self.n_ctx)
                else:
                    with self._cond:
                        seq.num_computed_tokens += n
                    reason = append_token(seq, tokens[0], now, detok, eos, self.n_ctx)
                self._num_output_tokens += len(seq.output_token_ids) - before
                if reason is None and handle is not None:
                    handle._push(detok.delta(), len(seq.output_token_ids))
                    if handle is not request.handle:
                        request.handle._first.set()  # n > 1: the request's first token
        except Exception as exc:  # a failed request must not stop the queue
            reason, error = "error", f"{type(exc).__name__}: {exc}"
        return reason, error

    def _finish_candidate(self, request: Request, cand: Candidate, reason: str,
                          error: str | None = None) -> None:
        """End one candidate: its output, and its own handle's end for n > 1."""
        seq, detok = cand.seq, cand.detok
        seq.status = Status.FINISHED
        seq.finish_reason, seq.error = reason, error
        seq.metrics.finish_time = time.monotonic()
        label = self.pacing.label if self.pacing else None
        cand.output = make_output(seq, detok, reason, error, label)
        handle = request.handle
        if handle is not None and len(request.candidates) > 1:
            handle.candidate(cand.index)._finish(cand.output, detok.delta(final=True))

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End the request: the candidates not finished yet end with `reason`."""
        for cand in request.candidates:
            if cand.output is None:
                self._finish_candidate(request, cand, reason, error)
        self._num_finished += 1
        if request.handle is not None:
            delta = request.detok.delta(final=True) if len(request.candidates) == 1 else ""
            request.handle._finish(request_output(request), delta)
