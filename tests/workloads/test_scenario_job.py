"""A KV scenario on an engine of its own: settings, the shared-prefix hit rate with prefix
caching on and off (real model), and nothing left running or held afterwards."""

from __future__ import annotations

import pytest

from workloads.scenario_job import ScenarioJob, scenario_config
from workloads.scenarios import get


def test_a_new_block_size_keeps_the_pool_size_in_token_slots():
    sc = get("shared_prefix")
    base = sc.engine_config()
    for bs in (1, 4, 16, 128):
        cfg = scenario_config(sc, bs)
        assert cfg.block_size == bs
        assert cfg.num_kv_blocks * bs == base.num_kv_blocks * base.block_size
        assert cfg.enable_prefix_caching is base.enable_prefix_caching
    assert scenario_config(sc, prefix_caching=False).enable_prefix_caching is False
    assert scenario_config(get("small_pool"), prefix_caching=True).num_kv_blocks == 64


def assert_ended_clean(job: ScenarioJob) -> None:
    """The thread is gone, the engine shut down, and every block back in the pool."""
    assert job.finished and job.join(0) and not job.engine._thread.is_alive()
    kv = job.final_stats.kv
    assert kv.used_blocks == 0 and kv.free_blocks + kv.cached_blocks == kv.num_blocks


@pytest.mark.model
def test_shared_prefix_hits_the_cache_with_prefix_caching_and_never_without(loaded):
    sc = get("shared_prefix")
    rates = {}
    for on in (True, False):
        job = ScenarioJob(sc, loaded, prefix_caching=on).start()
        assert job.join(timeout=300), "scenario did not end"
        assert job.error is None, job.error
        res = job.result
        assert len(res.outputs) == sc.num_users and not res.stopped
        assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in res.outputs)
        assert job.lengths() == [len(o.prompt_token_ids) + len(o.token_ids)
                                 for o in res.outputs]
        assert_ended_clean(job)
        rates[on] = res.hit_rate
        # the engine's own count agrees: prompt tokens read from cached blocks
        kv = job.final_stats.kv
        assert kv.prefix_hits == res.cached_tokens
    print(f"shared_prefix prefix-cache hit rate: on {rates[True]:.3f}, off {rates[False]:.3f}")
    assert rates[True] >= 0.80
    assert rates[False] == 0.0


@pytest.mark.model
def test_stop_cancels_the_rest_and_frees_the_blocks(loaded):
    job = ScenarioJob(get("small_pool"), loaded, block_size=32).start()
    assert job.engine.kv.block_size == 32 and job.engine.kv.num_blocks == 32
    job.stop()
    assert job.join(timeout=60)
    assert job.result.stopped and job.error is None
    assert_ended_clean(job)


def test_a_block_size_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match="block_size"):
        scenario_config(get("many_short"), 0)
