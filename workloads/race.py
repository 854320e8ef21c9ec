"""A race: the same prompts on the local PC and on the datacenter engine, side by side.

Fair on a small CPU: the two sides never run at the same time, so neither steals cores
from the other. Each side gets every thread torch has, runs alone, and is replayed on one
shared timeline where each side's t=0 is its own start::

    datacenter  t=0 |== all users batched together ==|
    local                                             t=0 |= user 0 =|= user 1 =|= ... =|
    timeline        0 ------------------------------------------------------------> s
                    both sides drawn from their own t=0

A background thread submits every user's request to one side, samples progress every
`interval` seconds (tokens, KV memory, datacenter batch size per step) and, when that
side is done, moves on to the next. `snapshot()` returns a copy, safe from any thread.
`touch()` is a heartbeat: without one for `heartbeat_timeout` seconds, and with the page's
`connected` check (if given) false, the race cancels its own requests; a closed browser tab
(`connected` false for half a second) cancels them at once. Every figure comes from `engine.metrics`; the series are kept whole (the page
thins them for its charts) and the page words the summary.

With `SamplingParams.n` > 1 every user gets n answers: each side's figures count every
candidate's tokens, and the view carries your n answers (`SideView.your_answers`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import SamplingParams
from engine.engine import Engine
from engine.local import LocalPC
from engine.metrics import RunSummary, percentile, summarize
from engine.models.loaded import Prompt
from engine.outputs import RequestHandle, RequestOutput
from engine.serving import ServingSide
from engine.speculative import SpecDecodeStats
from workloads.job import CANCEL_GRACE_S, BackgroundJob, WorkloadError, engine_changed
from workloads.prompts import chat
from workloads.sides import LABELS, MAX_USERS, SIDES, check_order, prompts_for_sides

PROGRESS_S = 2.0  # a headless race prints its progress this often


@dataclass(frozen=True)
class SideView:
    """One side's live figures. Times in seconds since this side's own t=0."""

    side: str
    num_users: int
    started: bool
    finished: bool
    elapsed: float
    your_text: str
    your_ttft: float | None
    your_tokens_per_s: float | None
    total_tokens: int
    total_tokens_per_s: float | None
    users_finished: int
    users_ahead_of_you: int | None  # in the side's queue; 0 = being served; None = done
    acceptance_rate: float | None = None  # speculative drafts accepted (None: no drafts)
    mean_accepted_length: float | None = None  # tokens per verification step
    your_answers: tuple[str, ...] = ()  # n > 1: each of your candidates' text so far

    @classmethod
    def idle(cls, side: str, num_users: int = 0) -> SideView:
        """A side that has not started."""
        return cls(side, num_users, False, False, 0.0, "", None, None, 0, None, 0, None)


@dataclass(frozen=True)
class RaceSnapshot:
    """A copy of the race's state; series are lists of plain dicts (one row each)."""

    phase: str  # "datacenter", "local", "done", "stopped", "abandoned" or "error"
    elapsed: float
    sides: dict[str, SideView]
    tokens: list[dict[str, Any]]  # side, t, tokens
    kv: list[dict[str, Any]]  # side, t, kind ("reserved" | "used"), bytes
    batch: list[dict[str, Any]]  # t, num_seqs: datacenter sequences per step
    rows: list[dict[str, Any]]  # per finished request: side, user, you, ttft, tpot, ...
    finished: bool
    ratio: float | None  # datacenter / local total tokens/s, once both sides ran to the end
    error: str | None


@dataclass
class _Side:
    name: str
    server: ServingSide
    prompts: list[Prompt] = field(default_factory=list)  # as sent: token ids or the prompt
    handles: list[RequestHandle] = field(default_factory=list)
    t0: float | None = None
    t_end: float | None = None
    first_token_seen: float | None = None
    outputs: list[RequestOutput] | None = None
    summary: RunSummary | None = None
    last_step_start: float = 0.0
    users_ahead: int | None = None
    spec_decode0: SpecDecodeStats | None = None  # the side's speculation counters at its start
    spec_decode: SpecDecodeStats | None = None  # ... and since then (this race's drafts)


