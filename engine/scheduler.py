"""Continuous batching: which requests run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`). Running requests are served
first, in arrival order (decode: one token; unfinished prefill: a chunk), then waiting
requests are admitted FCFS while budget, `max_num_seqs` and free blocks allow. A long
prompt is prefilled in chunks across steps while others keep decoding. When blocks run
out, the newest running request is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed later (its prefix may still be cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """What one step computes: (sequence, number of new tokens) pairs."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @property
    def is_empty(self) -> bool:
        return not self.entries


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_remaining, budget)
            while not self.kv.allocate(seq.request_id, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    n = 0
                    break
            if n == 0:
                break  # seq itself was preempted (it was the newest)
            batch.entries.append((seq, n))
            scheduled.add(seq.request_id)
            budget -= n
            i += 1
        if batch.num_preempted:
            return batch  # no admissions in a step that had to preempt
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits: list[int] = []
            if seq.num_computed_tokens == 0:
                hits = self.kv.find_cached_prefix(seq.token_ids)
            num_cached = len(hits) * self.kv.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate(seq.request_id, num_cached + n, hits):
                break
            self.kv.record_prefix_lookup(seq.num_tokens, num_cached)
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.entries.append((seq, n))
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's blocks and requeue it at the front for recompute."""
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or cancelled) request and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = Status.FINISHED
