"""Block pool, block tables, ref counts and the prefix cache, with five-block pools."""

from __future__ import annotations

import pytest
from kv_checks import check_invariants

from engine.kv_cache import KVCacheManager


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.allocate("a", 9)  # 3 blocks
    assert kv.block_tables["a"] == [0, 1, 2]
    assert not kv.allocate("b", 9)  # only 2 left
    assert "b" not in kv.block_tables
    assert kv.allocate("b", 8)
    assert kv.num_free_blocks == 0
    check_invariants(kv)
    kv.free("a")
    kv.free("b")
    assert kv.stats().used_blocks == 0
    assert kv.num_free_blocks == 5
    check_invariants(kv)


def test_prefix_hit_shares_blocks_and_caps_one_token_short():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    tokens = list(range(10, 22))  # 12 tokens = 3 full blocks
    assert kv.allocate("a", 12)
    kv.record_computed("a", tokens, 12)
    # the same 12 tokens: only 2 blocks may hit (the last token is recomputed)
    hits = kv.find_cached_prefix(tokens)
    assert hits == kv.block_tables["a"][:2]
    assert kv.allocate("b", 12, hits)
    assert kv.block_tables["b"][:2] == hits
    assert kv.blocks[hits[0]].ref_count == 2
    check_invariants(kv)


def test_a_cache_salt_keeps_its_blocks_to_requests_with_the_same_salt():
    """vLLM's cache_salt: blocks computed under a salt are hits for that salt only; an
    unsalted request and another tenant's salt miss, and a fork keeps its parent's salt."""
    kv = KVCacheManager(num_blocks=12, block_size=4)
    tokens = list(range(10, 22))  # 3 full blocks
    assert kv.allocate("a", 12, salt="tenant-a")
    kv.record_computed("a", tokens, 12)
    assert kv.find_cached_prefix(tokens, "tenant-a") == kv.block_tables["a"][:2]
    assert kv.find_cached_prefix(tokens) == []
    assert kv.find_cached_prefix(tokens, "tenant-b") == []
    assert kv.allocate("plain", 12)
    kv.record_computed("plain", tokens, 12)  # the same tokens unsalted: blocks of their own
    assert kv.find_cached_prefix(tokens) == kv.block_tables["plain"][:2]
    assert set(kv.block_tables["plain"]).isdisjoint(kv.block_tables["a"])
    kv.fork("a", "a#1", 12)
    assert kv.allocate("a#1", 13)
    kv.record_computed("a#1", tokens + [1, 2, 3, 4], 16)  # its 4th block, under the salt
    hits = kv.find_cached_prefix(tokens + [1, 2, 3, 4, 5], "tenant-a")
    assert hits == kv.block_tables["a#1"][:4]
    for rid in ("a", "a#1", "plain"):
        kv.free(rid)
    assert kv.find_cached_prefix(tokens, "tenant-a") != []  # cached after free, LRU
    check_invariants(kv)


def test_tokens_are_compared_on_hit():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    assert kv.allocate("a", 4)
    kv.record_computed("a", [1, 2, 3, 4], 4)
    assert kv.find_cached_prefix([1, 2, 9, 9, 9]) == [kv.block_tables["a"][0]]
    assert kv.find_cached_prefix([7, 2, 3, 4, 5]) == []


def test_freed_cached_blocks_are_reused_lru():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    kv.allocate("a", 4)
    kv.record_computed("a", [1, 2, 3, 4], 4)
    kv.free("a")
    s = kv.stats()
    assert (s.cached_blocks, s.free_blocks) == (2, 3)
    # still a hit after being freed
    hits = kv.find_cached_prefix([1, 2, 3, 4, 5])
    assert len(hits) == 2
    # a big request first takes the 3 free blocks, then evicts cached ones (tail first)
    assert kv.allocate("b", 8)
    assert kv.stats().cached_blocks == 1
    assert kv.find_cached_prefix([1, 2, 3, 4, 5]) == hits[:1]
    check_invariants(kv)


def test_prefix_caching_off_caches_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=False)
    kv.allocate("a", 4)
    kv.record_computed("a", [1, 2, 3, 4], 4)
    kv.free("a")
    assert kv.stats().cached_blocks == 0
    assert kv.find_cached_prefix([1, 2, 3, 4, 5]) == []


def test_waste_counts_only_unused_tail_slots():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    kv.allocate("a", 5)
    kv.record_computed("a", list(range(5)), 5)
    s = kv.stats()
    assert (s.reserved_slots, s.used_slots) == (8, 5)
    assert s.waste == pytest.approx(3 / 8)


