"""The KV pool is sized against memory before it is allocated (engine/memory/budget.py)."""

from __future__ import annotations

import pytest

from engine.memory.budget import (
    GIB,
    MemoryBudget,
    check_pool_memory,
    gib,
    largest_pool,
    memory_budget,
    pool_bytes,
)

PER_TOKEN = 23_040  # SmolLM2-135M in bfloat16: 2 x 30 layers x 3 KV heads x 64 x 2 bytes
BUDGET = MemoryBudget("RAM", 20 * GIB, 2 * GIB)  # 18 GiB may go to a pool


def test_pool_bytes_are_blocks_times_block_size_times_bytes_per_token():
    assert pool_bytes(2912, 16, PER_TOKEN) == 2912 * 16 * PER_TOKEN
    assert gib(pool_bytes(2912, 16, PER_TOKEN)) == "1.00 GiB"
    assert gib(10_000_000 * 16 * PER_TOKEN) == "3,433 GiB"


def test_a_pool_that_fits_passes():
    check_pool_memory(2912, 16, PER_TOKEN, budget=BUDGET)
    fits = largest_pool(16, PER_TOKEN, BUDGET)
    check_pool_memory(fits, 16, PER_TOKEN, budget=BUDGET)  # the largest one, exactly


def test_an_oversized_pool_is_refused_in_one_line_naming_the_limit_and_what_fits():
    with pytest.raises(ValueError) as err:
        check_pool_memory(10_000_000, 16, PER_TOKEN, budget=BUDGET)
    text = str(err.value)
    fits = largest_pool(16, PER_TOKEN, BUDGET)
    assert "\n" not in text and text.startswith("num_kv_blocks: ")
    assert "10,000,000 blocks x 16 tokens (3,433 GiB)" in text
    assert "18.00 GiB of RAM" in text  # the limit: available minus the reserve
    assert f"the largest pool that fits is {fits:,} blocks" in text
    check_pool_memory(fits, 16, PER_TOKEN, budget=BUDGET)
    with pytest.raises(ValueError):
        check_pool_memory(fits + 1, 16, PER_TOKEN, budget=BUDGET)


def test_block_size_1024_with_the_default_block_count_is_refused():
    """The issue's case: 2,912 blocks of 1,024 tokens ask ~64 GiB of a 24 GiB machine."""
    with pytest.raises(ValueError, match=r"2,912 blocks x 1024 tokens \(63.98 GiB\)"):
        check_pool_memory(2912, 1024, PER_TOKEN, budget=MemoryBudget("RAM", 20 * GIB, GIB))


def test_this_machine_reports_its_ram_and_keeps_a_reserve():
    budget = memory_budget("cpu")
    assert budget is not None and budget.what == "RAM"
    assert budget.available > 0 and budget.reserve >= GIB
    assert budget.limit == max(budget.available - budget.reserve, 0)


@pytest.mark.model
def test_the_default_pool_shrinks_to_the_ram_free_but_an_asked_one_does_not(loaded,
                                                                           monkeypatch):
    """A busy machine: the default 1 GiB pool becomes what fits (at least 16,384 tokens);
    a pool the caller sized is refused as before."""
    from engine import Engine, EngineConfig
    from engine import engine as engine_module

    per_token = loaded.model.arch.kv_bytes_per_token(loaded.model.dtype)
    tight = MemoryBudget("RAM", GIB + 900 * 2**20, GIB)  # 900 MiB free for a pool
    monkeypatch.setattr(engine_module, "memory_budget", lambda device: tight)
    with Engine(EngineConfig(device="cpu"), loaded=loaded) as engine:
        assert engine.kv.num_blocks == largest_pool(16, per_token, tight)
        assert engine.pool_tokens >= 16_384
    with pytest.raises(ValueError, match="num_kv_blocks: a pool of"):
        Engine(EngineConfig(device="cpu", kv_cache_memory_gb=1.0), loaded=loaded)
    starved = MemoryBudget("RAM", GIB + 2**20, GIB)  # 1 MiB: below the floor, refused
    monkeypatch.setattr(engine_module, "memory_budget", lambda device: starved)
    with pytest.raises(ValueError, match="the largest pool that fits"):
        Engine(EngineConfig(device="cpu"), loaded=loaded)
