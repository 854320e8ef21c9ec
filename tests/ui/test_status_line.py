"""The status strip's line names the dtype and why it was chosen."""

from __future__ import annotations

from engine import ServingStats
from engine.kv_cache import KVCacheStats
from ui.status import dtype_words, status_line


def stats(dtype: str, reason: str) -> ServingStats:
    kv = KVCacheStats(num_blocks=8, block_size=16, used_blocks=2, cached_blocks=0,
                      free_blocks=6, used_slots=20, reserved_slots=32, prefix_queries=0,
                      prefix_hits=0)
    return ServingStats(model="SmolLM2", device="cpu", dtype=dtype, dtype_reason=reason,
                        num_running=1, num_waiting=0, running_ids=("a",), waiting_ids=(),
                        num_finished=0, num_output_tokens=0, kv_bytes_per_token=1,
                        kv_reserved_bytes=0, kv_used_bytes=0, kv=kv)


def test_the_line_says_why_the_dtype_was_chosen():
    reason = ("bfloat16: decode steps 2.6x (64 sequences) and 2.1x (1) as fast as float32 "
              "here, measured on the first start")
    line = status_line(stats("bfloat16", reason), ())
    assert line.endswith("SmolLM2 on cpu, bfloat16 (decode steps 2.6x (64 sequences) and 2.1x "
                         "(1) as fast as float32 here, measured on the first start)")


def test_a_reason_without_the_dtype_prefix_is_kept_whole_and_none_adds_nothing():
    remote = "chosen by the remote server (not reported over its API)"
    assert dtype_words(stats("bfloat16", remote)) == f"bfloat16 ({remote})"
    assert dtype_words(stats("float32", "")) == "float32"