def test_held_slots_count_a_forked_prompt_once():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate("a", 6)
    kv.record_computed("a", list(range(6)), 6)
    kv.fork("a", "b", 6)
    kv.fork("a", "c", 6)
    assert kv.stats().used_slots == 18 and kv.held_slots() == 6  # 3 tables, one prompt
    kv.allocate("b", 7)  # b writes its own token: its tail is copied on write
    kv.record_computed("b", [*range(6), 9], 7)
    assert kv.held_slots() == 6 + 7 - 4  # a's blocks, and b's tail of 3 tokens
    kv.free("a")
    kv.free("b")
    kv.free("c")
    assert kv.held_slots() == 0
    check_invariants(kv)


def test_snapshot_matches_stats():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    kv.allocate("a", 4)
    kv.record_computed("a", [1, 2, 3, 4], 4)
    kv.allocate("b", 5, kv.find_cached_prefix([1, 2, 3, 4, 5]))
    kv.free("a")
    snap = kv.snapshot()
    s = kv.stats()
    assert sum(b.state == "used" for b in snap) == s.used_blocks
    assert sum(b.state == "cached" for b in snap) == s.cached_blocks
    assert sum(b.state == "free" for b in snap) == s.free_blocks
    assert all(b.owners == ("b",) for b in snap if b.state == "used")


@pytest.mark.parametrize("field,kwargs", [
    ("num_kv_blocks", dict(num_blocks=0, block_size=4)),
    ("block_size", dict(num_blocks=4, block_size=0)),
])
def test_bad_sizes_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        KVCacheManager(**kwargs)


def test_decode_groups_split_only_when_padding_is_costly():
    from engine.attention.torch_grouped import split_by_length

    assert split_by_length([3, 3, 3, 4]) == [(0, 4)]  # splitting saves less than overhead
    groups = split_by_length([1] * 30 + [35] * 30)
    assert groups == [(0, 30), (30, 60)]
    lens = sorted([1, 2, 5, 9, 20, 20, 33, 34, 35] * 6)
    groups = split_by_length(lens)
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a < b for a, b in groups) and len(groups) <= 4
    assert all(g1[1] == g2[0] for g1, g2 in zip(groups, groups[1:], strict=False))
    assert split_by_length([]) == []


# ---- parallel sampling: fork and copy on write -------------------------------------------
def test_fork_shares_the_prompt_blocks_by_reference_count():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 10)  # 10 tokens: 2 full blocks and a partial one
    kv.fork("a", "b", 10)
    kv.fork("a", "c", 10)
    assert kv.block_tables["b"] == kv.block_tables["c"] == kv.block_tables["a"]
    assert [kv.blocks[b].ref_count for b in kv.block_tables["a"]] == [3, 3, 3]
    assert kv.shared_tails == {"a": 2, "b": 2, "c": 2}
    assert kv.stats().used_blocks == 3
    check_invariants(kv)


def test_a_block_aligned_fork_shares_no_tail():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 8)
    kv.fork("a", "b", 8)
    assert kv.shared_tails == {}
    assert kv.allocate("b", 9)  # the next token goes to a block of its own
    assert kv.block_tables["b"][:2] == kv.block_tables["a"] and kv.take_copies() == []
    check_invariants(kv)


def test_the_partial_block_is_copied_on_the_first_write_and_the_last_holder_keeps_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 10)
    tail = kv.block_tables["a"][2]
    kv.fork("a", "b", 10)
    kv.fork("a", "c", 10)
    assert kv.allocate("a", 11)  # a writes token 10 into the shared tail: copies it
    [(src, dst)] = kv.take_copies()
    assert src == tail and kv.block_tables["a"][2] == dst != tail
    assert kv.blocks[tail].ref_count == 2 and kv.blocks[dst].ref_count == 1
    assert kv.allocate("b", 11)
    assert kv.take_copies()[0][0] == tail
    assert kv.allocate("c", 11)  # the last holder writes into the block itself
    assert kv.take_copies() == [] and kv.block_tables["c"][2] == tail
    assert kv.blocks[tail].ref_count == 1 and kv.shared_tails == {}
    assert kv.allocate("c", 12) and kv.take_copies() == []  # no copy ever again
    check_invariants(kv)


def test_a_copy_on_write_needs_a_free_block():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate("a", 10)
    kv.fork("a", "b", 10)
    assert not kv.allocate("a", 11)  # no block to copy the tail into
    assert kv.block_tables["a"] == kv.block_tables["b"] and kv.shared_tails["a"] == 2
    kv.free("b")
    assert kv.allocate("a", 11) and kv.take_copies() == []  # alone now: no copy
    check_invariants(kv)


def test_freeing_every_candidate_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10, 20))
    assert kv.allocate("a", 10)
    kv.record_computed("a", tokens, 10)
    for child in ("b", "c"):
        kv.fork("a", child, 10)
    assert kv.allocate("b", 11)
    for rid in ("a", "b", "c"):
        kv.free(rid)
    s = kv.stats()
    assert s.used_blocks == 0 and s.cached_blocks == 2  # the prompt's full blocks stay cached
    assert kv.shared_tails == {} and not kv.block_tables
    check_invariants(kv)