class Race(BackgroundJob):
    """Run `prompts` (one per user, in arrival order) on both sides, one side at a time.

    Either side is any serving side: this process's engine or local PC, or a remote
    OpenAI-compatible server. `you` is the index of the presenter's own request. Prompts
    are checked against each side's limits here (a side that can tokenize gets token ids,
    so both in-process sides run the very same tokens), so a bad input raises `ValueError`
    naming the side before anything runs.
    """

    def __init__(
        self, engine: ServingSide, local: ServingSide, prompts: list[Prompt],
        params: SamplingParams, *, you: int = 0, order: tuple[str, ...] = SIDES,
        heartbeat_timeout: float | None = 5.0, interval: float = 0.1,
        close_local: bool = False, close_engine: bool = False,
        connected: Callable[[], bool] | None = None,
    ) -> None:
        if not prompts:
            raise ValueError("users: at least one prompt is needed")
        if not 0 <= you < len(prompts):
            raise ValueError(f"you: must be in [0, {len(prompts) - 1}], got {you}")
        check_order(order)
        owned = [side for side, close in ((local, close_local), (engine, close_engine)) if close]
        super().__init__("race", heartbeat_timeout, connected, owned)
        self.engine, self.local, self.params, self.you = engine, local, params, you
        self.order, self.interval = tuple(order), interval
        self.num_users = len(prompts)
        self.num_threads = torch.get_num_threads()
        self._sides = {"datacenter": _Side("datacenter", engine), "local": _Side("local", local)}
        sent = prompts_for_sides({n: s.server for n, s in self._sides.items()}, prompts, params)
        for name, side in self._sides.items():
            side.prompts = sent[name]
        self._tokens: list[dict[str, Any]] = []
        self._kv: list[dict[str, Any]] = []
        self._batch: list[dict[str, Any]] = []

    # ---- public API --------------------------------------------------------------------
    def _live_handles(self) -> list[RequestHandle]:
        return [h for s in self._sides.values() for h in s.handles]

    def outputs(self, side: str) -> list[RequestOutput]:
        """Final outputs of one side, in arrival order (empty until that side is done)."""
        with self._lock:
            return list(self._sides[side].outputs or [])

    def snapshot(self) -> RaceSnapshot:
        now = time.monotonic()
        with self._lock:
            sides = {name: self._view(s, now) for name, s in self._sides.items()}
            start = self._t_start or now
            end = self._t_done or now
            ratio = self._ratio()
            return RaceSnapshot(
                phase=self._phase, elapsed=end - start, sides=sides,
                tokens=list(self._tokens), kv=list(self._kv), batch=list(self._batch),
                rows=self._rows(), finished=self._t_done is not None, ratio=ratio,
                error=self._error,
            )

    # ---- the race thread ---------------------------------------------------------------
    def _work(self) -> None:
        errors = []
        for name in self.order:
            if self._stop.is_set():
                break
            try:
                self._run_side(self._sides[name])
            except WorkloadError:  # the shared engine was replaced: nothing more to run
                raise
            except RuntimeError as exc:  # a failing side (an endpoint down) fails only its
                errors.append(str(exc))  # own requests: the other side still runs
        if errors:
            raise WorkloadError("; ".join(errors))

    def _params_for(self, user: int) -> SamplingParams:
        if self.params.greedy or self.params.seed is not None:
            return self.params
        return dataclasses.replace(self.params, seed=user)  # same draws on both sides

    def _run_side(self, side: _Side) -> None:
        spec_decode0 = side.server.stats(steps_after=None).spec_decode
        with self._lock:
            self._phase = side.name
            side.spec_decode0 = spec_decode0
            side.t0 = time.monotonic()
            n = self.num_users
            try:
                side.handles.extend(side.server.submit_many(  # one moment: same batches
                    side.prompts, [self._params_for(u) for u in range(n)],
                    [f"{self.job_id}-{side.name[:2]}-u{u}" for u in range(n)]))
            except RuntimeError:
                side.t0 = None  # this side never started
                if side.server.stats(steps_after=None).stopped == "shut down":
                    raise engine_changed("race") from None  # replaced before it began
                raise
        if self._stop.is_set():
            self.stop()
        deadline = None
        while True:
            self._sample(side)
            if all(h.done for h in side.handles):
                break
            if self._heartbeat_expired():
                self._abandoned = True
                self.stop()
            if self._stop.is_set():
                deadline = deadline or time.monotonic() + CANCEL_GRACE_S
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{side.name}: requests did not end after cancel")
                time.sleep(self.interval)  # not _stop.wait: once set, it would spin
            else:
                self._stop.wait(self.interval)
        outputs = [h.result() for h in side.handles]
        self._sample(side)
        self._check_outputs(side.name, outputs)
        with self._lock:
            side.outputs, side.t_end = outputs, time.monotonic()
            side.summary = summarize([a.metrics for o in outputs for a in o.answers])
            if side.spec_decode is not None:  # exact, from this race's own requests
                side.spec_decode = SpecDecodeStats(sum(o.num_drafts for o in outputs),
                                            sum(o.num_draft_tokens for o in outputs),
                                            sum(o.num_accepted_tokens for o in outputs))
            self._replace_token_series(side, outputs)

    def _check_outputs(self, name: str, outputs: list[RequestOutput]) -> None:
        """A request that failed, or was cancelled by someone else, ends this side."""
        errors = [o.error for o in outputs if o.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"{LABELS[name]}: {errors[0]}")
        cancelled = sum(o.finish_reason == "cancelled" for o in outputs)
        if cancelled and not self._stop.is_set():  # only a shut-down side cancels by itself:
            raise engine_changed("race")  # the shared engine, replaced by the admin

    def _sample(self, side: _Side) -> None:
        """Drain streamed text and record one point of every series."""
        for h in side.handles:
            h.poll()
            if len(h.candidates) > 1:  # n > 1: each candidate streams on its own handle
                for c in h.candidates:
                    c.poll()
        now = time.monotonic()
        t = now - side.t0
        tokens = sum(map(_tokens, side.handles))
        stats = side.server.stats(steps_after=max(side.t0, side.last_step_start))
        reserved, used = stats.kv_reserved_bytes, stats.kv_used_bytes
        steps = list(stats.recent_steps)
        # requests ahead of yours: the queue, plus the running ones when they fill every
        # slot (one user at a time locally; a batch with room serves yours beside them)
        queue = stats.waiting_ids
        full = 0 < stats.max_num_running <= stats.num_running
        ahead_running = stats.num_running if full else 0
        with self._lock:
            you = side.handles[self.you]
            side.users_ahead = self._users_ahead(you, queue, ahead_running)
            if stats.spec_decode is not None and side.spec_decode0 is not None and side.outputs is None:
                s0, s = side.spec_decode0, stats.spec_decode
                side.spec_decode = SpecDecodeStats(s.num_drafts - s0.num_drafts,
                                            s.num_draft_tokens - s0.num_draft_tokens,
                                            s.num_accepted_tokens - s0.num_accepted_tokens)
            if side.first_token_seen is None and _tokens(you) > 0:
                side.first_token_seen = now
            self._tokens.append({"side": side.name, "t": t, "tokens": tokens})
            self._kv.append({"side": side.name, "t": t, "kind": "reserved", "bytes": reserved})
            self._kv.append({"side": side.name, "t": t, "kind": "used", "bytes": used})
            for s in steps:
                self._batch.append({"t": s.start - side.t0, "num_seqs": s.num_seqs})
            if steps:
                side.last_step_start = steps[-1].start

    def _replace_token_series(self, side: _Side, outputs: list[RequestOutput]) -> None:
        """Swap the sampled token curve for the exact one from the token timestamps."""
        times = sorted(t for o in outputs for a in o.answers for t in a.metrics.token_times)
        exact = [{"side": side.name, "t": 0.0, "tokens": 0}]
        exact += [{"side": side.name, "t": t - side.t0, "tokens": i + 1}
                  for i, t in enumerate(times)]
        self._tokens = [p for p in self._tokens if p["side"] != side.name] + exact

    # ---- views (called with the lock held) ---------------------------------------------
    def _view(self, side: _Side, now: float) -> SideView:
        n = self.num_users
        if side.t0 is None:
            return SideView.idle(side.name, n)
        done = side.outputs is not None
        elapsed = (side.t_end or now) - side.t0
        you = side.handles[self.you]
        total = sum(map(_tokens, side.handles))
        if done:
            mine = side.outputs[self.you].metrics
            your_ttft, your_tps = mine.ttft, mine.tokens_per_s
            total_tps = side.summary.throughput if side.summary else None
        else:
            seen = side.first_token_seen
            your_ttft = seen - side.t0 if seen is not None else None
            mine_now = you.candidate(0).num_tokens
            your_tps = mine_now / elapsed if mine_now and elapsed > 0 else None
            total_tps = total / elapsed if elapsed > 0 else None
        finished = sum(1 for h in side.handles
                       if h.done and h.result().finish_reason in ("stop", "length"))
        spec_decode = side.spec_decode
        answers = tuple(c.text for c in you.candidates) if len(you.candidates) > 1 else ()
        return SideView(side.name, n, True, done, elapsed, you.candidate(0).text, your_ttft,
                        your_tps, total, total_tps, finished,
                        None if you.done else side.users_ahead,
                        spec_decode.acceptance_rate if spec_decode else None,
                        spec_decode.mean_accepted_length if spec_decode else None, answers)

    @staticmethod
    def _users_ahead(you: RequestHandle, waiting_ids: tuple[str, ...],
                     num_running: int) -> int | None:
        """Requests served before yours: 0 while yours is being served (or batched)."""
        if you.done:
            return None
        if you.request_id in waiting_ids:
            return waiting_ids.index(you.request_id) + num_running
        return 0

    def _rows(self) -> list[dict[str, Any]]:
        rows = []
        for side in self._sides.values():
            if side.t0 is None:
                continue
            for user, h in enumerate(side.handles):
                if not h.done:
                    continue
                out = h.result()
                m = out.metrics
                rows.append({
                    "side": side.name, "user": user, "you": user == self.you,
                    "ttft_s": m.ttft, "tpot_s": m.tpot, "e2e_s": m.e2e,
                    "queue_s": m.queue_time,
                    "tokens": sum(len(a.token_ids) for a in out.answers),
                    "tokens_per_s": m.tokens_per_s, "finish_reason": out.finish_reason,
                })
        return rows

    def _ratio(self) -> float | None:
        dc, loc = self._sides["datacenter"].summary, self._sides["local"].summary
        if self._stop.is_set() or dc is None or loc is None:
            return None
        if not (dc.throughput > 0 and loc.throughput > 0):
            return None
        return dc.throughput / loc.throughput


