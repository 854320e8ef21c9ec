"""One KV scenario played on an engine of its own, on a background thread.

The KV cache page runs its scenarios here, never on the shared engine, so nobody's
settings change: the job builds an `Engine` on the already loaded weights, plays the
scenario with `run_scenario`, keeps the result and the engine's last stats, and shuts
the engine down itself, whether the scenario ended, was stopped or failed::

    ScenarioJob(...).start()
        thread: run_scenario(engine, scenario, stop) -> result, final_stats -> shutdown
    page:   job.engine (live while running) · job.stop() · job.result · job.lengths()

The pool keeps its size in token slots when the block size changes (`scenario_config`),
so a block size comparison is one of layouts, not of memory.
"""

from __future__ import annotations

import threading
import time
import uuid

from engine.config import EngineConfig
from engine.engine import Engine, EngineStats
from engine.models.loaded import LoadedModel
from engine.outputs import RequestHandle
from workloads.scenarios import Scenario, ScenarioResult, run_scenario


def scenario_config(
    scenario: Scenario, block_size: int | None = None, prefix_caching: bool | None = None,
) -> EngineConfig:
    """The scenario's engine settings, with another block size and/or prefix caching.

    A new block size keeps the pool's size in token slots (num_kv_blocks x block_size)."""
    changes: dict[str, object] = {}
    if prefix_caching is not None:
        changes["enable_prefix_caching"] = bool(prefix_caching)
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        base = scenario.engine_config()
        changes["block_size"] = block_size
        if base.num_kv_blocks is not None:
            changes["num_kv_blocks"] = max(1, base.num_kv_blocks * base.block_size // block_size)
    return scenario.engine_config(**changes)


class ScenarioJob:
    """A scenario on its own engine, on its own thread. Raises `ValueError` when the
    settings are impossible (nothing started then)."""

    def __init__(
        self, scenario: Scenario, loaded: LoadedModel, *, block_size: int | None = None,
        prefix_caching: bool | None = None,
    ) -> None:
        self.scenario = scenario
        self.config = scenario_config(scenario, block_size, prefix_caching)
        self.job_id = f"kv-{uuid.uuid4().hex[:6]}"
        self.engine = Engine(self.config, loaded=loaded)
        self.result: ScenarioResult | None = None
        self.error: str | None = None
        self.final_stats: EngineStats | None = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._handles: list[RequestHandle] = []
        self._thread = threading.Thread(target=self._run, name=f"batchlens-{self.job_id}",
                                        daemon=True)

    def start(self) -> ScenarioJob:
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    # ---- state ---------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """The scenario ended (finished, stopped or failed) and its engine is shut down."""
        return self._done.is_set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.done

    def stop(self) -> None:
        """Cancel what is left; the thread then shuts the engine down."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the end; True once the thread is gone."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float = 60.0) -> bool:
        """Stop (if still running) and wait until the engine is shut down."""
        self.stop()
        if self._thread.ident is None:  # never started: only the engine to release
            self.engine.shutdown()
            self._done.set()
            return True
        return self.join(timeout)

    def lengths(self) -> list[int]:
        """Token length (prompt + output so far) of every request submitted so far."""
        if self.result is not None:
            return [len(o.prompt_token_ids) + len(o.token_ids) for o in self.result.outputs]
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            h.poll()  # nobody else reads these handles; this updates num_tokens
        return [len(h.prompt_token_ids) + h.num_tokens for h in handles]

    # ---- the thread ------------------------------------------------------------------
    def _on_submit(self, user: int, handle: RequestHandle) -> None:
        with self._lock:
            self._handles.append(handle)

    def _run(self) -> None:
        try:
            self.result = run_scenario(self.engine, self.scenario, stop=self._stop,
                                       on_submit=self._on_submit, prefix=self.scenario.key)
        except Exception as exc:  # shown on the page; the engine is still shut down
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.final_stats = self.engine.stats()
            self.engine.shutdown()
            self.ended_at = time.monotonic()
            self._done.set()
