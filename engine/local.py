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

from engine import hardware
from engine.config import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.metrics import RequestMetrics
from engine.models.session import ModelSession, Prompt
from engine.outputs import RequestHandle
from engine.runner import ModelRunner
from engine.sampler import make_generator
from engine.sequence import Sequence, Status
from engine.serving import ServingBase
from engine.stopping import append_token, make_output

LOCAL_BLOCK = 16
PREFILL_CHUNK = 512  # llama.cpp's default micro-batch for prompt processing


@dataclass(frozen=True)
class Emulation:
    """Projected speed of a (device, model) pair that local tokens are paced to."""

    device_profile: str
    model_profile: str
    precision: str

    @property
    def label(self) -> str:
        hw = hardware.get_hardware(self.device_profile)
        model = hardware.get_model(self.model_profile)
        return f"emulated: {model.name} {self.precision} on {hw.name} (projected)"

    def decode_seconds(self, context: int) -> float:
        proj = hardware.decode_tokens_per_s(
            self.model_profile, self.precision, self.device_profile, batch=1, context=context)
        return 1.0 / proj.per_user

    def prefill_seconds(self, prompt_tokens: int) -> float:
        return hardware.prefill_seconds(
            self.model_profile, self.precision, self.device_profile, prompt_tokens)


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


class LocalRunner(ServingBase):
    """Same surface as `Engine`: generate, submit (streaming handle), cancel, stats, shutdown."""

    def __init__(
        self, session: ModelSession | None = None, *, n_ctx: int = 2048,
        device_profile: str | None = None, model_profile: str | None = None,
        precision: str = "fp16", model: str | None = None, device: str = "auto",
        dtype: str = "auto",
    ) -> None:
        if not isinstance(n_ctx, int) or n_ctx < 2:
            raise ValueError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
        if (device_profile is None) != (model_profile is None):
            raise ValueError("device_profile and model_profile: give both or neither")
        self.emulation: Emulation | None = None
        if device_profile is not None:
            hardware.get_hardware(device_profile)  # raises ValueError naming the field
            hardware.get_model(model_profile)
            if precision not in hardware.PRECISIONS:
                raise ValueError(
                    f"precision: unknown {precision!r} (known: {', '.join(hardware.PRECISIONS)})")
            self.emulation = Emulation(device_profile, model_profile, precision)
        self.session = session or ModelSession.load(model, device, dtype)
        spec = self.session.model.spec
        if n_ctx > spec.max_position_embeddings:
            raise ValueError(
                f"n_ctx must be <= the model context of {spec.max_position_embeddings}, "
                f"got {n_ctx}")
        self.n_ctx = n_ctx
        self.kv_bytes_per_token = spec.kv_bytes_per_token(self.session.model.dtype)
        num_blocks = -(-n_ctx // LOCAL_BLOCK)
        self.runner = ModelRunner(self.session.model, num_blocks, LOCAL_BLOCK)
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
                model=self.session.name,
                device=str(self.session.model.device),
                n_ctx=self.n_ctx,
                kv_bytes_per_token=self.kv_bytes_per_token,
                running_id=cur.request_id if cur is not None else None,
                waiting_ids=tuple(s.request_id for s, _ in self._queue),
                kv_reserved_bytes=(self.n_ctx * self.kv_bytes_per_token) if cur else 0,
                kv_used_bytes=used * self.kv_bytes_per_token,
                num_finished=self._num_finished,
                num_output_tokens=self._num_output_tokens,
                emulated=self.emulation.label if self.emulation else None,
            )

    def shutdown(self) -> None:
        self._stop_loop()
        with self._cond:
            while self._queue:
                seq, handle = self._queue.popleft()
                self._finish(seq, handle, IncrementalDetokenizer(self.session.tokenizer),
                             "cancelled")

    # ---- internals -----------------------------------------------------------------
    def _submit_many(self, prompts: list[Prompt], params: list[SamplingParams],
                     ids: list[str | None]) -> list[RequestHandle]:
        seqs = []
        for prompt, p, rid in zip(prompts, params, ids, strict=True):
            token_ids = self.session.encode(prompt)
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
                    self._finish(seq, handle, IncrementalDetokenizer(self.session.tokenizer),
                                 "cancelled")
                    continue
                self._current = seq
            self._serve(seq, handle)

    def _serve(self, seq: Sequence, handle: RequestHandle) -> None:
        """Prefill, then decode one token per step, alone on the machine."""
        detok = IncrementalDetokenizer(self.session.tokenizer, seq.params.stop)
        gens = {seq.request_id: make_generator(seq.params)}
        table = {seq.request_id: list(range(self.runner.num_blocks))}
        eos = self.session.eos_token_ids
        seq.status = Status.RUNNING
        start = seq.metrics.first_scheduled_time = time.monotonic()
        release = start
        emu = self.emulation
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
        label = self.emulation.label if self.emulation else None
        handle._finish(make_output(seq, detok, reason, error, label), detok.delta(final=True))
