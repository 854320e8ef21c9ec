"""Speculative decoding on and off, side by side, on the "edit a paragraph" scenario (its
answers copy most of the prompt) at a few user counts.

Each run gets an engine of its own on the already loaded weights (the shared engine's
settings never change), sized to hold every user, and warmed up with one short request.
Every paragraph of the scenario is edited at least once, `users` requests at a time (each
round sent at one moment when the last one ended): 1 user edits the 8 paragraphs one after
another, 32 users send one each at once. The figures come from `engine.metrics.summarize`
and the engine's speculative-decoding counters::

    run_edit(loaded, users=1, speculative=True)  -> SpecRun (tokens/s per user and in all,
                                                    acceptance rate, mean accepted length)
    SpecCompareJob(loaded).start()               -> 1 and 32 users, off then on, in turn

Presenter mode plays the job; `batchlens bench speculative` calls `run_edit` at 1, 32 and 64 users.
The arena's per-side switch gets its datacenter side from `engine_with_speculation`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.metrics import summarize
from engine.models.loaded import LoadedModel, Prompt
from engine.outputs import RequestHandle
from workloads import scenarios
from workloads.job import CANCEL_GRACE_S, BackgroundJob, WorkloadError
from workloads.prompts import Chat, chat

SCENARIO = "edit_paragraph"
PRESENTER_USERS = (1, 32)
WARMUP = chat("Say hello.")  # not an edit prompt: no prefix-cache hit for the measured ones
POOL_SLACK_BLOCKS = 64
POLL_S = 0.05


@dataclass(frozen=True)
class SpecRun:
    """One run of the edit scenario: its users, whether it speculated, what it measured."""

    users: int
    speculative: bool
    output_tokens: int
    wall_s: float
    total_tokens_per_s: float
    tokens_per_s_per_user: float  # median over requests of output tokens / E2E
    acceptance_rate: float | None  # accepted drafts / drafts verified (None: off)
    mean_accepted_length: float | None  # tokens per verification step, bonus included
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    answers: tuple[tuple[int, ...], ...]  # each request's tokens (greedy: compare on, off)

    def as_dict(self) -> dict[str, Any]:
        """The figures, without the answers."""
        out = dataclasses.asdict(self)
        del out["answers"]
        return out


def edit_prompts(n: int) -> list[Chat]:
    """`n` of the scenario's prompts (its paragraphs in turn)."""
    prompts = scenarios.get(SCENARIO).prompts
    return [prompts[i % len(prompts)] for i in range(n)]


def requests_for(users: int) -> int:
    """Requests of a run at `users`: one per user, and every paragraph at least once."""
    return max(users, len(scenarios.EDIT_PARAGRAPHS))


