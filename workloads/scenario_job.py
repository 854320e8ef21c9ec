"""One KV scenario played on an engine of its own, as a background job.

The KV cache page runs its scenarios here, never on the shared engine, so nobody's
settings change: the job builds an `Engine` on the already loaded weights, plays the
scenario with `run_scenario`, keeps the result and the engine's last stats, and owns the
engine, so it is shut down whether the scenario ended, was stopped or failed::

    ScenarioJob(...).start()
        thread: run_scenario(engine, scenario, stop) -> result, final_stats -> shutdown
    page:   job.engine (live while running) · job.stop() · job.result · job.lengths()

The pool keeps its size in token slots when the block size changes (`scenario_config`),
so a block size comparison is one of layouts, not of memory.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.loaded import LoadedModel
from engine.outputs import RequestHandle
from engine.serving import ServingStats
from workloads.job import BackgroundJob
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


class ScenarioJob(BackgroundJob):
    """A scenario on its own engine, on its own thread. Raises `ValueError` when the
    settings are impossible (nothing started then)."""

    def __init__(
        self, scenario: Scenario, loaded: LoadedModel, *, block_size: int | None = None,
        prefix_caching: bool | None = None,
    ) -> None:
        self.scenario = scenario
        self.config = scenario_config(scenario, block_size, prefix_caching)
        self.engine = Engine(self.config, loaded=loaded)
        super().__init__("kv", owned=(self.engine,))
        self.result: ScenarioResult | None = None
        self.final_stats: ServingStats | None = None
        self._handles: list[RequestHandle] = []

    def lengths(self) -> list[int]:
        """Token length (prompt + output so far) of every answer submitted so far (one per
        request, n for a request of n candidates)."""
        if self.result is not None:
            return [len(o.prompt_token_ids) + len(a.token_ids)
                    for o in self.result.outputs for a in o.answers]
        with self._lock:
            handles = list(self._handles)
        out = []
        for h in handles:
            for c in h.candidates:  # n > 1: each candidate streams on its own handle
                c.poll()  # nobody else reads these handles; this updates num_tokens
                out.append(len(h.prompt_token_ids) + c.num_tokens)
        return out

    # ---- the thread ------------------------------------------------------------------
    def _live_handles(self) -> list[RequestHandle]:
        return list(self._handles)

    def _on_submit(self, user: int, handle: RequestHandle) -> None:
        with self._lock:
            self._handles.append(handle)

    def _work(self) -> None:
        with self._lock:
            self._phase = "running"
        try:
            self.result = run_scenario(self.engine, self.scenario, stop=self._stop,
                                       on_submit=self._on_submit, prefix=self.scenario.key)
        finally:  # the engine's last figures, before the job shuts it down
            self.final_stats = self.engine.stats()
