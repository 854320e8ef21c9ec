"""Invariants every KV cache state must hold (shared by the KV cache and scheduler tests)."""

from __future__ import annotations

from engine.kv_cache import KVCacheManager


def check_invariants(kv: KVCacheManager) -> None:
    s = kv.stats()
    assert s.free_blocks + s.used_blocks + s.cached_blocks == s.num_blocks
    holders: dict[int, int] = {}
    for table in kv.block_tables.values():
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    for blk in kv.blocks:
        assert blk.ref_count == holders.get(blk.block_id, 0)
    # per-request bookkeeping lives only as long as the request's table
    assert set(kv._roots) <= set(kv.block_tables)
    assert set(kv._num_hashed) <= set(kv.block_tables)
