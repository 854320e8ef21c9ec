"""Bad settings raise ValueError naming the field."""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig, SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(stop=[""]), "stop"),
])
def test_sampling_params_reject(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(device="tpu"), "device"),
    (dict(dtype="int3"), "dtype"),
    (dict(kv_cache_memory_gb=-1.0), "kv_cache_memory_gb"),
])
def test_engine_config_reject(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_defaults_are_valid():
    c = EngineConfig()
    assert c.block_size == 16 and c.enable_prefix_caching
    assert SamplingParams().greedy