def engine_config(users: int, speculative: bool, prompt_tokens: int,
                  base: EngineConfig | None = None) -> EngineConfig:
    """`base` (default settings if None) with n-gram speculation on or off, room for
    `users` running at once, and a pool that holds all of them whole."""
    base = base or EngineConfig()
    sc = scenarios.get(SCENARIO)
    blocks = -(-(prompt_tokens + sc.max_tokens * users) // base.block_size)
    return dataclasses.replace(
        base, speculative="ngram" if speculative else None,
        max_num_seqs=max(base.max_num_seqs, users),
        num_kv_blocks=blocks + users + POOL_SLACK_BLOCKS)


def run_edit(
    loaded: LoadedModel, users: int, speculative: bool, *, base: EngineConfig | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_submit: Callable[[list[RequestHandle]], None] | None = None,
) -> SpecRun | None:
    """The edit scenario at `users` on an engine of its own (see the module's notes); None
    when `should_stop()` turned true (what was left is cancelled); a `WorkloadError` when
    a request failed."""
    sc = scenarios.get(SCENARIO)
    prompts = [list(p) for p in edit_prompts(requests_for(users))]
    prompt_tokens = max(sum(len(loaded.encode(p)) for p in prompts[i : i + users])
                        for i in range(0, len(prompts), users))
    config = engine_config(users, speculative, prompt_tokens, base)
    outputs = []
    with Engine(config, loaded=loaded) as engine:
        engine.generate([list(WARMUP)], SamplingParams(max_tokens=4))
        before = engine.stats(steps_after=None).spec_decode
        for i in range(0, len(prompts), users):  # a round: `users` requests at one moment
            batch = prompts[i : i + users]
            handles = engine.submit_many(batch, [sc.params(0)] * len(batch))
            if on_submit is not None:
                on_submit(handles)
            _wait(handles, should_stop)
            outputs += [h.result() for h in handles]
            if any(o.finish_reason == "cancelled" for o in outputs):
                break
        after = engine.stats(steps_after=None).spec_decode
    if errors := [o.error for o in outputs if o.finish_reason == "error"]:
        raise WorkloadError(f"the edit scenario failed: {errors[0]}")
    if any(o.finish_reason == "cancelled" for o in outputs):
        return None
    summary = summarize([o.metrics for o in outputs])
    drafts = (after.num_drafts - before.num_drafts) if after and before else 0
    draft_tokens = (after.num_draft_tokens - before.num_draft_tokens) if after and before else 0
    accepted = (after.num_accepted_tokens - before.num_accepted_tokens) if after and before else 0
    return SpecRun(
        users=users, speculative=speculative, output_tokens=summary.output_tokens,
        wall_s=summary.wall_time, total_tokens_per_s=summary.throughput,
        tokens_per_s_per_user=summary.per_user_tokens_per_s_p50,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        mean_accepted_length=1 + accepted / drafts if drafts else None,
        num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
        answers=tuple(tuple(o.token_ids) for o in outputs))


def _wait(handles: list[RequestHandle], should_stop: Callable[[], bool] | None) -> None:
    """Until every request ended; once `should_stop()` is true, cancel them all."""
    deadline = None
    while not all(h.done for h in handles):
        if deadline is None and should_stop is not None and should_stop():
            for h in handles:
                h.cancel()
            deadline = time.monotonic() + CANCEL_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError("requests did not end after cancel")
        time.sleep(POLL_S)


def engine_with_speculation(engine: Engine, on: bool, prompts: Sequence[Prompt],
                            max_tokens: int) -> Engine | None:
    """An engine of its own on `engine`'s weights and settings but with speculation `on`,
    its pool sized for `prompts` each answered with `max_tokens` (never larger than
    `engine`'s); None when `engine` already speculates as asked. `ValueError` when it
    cannot be built."""
    if (engine.speculation is not None) == on:
        return None
    cfg = engine.config
    tokens = sum(len(engine.loaded.encode(p)) + max_tokens for p in prompts)
    blocks = min(engine.kv.num_blocks, -(-tokens // cfg.block_size) + len(prompts)
                 + POOL_SLACK_BLOCKS)
    return Engine(dataclasses.replace(cfg, speculative="ngram" if on else None,
                                      num_kv_blocks=blocks), loaded=engine.loaded)


def speedup(runs: Sequence[SpecRun], users: int) -> float | None:
    """Tokens/s per user with speculation / without, at `users`; None until both ran."""
    on = next((r for r in runs if r.users == users and r.speculative), None)
    off = next((r for r in runs if r.users == users and not r.speculative), None)
    if on is None or off is None or not off.tokens_per_s_per_user:
        return None
    return on.tokens_per_s_per_user / off.tokens_per_s_per_user


class SpecCompareJob(BackgroundJob):
    """Presenter mode's "edit a paragraph": the scenario at each of `users`, without then
    with speculation, one run at a time, each on an engine of its own."""

    def __init__(self, loaded: LoadedModel, users: Sequence[int] = PRESENTER_USERS, *,
                 base: EngineConfig | None = None, heartbeat_timeout: float | None = None,
                 connected: Callable[[], bool] | None = None) -> None:
        if not users or min(users) < 1:
            raise ValueError(f"users: at least one count >= 1 is needed, got {users}")
        super().__init__("speculative", heartbeat_timeout, connected)
        self.loaded, self.users, self.base = loaded, tuple(users), base
        self.runs: list[SpecRun] = []
        self.current: tuple[int, bool] | None = None  # (users, speculative) running now
        self._handles: list[RequestHandle] = []

    def snapshot(self) -> tuple[list[SpecRun], tuple[int, bool] | None]:
        """The runs done so far and the one running now."""
        with self._lock:
            return list(self.runs), self.current

    def _live_handles(self) -> list[RequestHandle]:
        return list(self._handles)

    def _on_finish(self) -> None:
        self.current = None

    def _on_submit(self, handles: list[RequestHandle]) -> None:
        with self._lock:
            self._handles = list(handles)

    def _should_stop(self) -> bool:
        if not self._stop.is_set() and self._heartbeat_expired():
            self._abandoned = True
            self._stop.set()
        return self._stop.is_set()

    def _work(self) -> None:
        with self._lock:
            self._phase = "running"
        for users in self.users:
            for speculative in (False, True):
                if self._should_stop():
                    return
                with self._lock:
                    self.current = (users, speculative)
                run = run_edit(self.loaded, users, speculative, base=self.base,
                               should_stop=self._should_stop, on_submit=self._on_submit)
                if run is None:  # stopped
                    return
                with self._lock:
                    self.runs.append(run)
