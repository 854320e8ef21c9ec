"""One replica on the simulated clock: continuous batching over a paged KV pool.

What is shared with the engine, and why:

- the KV pool is the engine's own `engine.kv_cache.KVCacheManager`: block tables, ref
  counts, the chained-hash prefix cache with LRU eviction. A replica asks it only when
  something changes (an admission, a prefill chunk, a block boundary, a finish), so it
  is fast enough as it is, and hits, evictions and usage are the engine's own;
- the prefill chunk cap is the engine's `prefill_chunk_cap`.

What is mirrored, and why: `engine.scheduler.Scheduler.schedule` visits every running
request on every step; an hour of a busy fleet is millions of steps, too many for a
Python loop over requests per step. `_exact_step` follows its policy line by line
(running requests first in arrival order, decode 1 token or a prefill chunk under one
token budget; FCFS admission while budget, `max_num_seqs` and blocks allow; no admission
in a step that preempted; on a block shortage the newest running request is preempted and
recomputed later) for steps where that policy has a choice to make. When it has none,
every running request decoding and nobody admissible, the next steps are identical but
for their context, so `_plan_stretch` runs them at once: up to the first finish, their
blocks checked and taken together, each step's time the cost at the stretch's mean
context (exact for a cost linear in context)::

    clock ──┬ exact step ┬ exact ┬─ stretch of k identical decode steps ──┬ exact ┬─>
            admit, prefill  chunk                                       first finish
                               ^ an arrival cuts a stretch at the next step boundary

Requests arriving while a stretch runs cut it (`add`): the steps begun before the
arrival count, the rest are planned again with the newcomer.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.scheduler import prefill_chunk_cap
from fleet.layouts import Layout
from fleet.trace import TraceRequest


@dataclass(eq=False, slots=True)
class SimRequest:
    """A request's state and timestamps in the simulation (seconds on its clock)."""

    rid: int
    req: TraceRequest
    key: str
    token_ids: list[int]
    prompt: int = 0  # req.prompt_tokens, read on every step: a plain attribute
    replica: int = -1
    computed: int = 0
    produced: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    dropped: str | None = None

    def __post_init__(self) -> None:
        self.prompt = self.req.prompt_tokens

    @property
    def arrival(self) -> float:
        return self.req.arrival

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.produced

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.req.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.req.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.req.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.req.output_tokens - 1)


@dataclass(slots=True)
class _Stretch:
    """k identical decode steps of `dt` each from `t0`, planned, not yet applied."""

    t0: float
    dt: float
    k: int

    @property
    def end(self) -> float:
        return self.t0 + self.k * self.dt


@dataclass(slots=True)
class _Step:
    """One exact step in flight: its entries, applied at `end`."""

    end: float
    entries: list[tuple[SimRequest, int]]


