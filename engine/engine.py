"""The datacenter engine: the engine core stepped on a background thread, serving many
requests at once.

`submit` is thread-safe and returns a streaming handle at once; the loop moves submitted
requests and cancels into the `EngineCore` and steps it (schedule and update under the
state lock, the model's execute outside it); `stats()` returns a copy of a lock-protected
snapshot. The engine thread never touches any UI.

Cancels are applied between steps, so a cancelled request's blocks are free one step
after `cancel()` at most, even mid-prefill (a long prompt is prefilled in chunks of at
most `max_num_batched_tokens` tokens, one chunk per step).

Faults. An exception in the model's step fails only that step's requests (`EngineCore`);
the loop goes on. An exception anywhere else in the loop leaves the core's state unknown:
the loop stops, every request in flight ends with finish reason "error" naming the
failure, new submissions are refused, `stopped_reason` (and `ServingStats.stopped`) says
why, and `restart()` starts a fresh loop on the same weights and KV tensors.
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable, Iterable

import torch

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore, Request, RequestUpdate, StepStats, request_output
from engine.kv_cache import BlockInfo, KVCacheManager, KVCacheStats
from engine.memory.budget import GIB, MemoryBudget, check_pool_memory, memory_budget
from engine.models.loaded import LoadedModel
from engine.outputs import RequestOutput, make_output
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.serving import ALL_STEPS, ServingBase, ServingStats, check_fit
from engine.speculative import Speculation

DEFAULT_CPU_KV_GB = 1.0
DEFAULT_GPU_KV_FRACTION = 0.4
# the default CPU pool shrinks to the RAM free for it, but never below this many tokens
MIN_DEFAULT_KV_TOKENS = 16_384
LOOP_THREAD = "batchlens-engine"
CANCEL_LAGS_KEPT = 256

__all__ = ["Engine", "StepStats"]


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
        arch = self.loaded.model.arch
        self.max_model_len = min(config.max_model_len or arch.max_position_embeddings,
                                 arch.max_position_embeddings)
        # one reading of free memory both sizes a default pool and checks the pool
        free = memory_budget(str(self.loaded.model.device))
        num_blocks = config.num_kv_blocks or self._blocks_for_budget(free)
        if num_blocks * config.block_size < 2:
            raise ValueError(
                f"num_kv_blocks: a pool of {num_blocks} x {config.block_size} tokens is too "
                "small for one request (needs >= 2 token slots)"
            )
        check_pool_memory(num_blocks, config.block_size,  # refuse before allocating
                          arch.kv_bytes_per_token(self.loaded.model.dtype),
                          str(self.loaded.model.device), budget=free)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_attention)
        self.speculation = Speculation.from_config(config)
        self.runner = ModelRunner(self.loaded.model, num_blocks, config.block_size,
                                  max_num_seqs=config.max_num_seqs)
        self.runner.speculative = self.speculation is not None
        self.core = EngineCore(self.runner, self.kv, self.scheduler, self.loaded.tokenizer,
                               self.loaded.eos_token_ids, self.max_model_len,
                               self.speculation)
        self.kv_bytes_per_token = arch.kv_bytes_per_token(self.loaded.model.dtype)
        self._inbox: list[Request] = []
        self._state_lock = threading.Lock()
        self._finish_listeners: list[Callable[[RequestOutput], None]] = []
        self._step_listeners: list[Callable[[StepStats], None]] = []
        # request id -> the engine's step count when its cancel was asked for
        self._cancel_marks: dict[str, int] = {}
        self._cancel_lags: collections.deque[int] = collections.deque(maxlen=CANCEL_LAGS_KEPT)
        self._start_loop(self._run_loop, LOOP_THREAD)

    # ---- set-up --------------------------------------------------------------------
    def _blocks_for_budget(self, free: MemoryBudget | None) -> int:
        """The default pool's blocks: `kv_cache_memory_gb`, else 40% of free GPU memory,
        else 1 GiB of RAM, or what `free` leaves for it where less (not below the floor)."""
        cfg, model = self.config, self.loaded.model
        per_block = model.arch.kv_bytes_per_token(model.dtype) * cfg.block_size
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * GIB
        elif model.device.type == "cuda":
            assert free is not None  # memory_budget always reads a GPU's memory
            budget = free.available * DEFAULT_GPU_KV_FRACTION
        else:
            budget = DEFAULT_CPU_KV_GB * GIB
            floor = MIN_DEFAULT_KV_TOKENS // cfg.block_size * per_block
            if free is not None and floor <= free.limit < budget:
                budget = free.limit  # a busy machine: a smaller pool, not a refusal
        return max(int(budget // per_block), 1)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def pool_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    # ---- public API ----------------------------------------------------------------
    def stats(self, steps_after: float | None = ALL_STEPS) -> ServingStats:
        """Counters, KV usage and the recent steps that started after `steps_after`
        (a `time.monotonic()` stamp; None for no steps): pollers ask only for what is new,
        so the state lock is not held while thousands of old steps are copied."""
        with self._state_lock:
            sch, core, kv = self.scheduler, self.core, self.kv.stats()
            per_token = self.kv_bytes_per_token
            return ServingStats(
                **self._model_figures(),
                num_running=len(sch.running),
                num_waiting=len(sch.waiting) + len(self._inbox),
                running_ids=tuple(s.request_id for s in sch.running),
                waiting_ids=tuple(s.request_id for s in sch.waiting)
                + tuple(r.request_id for r in self._inbox),
                num_finished=core.num_finished,
                num_output_tokens=core.num_output_tokens,
                kv_bytes_per_token=per_token,
                kv_reserved_bytes=kv.used_blocks * kv.block_size * per_token,
                kv_used_bytes=self.kv.held_slots() * per_token,  # shared blocks once
                max_num_running=sch.max_num_seqs,
                num_preemptions=sch.num_preemptions,
                num_steps=core.num_steps,
                kv=kv,
                recent_steps=self._steps_after(steps_after),
                stopped=self.stopped_reason,
                spec_decode=core.spec_decode.copy() if self.speculation is not None else None,
            )

    def _steps_after(self, after: float | None) -> tuple[StepStats, ...]:
        steps = self.core.steps
        if after is None:
            return ()
        if after == ALL_STEPS:
            return tuple(steps)
        new = []
        for step in reversed(steps):  # newest first; stop at the first old one
            if step.start <= after:
                break
            new.append(step)
        return tuple(reversed(new))

    def add_finish_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """Call `listener(output)` for every request that ends from now on, whatever its
        source (a browser, the API, a workload). It runs on the engine thread: keep it cheap."""
        self._finish_listeners.append(listener)

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call `listener(step)` with the `StepStats` of every step the loop runs from now
        on (a step whose model call failed records none). It runs on the engine thread:
        keep it cheap."""
        self._step_listeners.append(listener)

    def cancel(self, request_id: str) -> None:
        """Stop a request; whatever it holds is freed before the next step begins."""
        with self._cond:
            self._cancel_marks.setdefault(request_id, self.core.num_steps)
        super().cancel(request_id)

    def cancel_lags(self) -> list[int]:
        """For the latest cancels of requests the engine held (oldest first): how many
        steps began between the cancel and the freeing of the request's blocks. The step
        running when a cancel arrives finishes first, so each is 0 or 1; a latency promise
        ("a closed tab frees its blocks at once") is tested in these, not in seconds."""
        with self._cond:
            return list(self._cancel_lags)

    def kv_snapshot(self) -> tuple[list[BlockInfo], KVCacheStats]:
        """Every block's state plus the stats at the same moment."""
        with self._state_lock:
            return self.kv.snapshot(), self.kv.stats()

    @property
    def stopped_reason(self) -> str | None:
        """None while the step loop serves; else why not ("shut down", or its failure)."""
        if self._stopped:
            return self._stop_reason
        return None if self._thread.is_alive() else "stopped: the engine loop has ended"

    def restart(self) -> bool:
        """Start the step loop again once it has stopped (a failure, or `shutdown`): fresh
        scheduler and block bookkeeping on the same weights and KV tensors, the counters
        and the step timeline kept. False, doing nothing, while the loop still runs. Every
        request that was in flight has ended already."""
        with self._cond:
            if self._thread.is_alive():
                return False
        self._fail_all("the engine was restarted")  # none are left; in case one slipped in
        cfg = self.config
        with self._state_lock:
            old = self.core
            self.kv = KVCacheManager(self.kv.num_blocks, self.kv.block_size,
                                     cfg.enable_prefix_caching)
            self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                       cfg.max_prefill_attention)
            self.scheduler.num_preemptions = old.scheduler.num_preemptions
            self.core = EngineCore(self.runner, self.kv, self.scheduler, self.loaded.tokenizer,
                                   self.loaded.eos_token_ids, self.max_model_len,
                                   self.speculation)
            self.core.steps, self.core.spec_decode = old.steps, old.spec_decode
            self.core.num_steps, self.core.num_finished, self.core.num_output_tokens = (
                old.num_steps, old.num_finished, old.num_output_tokens)
        with self._cond:
            self._stopped, self._stop_reason = False, ServingBase._stop_reason
            self._cancels.clear()
            self._cancel_marks.clear()
            self._thread = threading.Thread(target=self._run_loop, name=LOOP_THREAD,
                                            daemon=True)
            self._thread.start()
        return True

    def shutdown(self) -> None:
        """Stop the step loop; unfinished requests end as cancelled."""
        self._stop_loop()
        with self._state_lock:
            for request in self._inbox:
                self.core.add(request)
            self._inbox.clear()
            updates = [self.core.abort(rid) for rid in list(self.core.requests)]
        self._stream(u for u in updates if u is not None)

    # ---- submission ----------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        self._inbox.append(request)

    def _check_fits(self, token_ids: list[int], p: SamplingParams) -> None:
        limit = min(self.max_model_len, self.pool_tokens)
        where = "model context" if self.max_model_len <= self.pool_tokens else "KV pool"
        check_fit(len(token_ids), p.max_tokens, limit, where)
        if p.n > self.config.max_num_seqs:  # its candidates are admitted together
            raise ValueError(f"n: {p.n} candidates exceed max_num_seqs of "
                             f"{self.config.max_num_seqs} (allowed: 1 to "
                             f"{self.config.max_num_seqs})")

    # ---- the step loop -------------------------------------------------------------
    def _run_loop(self) -> None:
        """The loop; a failure outside a model step stops it (see the module's notes)."""
        try:
            self._loop()
        except Exception as exc:
            traceback.print_exc()
            reason = f"stopped: the engine loop failed ({type(exc).__name__}: {exc})"
            with self._cond:
                self._stopped, self._stop_reason = True, reason
            self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        """End every request still queued or in the core with finish reason "error" and
        `reason`; free their blocks where the core's state allows."""
        with self._cond, self._state_lock:
            requests, self._inbox = self._inbox, []
            self._cancels.clear()
            self._cancel_marks.clear()
            requests += list(self.core.requests.values())
        updates = []
        for request in requests:
            update = None
            with self._state_lock:
                try:
                    update = self.core.abort(request.request_id)
                except Exception:  # the core's state is broken: end the request as it is
                    self.core.requests.pop(request.request_id, None)
            if update is None or update.request_output is None:
                for cand in request.candidates:
                    if cand.output is None:
                        cand.output = make_output(cand.seq, cand.detok, "error", reason)
                update = RequestUpdate(request, "", len(request.seq.output_token_ids),
                                       request.candidates[0].output,
                                       request_output=request_output(request))
            for out in [update.request_output, *update.request_output.candidates]:
                out.finish_reason, out.error = "error", reason
            for cand in request.candidates:
                cand.seq.finish_reason, cand.seq.error = "error", reason
            updates.append(update)
        self._stream(updates)

    def _loop(self) -> None:
        core = self.core
        while True:
            with self._cond:
                while not (self._stopped or self._inbox or self._cancels or core.has_work):
                    self._cond.wait()
                if self._stopped:
                    return
                with self._state_lock:
                    for request in self._inbox:
                        core.add(request)
                    self._inbox.clear()
                cancels, self._cancels = self._cancels, set()
            with self._state_lock:
                updates = [core.abort(rid) for rid in cancels]
                batch = core.schedule()
            self._note_cancels(cancels, updates)
            self._stream(u for u in updates if u is not None)
            if batch.is_empty:
                continue
            out = core.execute(batch)
            with self._state_lock:
                num_steps = core.num_steps
                updates = core.update(batch, out)
                step = core.steps[-1] if core.num_steps > num_steps else None
            self._stream(updates)
            if step is not None:
                self._tell_step(step)

    def _note_cancels(self, cancels: Iterable[str], updates: list) -> None:
        """Record the step lag of each cancel that freed a request."""
        with self._cond:
            for rid, update in zip(cancels, updates, strict=True):
                mark = self._cancel_marks.pop(rid, None)
                if mark is not None and update is not None:
                    self._cancel_lags.append(self.core.num_steps - mark)

    def _tell_step(self, step: StepStats) -> None:
        """Hand one step's stats to the step listeners."""
        for listener in self._step_listeners:
            try:
                listener(step)
            except Exception:  # a broken listener must not stop the engine
                traceback.print_exc()

    def _stream(self, updates: Iterable[RequestUpdate]) -> None:
        """Hand each update to its candidate's streaming handle; finish the request's
        handle and tell the listeners when it ended."""
        for u in updates:
            handle = u.request.handle
            target = handle.candidate(u.index) if handle is not None else None
            if u.output is None:
                if target is not None:
                    target._push(u.delta, u.num_tokens)
                    if target is not handle:
                        handle._first.set()  # n > 1: the request's first token
                continue
            if target is not None and not target.done:
                target._finish(u.output, u.delta)
            if u.request_output is None:
                continue  # other candidates of the request still run
            if handle is not None:
                for child, out in zip(handle.candidates, u.request_output.answers,
                                      strict=True):
                    if not child.done:  # ended by a cancel or a failure with the request
                        child._finish(out)
                if not handle.done:
                    handle._finish(u.request_output)
            for listener in self._finish_listeners:
                try:
                    listener(u.request_output)
                except Exception:  # a broken listener must not stop the engine
                    traceback.print_exc()
