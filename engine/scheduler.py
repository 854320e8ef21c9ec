"""Continuous batching: which requests run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`). Running requests are served
first, in arrival order (decode: one token; unfinished prefill: a chunk), then waiting
requests are admitted FCFS while budget, `max_num_seqs` and free blocks allow. A long
prompt is prefilled in chunks across steps while others keep decoding. When blocks run
out, the newest running request is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed later (its prefix may still be cached). A request that asks for its
prompt's log-probabilities takes no prefix-cache hit (cached tokens have no logits).

With speculative decoding a decoding request also brings its drafts (`spec_token_ids`):
they take budget and blocks like prompt tokens, are trimmed to what the budget leaves,
and are dropped rather than preempt anyone when blocks run short.

Parallel sampling: a request of n candidates is admitted once n slots of `max_num_seqs`
are free, and its first candidate prefills the whole prompt (the others wait in its
`siblings`). The step that computes the prompt's last token samples every candidate's
first token from that one logits row, each with its own generator (engine/runner.py);
then `fork` gives the others the first one's blocks (see engine/kv_cache.py) and puts
them in the running list right after it. From there each candidate is a request of its
own: its first write copies the shared tail block, and it may be preempted and
recomputed alone, its prompt then a prefix-cache hit where the blocks are still cached.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.sequence import Sequence, Status

MIN_PREFILL_CHUNK = 32


def prefill_chunk_cap(computed: int, max_attention: int | None) -> int | None:
    """The most prompt tokens one step may prefill for a request with `computed` tokens
    already in the KV cache: a chunk's attention work grows with chunk x context, so long
    contexts get shorter chunks (never below `MIN_PREFILL_CHUNK`). None: no cap."""
    if max_attention is None:
        return None
    return max(MIN_PREFILL_CHUNK, max_attention // max(computed, 1))


@dataclass
class ScheduledBatch:
    """What one step computes: (sequence, number of new tokens) pairs."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks
    num_preempted: int = 0
    num_admitted: int = 0  # the last entries came from the waiting queue in this step

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @property
    def is_empty(self) -> bool:
        return not self.entries


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
        max_prefill_attention: int | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_attention = max_prefill_attention
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # While requests run, admit waiting ones only once this many slots are free (or
        # every waiting one fits): 1 admits at once. Where decode steps replay a CUDA graph
        # and any step with a prompt runs eagerly, admitting in waves keeps most steps
        # decode-only (the core sets it; see EngineCore).
        self.min_admit_slots = 1

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        entries, running = batch.entries, self.running
        tables, bs = self.kv.block_tables, self.kv.block_size
        i = 0
        shared = self.kv.shared_tails
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            drafts = seq.spec_token_ids  # speculative decoding: verified with the last token
            n = min(seq.num_tokens - computed + len(drafts), budget)
            cap = prefill_chunk_cap(computed, self.max_prefill_attention)
            if cap is not None and n > cap:
                n = cap
            if drafts:
                n = self._fit_drafts(seq, n)
            table = tables.get(seq.request_id)
            # most decode steps fit the blocks a request holds (it needs a new one every
            # block_size tokens): only ask the KV manager when they do not, or when the
            # request's next write is into a block it shares (copy on write)
            if table is None or len(table) * bs < computed + n or seq.request_id in shared:
                while not self.kv.allocate(seq.request_id, computed + n):
                    victim = running[-1]
                    self._preempt(victim)
                    batch.num_preempted += 1
                    if victim is seq:
                        n = 0
                        break
                if n == 0:
                    break  # seq itself was preempted (it was the newest)
            entries.append((seq, n))
            budget -= n
            i += 1
        batch.copies = self.kv.take_copies()
        if batch.num_preempted or not self.waiting:
            return batch  # no admissions in a step that had to preempt
        # forked candidates still to come hold their slots already
        slots = len(running) + sum(len(s.siblings) for s in running)
        free = self.max_num_seqs - slots
        if entries and free < min(self.min_admit_slots, len(self.waiting)):
            return batch  # wait until a wave of requests can be admitted together
        while self.waiting and budget > 0 and slots < self.max_num_seqs:
            seq = self.waiting[0]
            if slots + 1 + len(seq.siblings) > self.max_num_seqs:
                break  # all of a request's candidates are admitted together
            hits: list[int] = []
            # cached tokens have no logits: one that needs its prompt's skips the prefix
            # cache (vLLM's skip_reading_prefix_cache), uncounted in its queries
            lookup = not seq.wants_prompt_logits
            if lookup and seq.num_computed_tokens == 0:
                hits = self.kv.find_cached_prefix(seq.token_ids, seq.params.cache_salt)
            num_cached = len(hits) * self.kv.block_size
            n = min(seq.num_tokens - num_cached, budget)
            cap = prefill_chunk_cap(num_cached, self.max_prefill_attention)
            if cap is not None and n > cap:
                n = cap
            if not self.kv.allocate(seq.request_id, num_cached + n, hits,
                                    seq.params.cache_salt):
                break
            if lookup:
                self.kv.record_prefix_lookup(seq.num_tokens, num_cached)
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.entries.append((seq, n))
            batch.num_admitted += 1
            slots += 1 + len(seq.siblings)
            budget -= n
        return batch

    def fork(self, seq: Sequence) -> list[Sequence]:
        """Fork `seq`'s waiting candidates from it once its whole prompt is computed (their
        first tokens are sampled from its last row): they share its blocks and run right
        after it in `running`. The forked candidates, in order."""
        computed = len(seq.prompt_token_ids)
        assert seq.num_computed_tokens == computed, "candidates fork after the prompt"
        at = self.running.index(seq) + 1
        siblings, seq.siblings = seq.siblings, []
        for j, sib in enumerate(siblings):
            self.kv.fork(seq.request_id, sib.request_id, computed)
            sib.num_computed_tokens = computed
            sib.num_cached_tokens = seq.num_cached_tokens
            sib.prompt_logprobs[:] = seq.prompt_logprobs
            sib.status = Status.RUNNING
            if sib.metrics.first_scheduled_time is None:
                sib.metrics.first_scheduled_time = seq.metrics.first_scheduled_time
            self.running.insert(at + j, sib)
        return siblings

    def _fit_drafts(self, seq: Sequence, n: int) -> int:
        """Trim a request's drafts to the `n` tokens the budget gives it, and drop them when
        the blocks they need are not free (drafts never preempt anyone); its tokens now."""
        drafts, computed = seq.spec_token_ids, seq.num_computed_tokens
        remaining = seq.num_tokens - computed
        del drafts[max(n - remaining, 0) :]
        if drafts and not self.kv.allocate(seq.request_id, computed + remaining + len(drafts)):
            drafts.clear()
        return remaining + len(drafts)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's blocks and requeue it at the front for recompute."""
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.spec_token_ids = []
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
        seq.siblings = []  # candidates not forked yet end with it (the core ends them)
        seq.status = Status.FINISHED
