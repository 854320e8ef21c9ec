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
