"""The request surface shared by the datacenter engine and the local runner.

Both queue requests for a background thread and hand back streaming handles; a subclass
provides `_submit_many` (validate, queue, return handles) and `shutdown`, and owns the
`_cond` / `_cancels` its loop reads.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq

from engine.config import SamplingParams
from engine.models.loaded import Prompt
from engine.outputs import RequestHandle, RequestOutput

# The loop's compute thread gives the GIL up around every tensor op and must win it back
# from whatever else runs Python in the process (a page's script runs, a race's sampler).
# Python's default switch interval, 5 ms, is longer than most decode ops here; 0.5 ms hands
# the GIL back sooner. Set for the whole process, once a loop starts, so the page, the
# headless race and the bench all run under the same rule.
GIL_SWITCH_INTERVAL_S = float(os.environ.get("BATCHLENS_GIL_SWITCH_S", "0.0005"))


class ServingBase:
    _cond: threading.Condition
    _cancels: set[str]
    _stopped: bool
    _thread: threading.Thread

    def _start_loop(self, target: Callable[[], None], name: str) -> None:
        """Start the background loop `target` on a daemon thread called `name`."""
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

    def _submit_many(
        self, prompts: list[Prompt], params: list[SamplingParams], ids: list[str | None]
    ) -> list[RequestHandle]:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

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
