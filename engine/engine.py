"""The datacenter engine: a step loop on a background thread serving many requests.

Each step is three calls: ``schedule()`` -> ``runner.execute(batch)`` -> ``_update()``.
`submit` is thread-safe and returns a streaming handle at once; `stats()` returns a copy
of a lock-protected snapshot. The engine thread never touches any UI.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import BlockInfo, KVCacheManager, KVCacheStats
from engine.metrics import RequestMetrics
from engine.models.loaded import LoadedModel, Prompt
from engine.outputs import RequestHandle
from engine.runner import ModelRunner
from engine.sampler import make_generator
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.serving import ServingBase
from engine.stopping import append_token, make_output

DEFAULT_CPU_KV_GB = 1.0
DEFAULT_GPU_KV_FRACTION = 0.4


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


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine, safe to read from any thread."""

    model: str
    device: str
    dtype: str
    dtype_reason: str
    num_running: int
    num_waiting: int
    running_ids: tuple[str, ...]
    waiting_ids: tuple[str, ...]
    kv: KVCacheStats
    num_preemptions: int
    num_steps: int
    num_finished: int
    num_output_tokens: int
    recent_steps: tuple[StepStats, ...] = field(default_factory=tuple)


class Engine(ServingBase):
    """Continuous batching over a paged KV cache. Use as a context manager or call
    `shutdown()` when done."""

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None):
        """Load the model (or share an already `loaded` model, whose model, device and
        dtype then take the place of the config's), size the KV pool, start the loop."""
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded or LoadedModel.load(config.model, config.device, config.dtype)
        spec = self.loaded.model.spec
        self.max_model_len = min(config.max_model_len or spec.max_position_embeddings,
                                 spec.max_position_embeddings)
        num_blocks = config.num_kv_blocks or self._blocks_for_budget()
        if num_blocks * config.block_size < 2:
            raise ValueError(
                f"num_kv_blocks: a pool of {num_blocks} x {config.block_size} tokens is too "
                "small for one request (needs >= 2 token slots)"
            )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.loaded.model, num_blocks, config.block_size)
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()
        self._seqs: dict[str, Sequence] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._gens: dict[str, torch.Generator | None] = {}
        self._state_lock = threading.Lock()
        self._steps: deque[StepStats] = deque(maxlen=16384)
        self._num_steps = self._num_finished = self._num_output_tokens = 0
        self._stopped = False
        self._start_loop(self._loop, "batchlens-engine")

    # ---- set-up --------------------------------------------------------------------
    def _blocks_for_budget(self) -> int:
        cfg, model = self.config, self.loaded.model
        per_block = model.spec.kv_bytes_per_token(model.dtype) * cfg.block_size
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            budget = free * DEFAULT_GPU_KV_FRACTION
        else:
            budget = DEFAULT_CPU_KV_GB * 2**30
        return max(int(budget // per_block), 1)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def pool_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    # ---- public API ----------------------------------------------------------------
    def stats(self, steps_after: float | None = float("-inf")) -> EngineStats:
        """Counters, KV usage and the recent steps that started after `steps_after`
        (a `time.monotonic()` stamp; None for no steps): pollers ask only for what is new,
        so the state lock is not held while thousands of old steps are copied."""
        with self._state_lock:
            sch = self.scheduler
            return EngineStats(
                model=self.loaded.name,
                device=str(self.loaded.model.device),
                dtype=str(self.loaded.model.dtype).removeprefix("torch."),
                dtype_reason=self.loaded.dtype_reason,
                num_running=len(sch.running),
                num_waiting=len(sch.waiting) + len(self._inbox),
                running_ids=tuple(s.request_id for s in sch.running),
                waiting_ids=tuple(s.request_id for s in sch.waiting)
                + tuple(s.request_id for s in self._inbox),
                kv=self.kv.stats(),
                num_preemptions=sch.num_preemptions,
                num_steps=self._num_steps,
                num_finished=self._num_finished,
                num_output_tokens=self._num_output_tokens,
                recent_steps=self._steps_after(steps_after),
            )

    def _steps_after(self, after: float | None) -> tuple[StepStats, ...]:
        if after is None:
            return ()
        if after == float("-inf"):
            return tuple(self._steps)
        new = []
        for step in reversed(self._steps):  # newest first; stop at the first old one
            if step.start <= after:
                break
            new.append(step)
        return tuple(reversed(new))

    def kv_snapshot(self) -> tuple[list[BlockInfo], KVCacheStats]:
        """Every block's state plus the stats at the same moment."""
        with self._state_lock:
            return self.kv.snapshot(), self.kv.stats()

    def shutdown(self) -> None:
        """Stop the step loop; unfinished requests end as cancelled."""
        self._stop_loop()
        with self._state_lock:
            for seq in list(self._seqs.values()) + self._inbox:
                self._finish(seq, "cancelled")
            self._inbox.clear()

    # ---- submission ----------------------------------------------------------------
    def _submit_many(
        self, prompts: list[Prompt], params: list[SamplingParams], ids: list[str | None]
    ) -> list[RequestHandle]:
        seqs = []
        for prompt, p, rid in zip(prompts, params, ids, strict=True):
            token_ids = self.loaded.encode(prompt)
            self._validate(token_ids, p)
            rid = rid or f"req-{next(self._ids)}"
            seq = Sequence(rid, token_ids, p, RequestMetrics(arrival_time=0.0))
            seqs.append(seq)
        handles = []
        with self._cond:
            if self._stopped:
                raise RuntimeError("engine is shut down")
            now = time.monotonic()
            for seq in seqs:
                seq.metrics.arrival_time = now
                h = RequestHandle(seq.request_id, seq.prompt_token_ids, self.cancel)
                self._handles[seq.request_id] = h
                self._detoks[seq.request_id] = IncrementalDetokenizer(
                    self.tokenizer, seq.params.stop)
                self._gens[seq.request_id] = make_generator(seq.params)
                self._inbox.append(seq)
                handles.append(h)
            self._cond.notify()
        return handles

    def _validate(self, token_ids: list[int], p: SamplingParams) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        limit = min(self.max_model_len, self.pool_tokens)
        if n >= limit:
            which = "model context" if self.max_model_len <= self.pool_tokens else "KV pool"
            raise ValueError(
                f"prompt: {n} tokens does not fit the {which} of {limit} tokens "
                f"(allowed: 1 to {limit - 1} tokens)"
            )
        if n + p.max_tokens > limit:
            raise ValueError(
                f"max_tokens: {p.max_tokens} plus a {n}-token prompt exceeds the limit of "
                f"{limit} tokens (allowed: 1 to {limit - n})"
            )

    # ---- the step loop -------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._inbox or self._cancels
                           or self.scheduler.has_work):
                    self._cond.wait()
                if self._stopped:
                    return
                with self._state_lock:
                    for seq in self._inbox:
                        self._seqs[seq.request_id] = seq
                        self.scheduler.add(seq)
                    self._inbox.clear()
                    cancels, self._cancels = self._cancels, set()
            with self._state_lock:
                for rid in cancels:
                    if rid in self._seqs:
                        self._finish(self._seqs[rid], "cancelled")
                batch = self.scheduler.schedule()
            if batch.is_empty:
                continue
            self._step(batch)

    def _step(self, batch: ScheduledBatch) -> None:
        start = time.monotonic()
        n_dec = sum(1 for s, n in batch.entries if n == 1 and s.num_remaining == 1)
        for seq, _ in batch.entries:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
        try:
            sampled = self.runner.execute(batch.entries, self.kv.block_tables, self._gens)
        except Exception as exc:  # fail only this step's requests; keep serving
            msg = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            with self._state_lock:
                for seq, _ in batch.entries:
                    self._finish(seq, "error", error=msg)
            return
        now = time.monotonic()
        with self._state_lock:
            kvs = self._update(batch, sampled, now)
            self._steps.append(StepStats(
                start=start, duration=now - start, num_seqs=len(batch.entries),
                num_prefill_tokens=batch.num_tokens - n_dec, num_decode_tokens=n_dec,
                num_preempted=batch.num_preempted, kv_usage=kvs.usage,
                kv_used_slots=kvs.used_slots, kv_reserved_slots=kvs.reserved_slots,
            ))
            self._num_steps += 1

    def _update(
        self, batch: ScheduledBatch, sampled: dict[int, int], now: float
    ) -> KVCacheStats:
        """Apply a step's results; return the KV stats as the step left them (before
        finished requests free their blocks)."""
        eos = self.loaded.eos_token_ids
        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            self.kv.record_computed(seq.request_id, seq.token_ids, seq.num_computed_tokens)
        kv_stats = self.kv.stats()
        for i, (seq, _) in enumerate(batch.entries):
            token = sampled.get(i)
            if token is None:
                continue
            self._num_output_tokens += 1
            detok = self._detoks[seq.request_id]
            reason = append_token(seq, token, now, detok, eos, self.max_model_len)
            if reason:
                self._finish(seq, reason)
            else:
                self._handles[seq.request_id]._push(detok.delta(), len(seq.output_token_ids))
        return kv_stats

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a request: free its blocks, hand the final output to its handle."""
        if seq.finished:
            return
        self.scheduler.finish(seq)
        seq.finish_reason, seq.error = reason, error
        seq.metrics.finish_time = time.monotonic()
        rid = seq.request_id
        self._seqs.pop(rid, None)
        detok = self._detoks.pop(rid)
        self._gens.pop(rid, None)
        handle = self._handles.pop(rid)
        self._num_finished += 1
        out = make_output(seq, detok, reason, error)
        handle._finish(out, detok.delta(final=True))
