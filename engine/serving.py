"""A serving side: the protocol every side speaks, its stats, and the shared base.

The datacenter engine and the local PC both queue requests for a background thread and
hand back streaming handles; workloads and pages speak only `ServingSide` and read only
`ServingStats`, so no caller tells the sides apart. A subclass of `ServingBase` provides
`_check_fits` (does a prompt fit its limits), `_enqueue` (under `_cond`), `stats` and
`shutdown`, and owns the `_cond` / `_cancels` its loop reads.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config import SamplingParams, check_vocab
from engine.core import Request, StepStats, make_request
from engine.grammar import Grammars
from engine.kv_cache import KVCacheStats
from engine.models.loaded import LoadedModel, Prompt
from engine.outputs import RequestHandle, RequestOutput
from engine.speculative import SpecDecodeStats

# The loop's compute thread gives the GIL up around every tensor op and must win it back
# from whatever else runs Python in the process (a page's script runs, a race's sampler).
# Python's default switch interval, 5 ms, is longer than most decode ops here; 0.5 ms hands
# the GIL back sooner. Set for the whole process, once a loop starts, so the page, the
# headless race and the bench all run under the same rule.
GIL_SWITCH_INTERVAL_S = float(os.environ.get("BATCHLENS_GIL_SWITCH_S", "0.0005"))


ALL_STEPS = float("-inf")


def busy_message(num_waiting: int) -> str:
    """What a refused request is told when the waiting queue is past its cap: the API's 429
    and the pages' refusals share this wording."""
    return f"busy: {num_waiting} waiting"


def check_fit(n: int, max_tokens: int, limit: int, where: str) -> None:
    """Raise `ValueError` naming the field and the allowed range when a prompt of `n`
    tokens plus `max_tokens` does not fit `limit` tokens (`where`: "KV pool", ...)."""
    if n == 0:
        raise ValueError("prompt must not be empty")
    if n >= limit:
        raise ValueError(f"prompt: {n} tokens does not fit the {where} of {limit} tokens "
                         f"(allowed: 1 to {limit - 1} tokens)")
    if n + max_tokens > limit:
        raise ValueError(f"max_tokens: {max_tokens} plus a {n}-token prompt exceeds the "
                         f"{where} of {limit} tokens (allowed: 1 to {limit - n})")


@dataclass(frozen=True)
class ServingStats:
    """A consistent snapshot of a serving side, safe to read from any thread. KV figures
    in bytes; `kv` (the paged pool's blocks) and `recent_steps` only where a side has
    them, `n_ctx` and `emulated` only on the local PC."""

    model: str
    device: str
    dtype: str
    dtype_reason: str
    num_running: int
    num_waiting: int
    running_ids: tuple[str, ...]
    waiting_ids: tuple[str, ...]
    num_finished: int
    num_output_tokens: int
    kv_bytes_per_token: int
    kv_reserved_bytes: int
    kv_used_bytes: int
    max_num_running: int = 0  # requests it serves at once (0: no known limit)
    num_preemptions: int = 0
    num_steps: int = 0
    kv: KVCacheStats | None = None
    recent_steps: tuple[StepStats, ...] = ()
    n_ctx: int | None = None
    emulated: str | None = None
    stopped: str | None = None  # why the side has stopped serving (None: it serves)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters (None: it is off)


