"""The local-PC side: one user at a time, batch size 1, a contiguous KV reservation.

As llama.cpp-style runtimes do, the KV cache is one contiguous buffer reserved for the
whole context window (`n_ctx`) of the request being served; other users' requests wait
in a FIFO queue, and that wait counts in their TTFT.

The math is the engine's own: the contiguous buffer is the paged cache with its blocks
laid end to end, so the same `ModelRunner` and forward serve both sides::

    contiguous buffer of n_ctx slots = blocks 0, 1, 2, ... n_ctx/16-1 in order
    request using 37 tokens          -> block table [0, 1, 2]; slots 37..n_ctx-1 reserved, unused

With a device and model profile the runner is *emulated*: it still computes real tokens
with the bundled model but releases them no faster than the roofline projection for that
pair ("a 7B model on an RTX 4060 laptop"), and labels its outputs so.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from engine.config import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.metrics import RequestMetrics
from engine.models.loaded import LoadedModel, Prompt
from engine.outputs import RequestHandle
from engine.runner import ModelRunner
from engine.sampler import make_generator
from engine.sequence import Sequence, Status
from engine.serving import ServingBase
from engine.stopping import append_token, make_output

LOCAL_BLOCK = 16
PREFILL_CHUNK = 512  # llama.cpp's default micro-batch for prompt processing


class Pacing(Protocol):
    """A projected device speed that local tokens are released no faster than (see
    `measure.hardware.Emulation`)."""

    label: str

    def prefill_seconds(self, prompt_tokens: int) -> float: ...

    def decode_seconds(self, context: int) -> float: ...


@dataclass(frozen=True)
class LocalStats:
    """A snapshot of the local side; KV figures in bytes."""

    model: str
    device: str
    n_ctx: int
    kv_bytes_per_token: int
    running_id: str | None
    waiting_ids: tuple[str, ...]
    kv_reserved_bytes: int
    kv_used_bytes: int
    num_finished: int
    num_output_tokens: int
    emulated: str | None

    @property
    def num_running(self) -> int:
        return int(self.running_id is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_ids)


class LocalPC(ServingBase):
    """Same surface as `Engine`: generate, submit (streaming handle), cancel, stats, shutdown."""

    def __init__(
        self, loaded: LoadedModel | None = None, *, n_ctx: int = 2048,
        pacing: Pacing | None = None, model: str | None = None, device: str = "auto",
        dtype: str = "auto",
    ) -> None:
        if not isinstance(n_ctx, int) or n_ctx < 2:
            raise ValueError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
        self.pacing = pacing
        self.loaded = loaded or LoadedModel.load(model, device, dtype)
        spec = self.loaded.model.spec
        if n_ctx > spec.max_position_embeddings:
            raise ValueError(
                f"n_ctx must be <= the model context of {spec.max_position_embeddings}, "
                f"got {n_ctx}")
        self.n_ctx = n_ctx
        self.kv_bytes_per_token = spec.kv_bytes_per_token(self.loaded.model.dtype)
        num_blocks = -(-n_ctx // LOCAL_BLOCK)
        self.runner = ModelRunner(self.loaded.model, num_blocks, LOCAL_BLOCK)
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._queue: deque[tuple[Sequence, RequestHandle]] = deque()
        self._cancels: set[str] = set()
        self._current: Sequence | None = None
        self._num_finished = self._num_output_tokens = 0
        self._stopped = False
        self._start_loop(self._loop, "batchlens-local")

    # ---- public API ----------------------------------------------------------------
    def stats(self) -> LocalStats:
        with self._cond:
            cur = self._current
            used = cur.num_computed_tokens if cur is not None else 0
            return LocalStats(
                model=self.loaded.name,
                device=str(self.loaded.model.device),
                n_ctx=self.n_ctx,
                kv_bytes_per_token=self.kv_bytes_per_token,
                running_id=cur.request_id if cur is not None else None,
                waiting_ids=tuple(s.request_id for s, _ in self._queue),
                kv_reserved_bytes=(self.n_ctx * self.kv_bytes_per_token) if cur else 0,
                kv_used_bytes=used * self.kv_bytes_per_token,
                num_finished=self._num_finished,
                num_output_tokens=self._num_output_tokens,
                emulated=self.pacing.label if self.pacing else None,
            )

    def shutdown(self) -> None:
        self._stop_loop()
        with self._cond:
            while self._queue:
                seq, handle = self._queue.popleft()
                self._finish(seq, handle, IncrementalDetokenizer(self.loaded.tokenizer),
                             "cancelled")

    # ---- internals -----------------------------------------------------------------
    def _submit_many(self, prompts: list[Prompt], params: list[SamplingParams],
                     ids: list[str | None]) -> list[RequestHandle]:
        seqs = []
        for prompt, p, rid in zip(prompts, params, ids, strict=True):
            token_ids = self.loaded.encode(prompt)
            if len(token_ids) + p.max_tokens > self.n_ctx:
                raise ValueError(
                    f"n_ctx: a {len(token_ids)}-token prompt plus max_tokens {p.max_tokens} "
                    f"does not fit the local context window of {self.n_ctx} tokens")
            seqs.append(Sequence(rid or f"local-{next(self._ids)}", token_ids, p,
                                 RequestMetrics(arrival_time=0.0)))
        handles = []
        with self._cond:
            if self._stopped:
                raise RuntimeError("local runner is shut down")
            now = time.monotonic()
            for seq in seqs:
                seq.metrics.arrival_time = now
                h = RequestHandle(seq.request_id, seq.prompt_token_ids, self.cancel)
                self._queue.append((seq, h))
                handles.append(h)
            self._cond.notify()
        return handles

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._queue):
                    self._cond.wait()
                if self._stopped:
                    return
                seq, handle = self._queue.popleft()
                if seq.request_id in self._cancels:
                    self._cancels.discard(seq.request_id)
                    self._finish(seq, handle, IncrementalDetokenizer(self.loaded.tokenizer),
                                 "cancelled")
                    continue
                self._current = seq
            self._serve(seq, handle)

    def _serve(self, seq: Sequence, handle: RequestHandle) -> None:
        """Prefill, then decode one token per step, alone on the machine."""
        detok = IncrementalDetokenizer(self.loaded.tokenizer, seq.params.stop)
        gens = {seq.request_id: make_generator(seq.params)}
        table = {seq.request_id: list(range(self.runner.num_blocks))}
        eos = self.loaded.eos_token_ids
        seq.status = Status.RUNNING
        start = seq.metrics.first_scheduled_time = time.monotonic()
        release = start
        emu = self.pacing
        if emu:
            release += emu.prefill_seconds(len(seq.prompt_token_ids))
        reason, error = None, None
        try:
            while reason is None:
                with self._cond:
                    if seq.request_id in self._cancels:
                        self._cancels.discard(seq.request_id)
                        reason = "cancelled"
                        break
                n = min(seq.num_remaining, PREFILL_CHUNK)
                sampled = self.runner.execute([(seq, n)], table, gens)
                with self._cond:
                    seq.num_computed_tokens += n
                if not sampled:
                    continue
                if emu:
                    release += emu.decode_seconds(seq.num_tokens) if seq.output_token_ids else 0
                    delay = release - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    release = max(release, time.monotonic())
                reason = append_token(seq, sampled[0], time.monotonic(), detok, eos, self.n_ctx)
                self._num_output_tokens += 1
                if reason is None:
                    handle._push(detok.delta(), len(seq.output_token_ids))
        except Exception as exc:  # a failed request must not stop the queue
            reason, error = "error", f"{type(exc).__name__}: {exc}"
        with self._cond:
            self._current = None
            self._finish(seq, handle, detok, reason, error)

    def _finish(self, seq: Sequence, handle: RequestHandle, detok: IncrementalDetokenizer,
                reason: str, error: str | None = None) -> None:
        seq.status = Status.FINISHED
        seq.metrics.finish_time = time.monotonic()
        self._num_finished += 1
        label = self.pacing.label if self.pacing else None
        handle._finish(make_output(seq, detok, reason, error, label), detok.delta(final=True))