def _tokens(handle: RequestHandle) -> int:
    """Tokens streamed so far for a request: every candidate's (n > 1 streams each on its
    own handle; for n = 1 the request's handle is its only candidate)."""
    return sum(c.num_tokens for c in handle.candidates)


def progress_line(snap: RaceSnapshot) -> str:
    """One line of a headless race's progress: each side's users done and tokens so far."""
    parts = [f"{LABELS[name]}: {view.users_finished}/{view.num_users} users done, "
             f"{view.total_tokens:,} tokens" for name, view in snap.sides.items()
             if view.started]
    return f"{snap.elapsed:6.1f} s  " + (" · ".join(parts) or "starting")


def figures_table(snap: RaceSnapshot) -> str:
    """A finished race's figures per side, as the page charts them: tokens/s in total and
    per user, TTFT (p50 and the longest wait), TPOT, when the last answer ended, and the
    KV memory reserved and used at the side's peak reservation (the rest is wasted)."""
    head = (f"{'side':<11}{'users':>6}{'tokens':>8}{'tok/s':>8}{'tok/s/user':>11}"
            f"{'TTFT p50':>10}{'TTFT max':>10}{'TPOT p50':>10}{'last done':>11}"
            f"{'KV reserved':>13}{'KV used':>9}")
    lines = [head, "-" * len(head)]
    for name, view in snap.sides.items():
        rows = [r for r in snap.rows if r["side"] == name]
        if not view.started or not rows:
            continue
        kv = [r for r in snap.kv if r["side"] == name]
        reserved = max((r for r in kv if r["kind"] == "reserved"), key=lambda r: r["bytes"],
                       default=None)
        used = next((r["bytes"] for r in kv if r["kind"] == "used" and reserved is not None
                     and r["t"] == reserved["t"]), 0)
        rate = view.total_tokens_per_s
        lines.append(
            f"{LABELS[name]:<11}{view.num_users:>6}{view.total_tokens:>8,}"
            f"{rate if rate is not None else math.nan:>8.1f}"
            f"{percentile([r['tokens_per_s'] for r in rows], 50):>11.1f}"
            f"{percentile([r['ttft_s'] for r in rows], 50):>8.2f} s"
            f"{max(r['ttft_s'] or 0.0 for r in rows):>8.2f} s"
            f"{percentile([r['tpot_s'] for r in rows], 50) * 1e3:>7.0f} ms"
            f"{max(r['e2e_s'] or 0.0 for r in rows):>9.2f} s"
            f"{(reserved['bytes'] if reserved else 0) / 2**20:>9.1f} MiB"
            f"{used / 2**20:>5.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m workloads.race") -> int:
    """Run one race headless, printing its progress every few seconds, then both sides'
    figures (for comparing with the page). Ctrl-C stops it, freeing what it holds."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=16,
                    help=f"users sending at once, 1 to {MAX_USERS} (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    ap.add_argument("--prompt", default="Explain why the sky is blue.",
                    help="every user's prompt")
    args = ap.parse_args(argv)
    if not 1 <= args.users <= MAX_USERS:
        ap.error(f"--users must be in [1, {MAX_USERS}], got {args.users}")
    if not args.prompt.strip():
        ap.error("--prompt must not be empty")
    try:
        params = SamplingParams(max_tokens=args.max_tokens)
    except ValueError as exc:
        ap.error(f"--max-tokens: {exc}")
    with Engine() as engine, LocalPC(engine.loaded) as local:
        try:
            race = Race(engine, local, [chat(args.prompt)] * args.users, params,
                        heartbeat_timeout=None).start()
        except ValueError as exc:  # the prompt does not fit a side's context
            ap.error(str(exc))
        race.follow(lambda: progress_line(race.snapshot()), PROGRESS_S)
        snap = race.snapshot()
    print(figures_table(snap))
    print(f"datacenter / local PC: {snap.ratio:.1f}x" if snap.ratio else snap.error or snap.phase)
    return 0 if snap.error is None and snap.phase == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