@dataclass
class ReplicaStats:
    steps: int = 0
    stretches: int = 0
    busy_s: float = 0.0
    output_tokens: int = 0
    preemptions: int = 0
    bucket_s: float = 60.0
    tokens_by_bucket: dict[int, float] = field(default_factory=dict)  # output tokens

    def deposit(self, t0: float, t1: float, tokens: int) -> None:
        """Spread `tokens` made between t0 and t1 evenly over the buckets they span."""
        w, buckets = self.bucket_s, self.tokens_by_bucket
        b0, b1 = int(t0 // w), int(t1 // w)
        if b0 == b1 or t1 <= t0:
            buckets[b1] = buckets.get(b1, 0.0) + tokens
            return
        rate = tokens / (t1 - t0)
        for b in range(b0, b1 + 1):
            lo, hi = max(t0, b * w), min(t1, (b + 1) * w)
            if hi > lo:
                buckets[b] = buckets.get(b, 0.0) + rate * (hi - lo)


class Replica:
    """A replica of `layout`, ready from `ready_at` (a cold start)."""

    def __init__(self, index: int, layout: Layout, ready_at: float = 0.0,
                 added_at: float | None = None, bucket_s: float = 60.0) -> None:
        self.index, self.layout = index, layout
        self.kv = KVCacheManager(layout.num_blocks, layout.block_size,
                                 layout.enable_prefix_caching)
        self.ready_at = ready_at
        self.added_at = ready_at if added_at is None else added_at
        self.draining = False
        self.removed_at: float | None = None
        self.clock = ready_at
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.finished: list[SimRequest] = []
        self.dropped: list[SimRequest] = []
        self.first_tokens: deque[tuple[float, float]] = deque()  # (time, TTFT), for scaling
        self.stats = ReplicaStats(bucket_s=bucket_s)
        self._pending: _Stretch | _Step | None = None
        self._admission_blocked = False  # the head of the queue found no blocks

    # ---- what the router and autoscaler see ------------------------------------------
    @property
    def outstanding(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def kv_usage(self) -> float:
        kv = self.kv
        return 1 - kv.num_free_blocks / kv.num_blocks

    def is_ready(self, t: float) -> bool:
        return t >= self.ready_at and not self.draining and self.removed_at is None

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting and self._pending is None

    # ---- events ----------------------------------------------------------------------
    def add(self, sreq: SimRequest, t: float) -> None:
        """A request routed here at time t joins the queue; the first step that starts at
        or after t sees it (a stretch in flight is cut at that step). An idle replica's
        next step starts `layout.wake_s` after its latest arrival."""
        self.run_until(t)
        if isinstance(self._pending, _Stretch):
            self._cut(t)
        sreq.replica = self.index
        self.waiting.append(sreq)
        self._admission_blocked = False  # a new request may fit where the head did not
        if self._pending is None:
            self.clock = max(self.clock, t + self.layout.wake_s)  # idle until now, then wake

    def run_until(self, t: float, inclusive: bool = False) -> None:
        """Apply every step that ends by t and plan those that start before t (at t too,
        when `inclusive`: nothing else can arrive then); the last may end later."""
        while True:
            p = self._pending
            if p is not None:
                if p.end > t:
                    return
                self._apply(p)
                continue
            if not (self.running or self.waiting):
                return
            if self.clock > t or (self.clock == t and not inclusive):
                return
            self._plan()
            if self._pending is None:
                return

    def next_event(self) -> float:
        """When this replica next has something to do: its step's end, or now."""
        if self._pending is not None:
            return self._pending.end
        return self.clock if (self.running or self.waiting) else math.inf

    # ---- planning --------------------------------------------------------------------
    def _plan(self) -> None:
        if not (self.running or self.waiting):
            self._pending = None
            return
        if self._can_stretch():
            self._plan_stretch()
        else:
            self._exact_step()

    def _can_stretch(self) -> bool:
        running = self.running
        if not running or len(running) > self.layout.max_num_batched_tokens:
            return False
        if self.waiting and not self._admission_blocked and (
                len(running) < self.layout.max_num_seqs):
            return False
        return all(s.computed == s.prompt + s.produced - 1 for s in running)

    def _plan_stretch(self) -> None:
        running, kv, bs = self.running, self.kv, self.layout.block_size
        k = min(s.req.output_tokens - s.produced for s in running)
        tables = kv.block_tables

        def blocks_for(steps: int) -> int:
            need = 0
            for s in running:
                need += max(0, -(-(s.computed + steps) // bs) - len(tables[s.key]))
            return need

        free = kv.num_free_blocks
        if blocks_for(k) > free:
            lo, hi = 0, k  # the most steps whose blocks fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if blocks_for(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
            if k == 0:
                self._exact_step()  # the next step preempts
                return
        n = len(running)
        ctx = sum(s.computed for s in running) + n * (k + 1) / 2
        dt = self.layout.cost.step_seconds(n, 0, n, round(ctx))
        self._pending = _Stretch(self.clock, dt, k)

    def _cut(self, t: float) -> None:
        """Keep the steps of the stretch in flight that began before t; drop the rest."""
        p = self._pending
        assert isinstance(p, _Stretch)
        j = max(0, math.ceil((t - p.t0) / p.dt - 1e-12))
        if j >= p.k:
            return
        self._pending = None
        if j:
            self._finish_stretch(_Stretch(p.t0, p.dt, j))

    def _apply(self, p: _Stretch | _Step) -> None:
        self._pending = None
        if isinstance(p, _Stretch):
            self._finish_stretch(p)
        else:
            self._finish_step(p)

    # ---- decode stretches ------------------------------------------------------------
    def _finish_stretch(self, p: _Stretch) -> None:
        kv, k, end = self.kv, p.k, p.end
        tables, bs = kv.block_tables, self.layout.block_size
        done = []
        for s in self.running:
            if len(tables[s.key]) * bs < s.computed + k:  # crossed a block boundary
                ok = kv.allocate(s.key, s.computed + k)
                assert ok, "a stretch's blocks were checked when it was planned"
            if s.produced == 0:  # its last prompt token was this stretch's first step
                s.first_token = p.t0 + p.dt
                self.first_tokens.append((s.first_token, s.first_token - s.req.arrival))
                kv.record_computed(s.key, s.token_ids, s.req.prompt_tokens)
            s.computed += k
            s.produced += k
            if s.produced >= s.req.output_tokens:
                done.append(s)
        n = len(self.running)
        st = self.stats
        st.steps += k
        st.stretches += 1
        st.busy_s += k * p.dt
        st.output_tokens += k * n
        st.deposit(p.t0, end, k * n)
        self.clock = end
        for s in done:
            self._retire(s, end)

    # ---- exact steps (engine.scheduler.Scheduler.schedule's policy) ------------------
    def _exact_step(self) -> None:
        lay, kv = self.layout, self.kv
        budget = lay.max_num_batched_tokens
        max_att = lay.max_prefill_attention
        tables, bs = kv.block_tables, lay.block_size
        entries: list[tuple[SimRequest, int]] = []
        running = self.running
        preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            n = min(s.prompt + s.produced - s.computed, budget)
            if n > 1:  # a chunk cap is never below MIN_PREFILL_CHUNK: decodes skip it
                cap = prefill_chunk_cap(s.computed, max_att)
                if cap is not None and n > cap:
                    n = cap
            table = tables.get(s.key)
            if table is None or len(table) * bs < s.computed + n:
                while not kv.allocate(s.key, s.computed + n):
                    victim = running[-1]
                    self._preempt(victim)
                    preempted += 1
                    if victim is s:
                        n = 0
                        break
                if n == 0:
                    break
            entries.append((s, n))
            budget -= n
            i += 1
        if not preempted and self.waiting:
            self._admit(entries, budget)
        if not entries:
            self._pending = None
            if self.waiting and not self.running:  # an empty pool cannot hold it: never will
                s = self.waiting.popleft()
                s.dropped = "larger than the KV pool"
                self.dropped.append(s)
                self._admission_blocked = False
                self._plan()
            return
        self._schedule(entries)

    def _admit(self, entries: list[tuple[SimRequest, int]], budget: int) -> None:
        lay, kv = self.layout, self.kv
        slots = len(self.running)
        while self.waiting and budget > 0 and slots < lay.max_num_seqs:
            s = self.waiting[0]
            hits = kv.find_cached_prefix(s.token_ids) if s.computed == 0 else []
            cached = len(hits) * lay.block_size
            n = min(s.num_tokens - cached, budget)
            cap = prefill_chunk_cap(cached, lay.max_prefill_attention)
            if cap is not None and n > cap:
                n = cap
            if not kv.allocate(s.key, cached + n, hits):
                self._admission_blocked = True
                break
            kv.record_prefix_lookup(s.num_tokens, cached)
            self.waiting.popleft()
            s.computed = s.cached_tokens = cached
            if s.first_scheduled is None:
                s.first_scheduled = self.clock
            self.running.append(s)
            entries.append((s, n))
            slots += 1
            budget -= n

    def _schedule(self, entries: list[tuple[SimRequest, int]]) -> None:
        prefill = decode = ctx = 0
        for s, n in entries:
            if n == 1 and s.computed + 1 == s.prompt + s.produced:
                decode += 1
            else:
                prefill += n
            ctx += s.computed + n
        dt = self.layout.cost.step_seconds(len(entries), prefill, decode, ctx)
        self._pending = _Step(self.clock + dt, entries)

    def _finish_step(self, p: _Step) -> None:
        kv, end = self.kv, p.end
        start = self.clock
        done, tokens = [], 0
        for s, n in p.entries:
            s.computed += n
            if s.produced == 0:
                kv.record_computed(s.key, s.token_ids, min(s.computed, s.prompt))
            if s.computed == s.prompt + s.produced:
                s.produced += 1
                tokens += 1
                if s.first_token is None:
                    s.first_token = end
                    self.first_tokens.append((end, end - s.req.arrival))
                if s.produced >= s.req.output_tokens:
                    done.append(s)
        st = self.stats
        st.steps += 1
        st.busy_s += end - start
        st.output_tokens += tokens
        if tokens:
            st.deposit(start, end, tokens)
        self.clock = end
        for s in done:
            self._retire(s, end)

    def _preempt(self, s: SimRequest) -> None:
        self.running.remove(s)
        self.kv.free(s.key)
        s.computed = 0
        s.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(s)
        self._admission_blocked = False

    def _retire(self, s: SimRequest, t: float) -> None:
        s.finish = t
        self.running.remove(s)
        self.kv.free(s.key)
        self.finished.append(s)
        self._admission_blocked = False