class ServingSide(Protocol):
    """What workloads and pages may call on a side (the engine, the local PC, and later a
    remote OpenAI-compatible server)."""

    def submit(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestHandle: ...

    def submit_many(self, prompts: Seq[Prompt], params: Seq[SamplingParams],
                    request_ids: Seq[str | None] | None = None) -> list[RequestHandle]: ...

    def cancel(self, request_id: str) -> None: ...

    def check(self, prompt: Prompt, params: SamplingParams) -> list[int] | None:
        """The prompt's token ids if this side can serve it with `params` (None: it cannot
        tell before sending, as a remote server); `ValueError` naming the limit if not."""
        ...

    def stats(self, steps_after: float | None = ALL_STEPS) -> ServingStats: ...

    def shutdown(self) -> None: ...


class ServingBase:
    """Submission, cancel and the background loop's life, shared by both in-process sides."""

    loaded: LoadedModel
    _cond: threading.Condition
    _cancels: set[str]
    _stopped: bool
    _thread: threading.Thread
    _ids: itertools.count
    _id_prefix = "req"
    _stop_reason = "shut down"  # why `_stopped` is set: shut down, or the loop's failure

    def _model_figures(self) -> dict[str, str]:
        """The model, device and dtype fields of `ServingStats`."""
        m = self.loaded.model
        return {"model": self.loaded.name, "device": str(m.device),
                "dtype": str(m.dtype).removeprefix("torch."),
                "dtype_reason": self.loaded.dtype_reason}

    def _start_loop(self, target: Callable[[], None], name: str) -> None:
        """Set up what submit and cancel share with the loop, then start the background
        loop `target` on a daemon thread called `name`."""
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._cancels = set()
        self._stopped = False
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def _stop_loop(self) -> None:
        """Tell the background loop to end and wait for it."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise `ValueError` naming the limit when a request cannot be served."""
        raise NotImplementedError

    def _enqueue(self, request: Request) -> None:
        """Queue a request for the loop (called under `_cond`)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def check(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, if this side can serve it with `params`; else
        `ValueError` naming the limit (or what in its structured output does not compile)."""
        token_ids = self.loaded.encode(prompt)
        check_vocab(params, self.loaded.model.arch.vocab_size)
        self._check_fits(token_ids, params)
        self._grammar(params)
        return token_ids

    @functools.cached_property
    def _grammars(self) -> Grammars:
        """This side's grammar compiler (cheap until its first compile loads xgrammar)."""
        return Grammars(self.loaded.tokenizer, self.loaded.model.arch.vocab_size,
                        self.loaded.eos_token_ids)

    def _grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of `params.structured` (None without one)."""
        if params.structured is None:
            return None
        return self._grammars.compile(params.structured)

    def _submit_many(
        self, prompts: list[Prompt], params: list[SamplingParams], ids: list[str | None]
    ) -> list[RequestHandle]:
        """Encode and check every request first, then queue them all at one moment."""
        requests = []
        for prompt, p, rid in zip(prompts, params, ids, strict=True):
            token_ids = self.check(prompt, p)
            rid = rid or f"{self._id_prefix}-{next(self._ids)}"
            requests.append(make_request(rid, token_ids, p, 0.0, self.loaded.tokenizer,
                                         self._grammar(p)))
        handles = []
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"{type(self).__name__} is {self._stop_reason}")
            now = time.monotonic()
            for request in requests:
                for cand in request.candidates:
                    cand.seq.metrics.arrival_time = now
                request.handle = self._handle(request)
                self._enqueue(request)
                handles.append(request.handle)
            self._cond.notify()
        return handles

    def _handle(self, request: Request) -> RequestHandle:
        """A streaming handle for `request`; for n > 1 with one handle per candidate."""
        rid = request.request_id
        hs = [RequestHandle(c.seq.request_id if len(request.candidates) > 1 else rid,
                            c.seq.prompt_token_ids, lambda _id: self.cancel(rid),
                            token_logprobs=c.seq.logprobs, token_ids=c.seq.output_token_ids,
                            prompt_logprobs=(c.seq.prompt_logprobs
                                             if c.seq.params.prompt_logprobs is not None
                                             else None))
              for c in request.candidates]
        if len(hs) == 1:
            return hs[0]
        parent = RequestHandle(rid, request.seq.prompt_token_ids, self.cancel)
        parent.candidates = hs
        return parent

    def submit(
        self, prompt: Prompt, params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Queue one request; returns a streaming handle at once. Thread-safe."""
        return self._submit_many([prompt], [params or SamplingParams()], [request_id])[0]

    def submit_many(
        self, prompts: Seq[Prompt], params: Seq[SamplingParams],
        request_ids: Seq[str | None] | None = None,
    ) -> list[RequestHandle]:
        """Queue several requests at one moment (all validated first, then queued under one
        lock), so the engine admits them in the same step: the same workload gives the
        same batches, hence the same outputs, run after run. Thread-safe."""
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} for {len(prompts)} prompts")
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        if len(ids) != len(prompts):
            raise ValueError(f"request_ids: got {len(ids)} for {len(prompts)} prompts")
        return self._submit_many(list(prompts), list(params), ids)

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (one params for all, or one each); outputs in order."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} for {len(prompts)} prompts")
        handles = self._submit_many(list(prompts), list(params), [None] * len(prompts))
        return [h.result() for h in handles]

    def cancel(self, request_id: str) -> None:
        """Stop a request; whatever it holds is freed at the next step."""
        with self._cond:
            self._cancels.add(request_id)
            self._cond.notify()

    def __enter__(self) -> ServingBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
