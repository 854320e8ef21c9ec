"""A replaced shared engine gives its memory back, although finished jobs still hold it."""

from __future__ import annotations

import gc

from engine import EngineConfig, SamplingParams
from ui.shared import SharedEngine


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def test_rss_after_rebuilds_stays_within_ten_percent(loaded):
    """Four rebuilds of a 1 GiB pool, alternating block sizes (each keeping the pool's
    bytes), each old engine still referenced the way a finished race in another session
    references it (its request handles hold the engine's `cancel`)."""
    holder = SharedEngine(loaded, EngineConfig(kv_cache_memory_gb=1.0))
    kept = []  # what finished races would keep: their handles
    try:
        kept.append(holder.engine.submit("Hello", SamplingParams(max_tokens=2)))
        kept[-1].result(timeout=60)
        gc.collect()
        before = rss_bytes()
        blocks, size = holder.engine.kv.num_blocks, holder.engine.kv.block_size
        for block_size in (32, 8, 64, 16):
            old = holder.engine
            holder.rebuild(EngineConfig(block_size=block_size,
                                        num_kv_blocks=blocks * size // block_size))
            assert holder.wait_drained(timeout=60)
            assert old.runner is None  # released, though `kept` still reaches it
            kept.append(holder.engine.submit("Hello", SamplingParams(max_tokens=2)))
            kept[-1].result(timeout=60)
        after = rss_bytes()
        assert after <= 1.10 * before, (f"RSS {before / 2**30:.2f} GiB before the rebuilds, "
                                         f"{after / 2**30:.2f} GiB after")
    finally:
        holder.shutdown()


def test_a_cleared_shared_engine_gives_its_pool_back(loaded):
    """Clearing the cache (`shared_engine.clear()`, or Streamlit's "Clear cache") shuts the
    shared engine down; its 1 GiB pool goes back to the OS although a finished job of some
    session still holds the engine."""
    gc.collect()
    before = rss_bytes()
    holder = SharedEngine(loaded, EngineConfig(kv_cache_memory_gb=1.0))
    kept = holder.engine.submit("Hello", SamplingParams(max_tokens=2))
    kept.result(timeout=60)
    assert rss_bytes() > before + 2**30 * 0.9  # the pool is written when it is allocated
    holder.shutdown()
    assert holder.engine.runner is None  # released, though `kept` still reaches it
    after = rss_bytes()
    assert after <= before + 2**30 * 0.25, (f"RSS {before / 2**30:.2f} GiB before the engine,"
                                           f" {after / 2**30:.2f} GiB after its shutdown")
