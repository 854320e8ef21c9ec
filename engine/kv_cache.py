"""Block accounting for the paged KV cache: pool, block tables, ref counts, prefix cache.

Pure Python, no tensors: the runner owns the KV tensors; this module decides which
block ids each request uses.

Every block is in exactly one of three states::

    used    ref_count > 0, in one or more block tables
    cached  ref_count == 0, still holds a full block's hash (a prefix-cache entry),
            kept in LRU order and evicted only when the free list runs dry
    free    ref_count == 0, no hash

    free + used + cached == num_blocks

Prefix caching hashes each full block chained to its parent's hash,
``hash((parent_hash, tokens))``, and compares tokens and parent on a hit. A request with a
cache salt (vLLM's `cache_salt`) starts its chain from the salt's hash instead of None, so
its blocks are hits only for requests with the same salt: one tenant of a shared engine
cannot learn from its own timings whether another sent a prompt.

Parallel sampling forks a request's prompt: `fork` gives each candidate the blocks of
the prompt's L tokens by reference count. Full blocks are never written again; the last,
partial block is (each candidate appends its own tokens there), so it is copied on
write: the first `allocate` of a candidate holding a shared tail takes a fresh block, and
the (src, dst) pair waits in `take_copies` for the step to copy its K/V::

    prompt of 37 tokens, block size 16, n = 3, after the fork (37 tokens computed)
    cand 0   [b0 b1 b2]          b0, b1 full: ref 3     b2 holds 5 of 16 slots: ref 3
    cand 1   [b0 b1 b2]
    cand 2   [b0 b1 b2]
    first writes: cand 0 copies b2 -> b7, cand 1 copies b2 -> b8, cand 2 writes b2 itself
    cand 0   [b0 b1 b7]   cand 1   [b0 b1 b8]   cand 2   [b0 b1 b2]
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    block_size: int
    used_blocks: int
    cached_blocks: int
    free_blocks: int
    used_slots: int  # token slots holding computed K/V of live requests
    reserved_slots: int  # slots in blocks held by live requests
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def waste(self) -> float:
        """Reserved-but-unused slots / reserved slots."""
        if not self.reserved_slots:
            return 0.0
        return (self.reserved_slots - self.used_slots) / self.reserved_slots

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(frozen=True)
class BlockInfo:
    """One cell of the block map."""

    block_id: int
    state: str  # "used", "cached" or "free"
    ref_count: int
    owners: tuple[str, ...]


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def salt_root(salt: str | None) -> int | None:
    """The parent hash of a request's first block: None, or its cache salt's hash."""
    return None if salt is None else hash(("cache_salt", salt))


def waste_for_block_size(lengths: Iterable[int], block_size: int) -> float:
    """Share of reserved slots left empty if each request of `lengths` tokens held
    ceil(L / block_size) whole blocks: sum(ceil(L/bs)*bs - L) / sum(ceil(L/bs)*bs).

    Only the tail of each request's last block is wasted; 0.0 when nothing is reserved.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    reserved = used = 0
    for n in lengths:
        if n < 0:
            raise ValueError(f"lengths must be >= 0, got {n}")
        reserved += -(-n // block_size) * block_size
        used += n
    return (reserved - used) / reserved if reserved else 0.0


class KVCacheManager:
    """Hands out blocks to requests; keeps block tables and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._hash_to_block: dict[int, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # full blocks of a request already hashed
        self._num_tokens: dict[str, int] = {}  # computed tokens in cache per request
        self._roots: dict[str, int] = {}  # a salted request's first parent hash
        # request -> index in its table of a partial block it shares with forked candidates
        self.shared_tails: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet done
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return len(self._free) + len(self._cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Block ids of the longest cached prefix of full blocks (cached under the same
        cache `salt`, or none).

        Capped one token short of the prompt so the last token is recomputed for logits.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        hits: list[int] = []
        parent = salt_root(salt)
        for i in range(max_blocks):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, toks)
            bid = self._hash_to_block.get(h)
            if bid is None:
                break
            blk = self.blocks[bid]
            if blk.token_ids != toks or blk.parent_hash != parent:
                break
            hits.append(bid)
            parent = h
        return hits

    # ---- allocation ----------------------------------------------------------------
    def allocate(
        self, request_id: str, num_tokens: int, cached_blocks: list[int] | None = None,
        salt: str | None = None,
    ) -> bool:
        """Grow a request's block table to hold `num_tokens` before it writes there; False
        if blocks ran out.

        `cached_blocks` (a prefix hit, first allocation only) are shared, not copied. A
        shared partial tail (after a fork) is copied on write here, its first write. A
        cache `salt` (first allocation) roots the hashes of the blocks it fills.
        """
        if salt is not None and request_id not in self.block_tables:
            self._roots[request_id] = salt_root(salt)
        table = self.block_tables.setdefault(request_id, [])
        cached_blocks = cached_blocks or []
        assert not cached_blocks or not table, "prefix hits only on a first allocation"
        need = self.blocks_needed(num_tokens) - len(table) - len(cached_blocks)
        tail = self.shared_tails.get(request_id)
        copy = tail is not None and self.blocks[table[tail]].ref_count > 1
        evictable_hits = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(need, 0) + copy > self.num_free_blocks - evictable_hits:
            if not table:
                del self.block_tables[request_id]
                self._roots.pop(request_id, None)
            return False
        if tail is not None:
            del self.shared_tails[request_id]
            if copy:
                self._copy_on_write(table, tail)
        for bid in cached_blocks:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self._cached_free[bid]
            blk.ref_count += 1
            table.append(bid)
        if cached_blocks:
            self._num_hashed[request_id] = len(cached_blocks)
            self._num_tokens[request_id] = len(cached_blocks) * self.block_size
        for _ in range(max(need, 0)):
            table.append(self._pop_free())
        return True

    def _copy_on_write(self, table: list[int], index: int) -> None:
        """Give `table` a block of its own in place of the shared block at `index`; the
        copy of its K/V is queued for the step (`take_copies`)."""
        src = table[index]
        dst = self._pop_free()
        self.blocks[src].ref_count -= 1
        assert self.blocks[src].ref_count >= 1, "a shared block has another holder"
        table[index] = dst
        self._copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block pairs whose K/V must be copied before the next step runs."""
        copies, self._copies = self._copies, []
        return copies

    def fork(self, request_id: str, child_id: str, num_tokens: int) -> None:
        """Give `child_id` the blocks of `request_id`'s first `num_tokens` tokens by
        reference count (parallel sampling). A partial last block becomes a shared tail of
        both, copied on its holders' first writes.

        Why copy the tail and not give each candidate the prompt again as a prefix-cache
        hit: a hit covers full blocks only, so every candidate would recompute the tail's
        tokens through the whole model (up to block_size - 1 each, n times), and with
        prefix caching off would recompute the whole prompt; a copy moves one block's
        slots, and works with the cache off."""
        assert child_id not in self.block_tables, child_id
        table = self.block_tables.get(request_id, [])[: self.blocks_needed(num_tokens)]
        for bid in table:
            self.blocks[bid].ref_count += 1
        self.block_tables[child_id] = list(table)
        self._num_hashed[child_id] = min(self._num_hashed.get(request_id, 0), len(table))
        self._num_tokens[child_id] = num_tokens
        if request_id in self._roots:
            self._roots[child_id] = self._roots[request_id]
        if num_tokens % self.block_size:
            self.shared_tails[request_id] = self.shared_tails[child_id] = len(table) - 1

    def _pop_free(self) -> int:
        if self._free:
            bid = self._free.popleft()
        else:
            bid, _ = self._cached_free.popitem(last=False)  # evict least recently used
            blk = self.blocks[bid]
            if self._hash_to_block.get(blk.block_hash) == bid:
                del self._hash_to_block[blk.block_hash]
            blk.block_hash = blk.parent_hash = blk.token_ids = None
        blk = self.blocks[bid]
        assert blk.ref_count == 0
        blk.ref_count = 1
        return bid

    def record_computed(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Note that K/V of the first `num_computed` tokens are in cache; hash full blocks."""
        self._num_tokens[request_id] = num_computed
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request_id]
        bs = self.block_size
        done = self._num_hashed.get(request_id, 0)
        full = min(num_computed // bs, len(table))
        parent = self.blocks[table[done - 1]].block_hash if done else self._roots.get(
            request_id)
        for i in range(done, full):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, toks)
            blk = self.blocks[table[i]]
            if blk.block_hash is None and h not in self._hash_to_block:
                blk.block_hash, blk.parent_hash, blk.token_ids = h, parent, toks
                self._hash_to_block[h] = blk.block_id
            parent = h
        self._num_hashed[request_id] = max(done, full)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def free(self, request_id: str) -> None:
        """Release a request's blocks; full hashed blocks stay cached for reuse (LRU)."""
        table = self.block_tables.pop(request_id, [])
        self.shared_tails.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        self._roots.pop(request_id, None)
        self._release(reversed(table))  # tail first, so it is evicted first

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free a request's blocks past those holding its first `num_tokens` tokens: the
        rollback of rejected speculative drafts. Blocks it keeps are untouched; the ones
        freed were never hashed (only verified, full blocks are). The table is replaced by
        a new, shorter list, so holders of the old one see it changed."""
        table = self.block_tables[request_id]
        keep = self.blocks_needed(num_tokens)
        if len(table) <= keep:
            return
        assert keep >= self._num_hashed.get(request_id, 0), "a hashed block is verified"
        self.block_tables[request_id] = table[:keep]
        self._num_tokens[request_id] = min(self._num_tokens.get(request_id, 0), num_tokens)
        self._release(reversed(table[keep:]))

    def _release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds becomes cached (it has a
        live prefix-cache hash) or free."""
        for bid in block_ids:
            blk = self.blocks[bid]
            blk.ref_count -= 1
            assert blk.ref_count >= 0
            if blk.ref_count == 0:
                if blk.block_hash is not None and self._hash_to_block.get(blk.block_hash) == bid:
                    self._cached_free[bid] = None
                else:
                    blk.block_hash = blk.parent_hash = blk.token_ids = None
                    self._free.append(bid)

    # ---- reporting -----------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        cached = len(self._cached_free)
        free = len(self._free)
        reserved = sum(len(t) for t in self.block_tables.values()) * self.block_size
        # a shared block is counted once per table: that is what each request reserves
        used = sum(self._num_tokens.get(r, 0) for r in self.block_tables)
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=self.num_blocks - cached - free,
            cached_blocks=cached,
            free_blocks=free,
            used_slots=used,
            reserved_slots=reserved,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
        )

    def held_slots(self) -> int:
        """Token slots holding live requests' computed K/V, each block counted once however
        many tables share it (`stats().used_slots` counts a shared block once per table:
        what each request would hold alone)."""
        bs, filled = self.block_size, {}
        for rid, table in self.block_tables.items():
            n = self._num_tokens.get(rid, 0)
            for j, bid in enumerate(table[: -(-n // bs)]):
                k = min(bs, n - j * bs)
                if filled.get(bid, 0) < k:
                    filled[bid] = k
        return sum(filled.values())

    def snapshot(self) -> list[BlockInfo]:
        """Every block's state, ref count and owners, for the block map."""
        owners: dict[int, list[str]] = {}
        for rid, table in self.block_tables.items():
            for bid in table:
                owners.setdefault(bid, []).append(rid)
        cached = set(self._cached_free)
        out = []
        for blk in self.blocks:
            if blk.ref_count > 0:
                state = "used"
            elif blk.block_id in cached:
                state = "cached"
            else:
                state = "free"
            out.append(BlockInfo(blk.block_id, state, blk.ref_count,
                                 tuple(owners.get(blk.block_id, ()))))
        return out
