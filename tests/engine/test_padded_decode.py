"""The padded decode path (the one CUDA graphs replay) against the unpadded eager step, and
the persistent block-table rows it reads.

On CPU the padded path runs eagerly; with BATCHLENS_TEST_DEVICE=cuda (scripts/gpu_run.sh)
the same tests run with CUDA graphs captured at start-up, so "graph greedy == eager" is
checked there.
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.attention.common import BlockTables, row_bucket
from engine.attention.cuda_graphs import padded_sizes
from engine.core import EngineCore, Request
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheManager
from engine.metrics import RequestMetrics
from engine.models.loaded import LoadedModel
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.conftest import TEST_DEVICE, hf_greedy


def test_padded_sizes_are_powers_of_two_then_every_16():
    assert padded_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert padded_sizes(100)[-3:] == [80, 96, 100]
    assert padded_sizes(1) == [1] and padded_sizes(5) == [1, 2, 4, 5]


def test_block_table_rows_copy_only_new_blocks_and_are_reclaimed():
    bt = BlockTables(width=2, rows=2)
    live = {"a": [7], "b": [3, 4]}
    ra, rb = bt.sync("a", live["a"], live), bt.sync("b", live["b"], live)
    assert ra != rb and bt.array[ra, :1].tolist() == [7] and bt.array[rb, :2].tolist() == [3, 4]
    live["a"].extend([8, 9])  # grew past the width: the array widens
    assert bt.sync("a", live["a"], live) == ra and bt.array[ra, :3].tolist() == [7, 8, 9]
    del live["b"]  # finished: its row is reused when rows run out
    live["c"] = [5]
    assert bt.sync("c", live["c"], live) == rb and bt.array[rb, 0] == 5
    live["a"] = [1]  # freed and admitted again: a new list, copied from the start
    assert bt.sync("a", live["a"], live) == ra and bt.array[ra, 0] == 1
    live["d"] = [2]  # no stale row left: the array doubles its rows
    assert bt.sync("d", live["d"], live) >= 2 and bt.array.shape[0] == 4


def _core(loaded: LoadedModel, num_blocks: int = 64, block_size: int = 8) -> EngineCore:
    kv = KVCacheManager(num_blocks, block_size)
    runner = ModelRunner(loaded.model, num_blocks, block_size, max_num_seqs=8)
    return EngineCore(runner, kv, Scheduler(kv, 8, 512), loaded.tokenizer,
                      loaded.eos_token_ids, max_model_len=2048)


@pytest.mark.model
def test_a_padded_step_matches_the_unpadded_step_and_writes_padding_to_the_dummy_block(
        loaded):
    core = _core(loaded)
    runner = core.runner
    prompts = [loaded.encode(t) for t in ("The capital of France is", "1, 2, 3,",
                                          "Once upon a time, in a land far away,")]
    for k, ids in enumerate(prompts):
        seq = Sequence(f"r{k}", ids, SamplingParams(max_tokens=20, ignore_eos=True),
                       RequestMetrics(0.0))
        core.add(Request(seq, IncrementalDetokenizer(loaded.tokenizer)))
    for _ in range(3):  # prefill, then two decode steps
        core.step()
    batch = core.schedule()
    entries = batch.entries
    assert len(entries) == 3 and all(n == 1 for _, n in entries)
    tables = core.kv.block_tables
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    ids, pos, meta, rows, sampled = runner.prepare(entries, tables)
    eager = loaded.model.forward(ids, pos, meta, runner.kv_caches, rows)
    eager_sampled = sampled
    d = runner.decode_rows(entries, list(range(3)), tables)
    padded = runner.padded_step(d)  # 3 rows padded to 4
    assert d.sampled == eager_sampled == [0, 1, 2]
    assert padded.shape == eager.shape
    assert padded.argmax(-1).tolist() == eager.argmax(-1).tolist()
    assert (padded - eager).abs().max().item() < 1e-4
    # K/V changed only at this step's slots and in the dummy block (the padded row)
    bs, dummy = runner.block_size, runner.dummy_block
    step_slots = set(d.slots.tolist())
    for (k0, _), (k1, _) in zip(before, runner.kv_caches, strict=True):
        changed = (k0 != k1).any(dim=(0, 3)).flatten().nonzero().flatten().tolist()
        assert set(changed) - step_slots <= {dummy * bs}
    assert (runner.kv_caches[0][0][:, dummy, 0] != 0).any()  # the padded row wrote there


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_padded_decode_greedy_equals_eager_and_transformers(kind, tiny_models, monkeypatch):
    """On CUDA the padded engine replays CUDA graphs (captured at start-up); on CPU it runs
    the same padded path eagerly. Either way its greedy tokens equal the eager engine's
    and transformers'."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models[kind]
    loaded = LoadedModel.load(str(folder), device=TEST_DEVICE, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf = hf.to(TEST_DEVICE)
    g = torch.Generator().manual_seed(2)
    # 5 requests: decode steps of 5, padded to 8; then fewer as the short ones finish
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 25)]
    max_tokens = [16, 12, 16, 7, 10]
    ref = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = {}
    for padded in (False, True):
        monkeypatch.setenv("BATCHLENS_CUDA_GRAPHS", "1" if padded else "0")
        config = EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=4,
                              max_num_batched_tokens=128, num_kv_blocks=64, max_num_seqs=16)
        with Engine(config, loaded=loaded) as engine:
            runner = engine.runner
            if TEST_DEVICE == "cuda" and padded:
                assert sorted(runner.graphs) == padded_sizes(16)  # captured at start-up
            runner.padded_decode = padded
            calls = []
            real = runner.padded_step
            runner.padded_step = (lambda d, _real=real, _calls=calls:
                                  _calls.append(len(d.sampled)) or _real(d))
            outs[padded] = [o.token_ids for o in engine.generate(prompts, params)]
        assert bool(calls) == padded  # decode-only steps took the padded path
    assert outs[True] == outs[False] == ref


def test_row_buckets_are_exact_when_small_then_bounded_with_little_padding():
    buckets = {row_bucket(n) for n in range(1, 2049)}
    assert [row_bucket(n) for n in range(1, 33)] == list(range(1, 33))
    assert all(row_bucket(n) >= n for n in range(1, 5000))
    assert row_bucket(33) == 36 and row_bucket(129) == 144 and row_bucket(513) == 576
    assert len(buckets) == 32 + 24 + 24 + 24  # a bounded set of matmul shapes
    padded = sum(row_bucket(n) - n for n in range(33, 2049)) / sum(range(33, 2049))
    assert padded < 0.03


def test_bucketed_rows_pad_with_a_self_contained_chunk_and_keep_greedy_tokens(
        tiny_models, monkeypatch):
    """Where oneDNN would keep a kernel per row count, a step's rows (and its LM-head rows)
    are padded to a bucket by one padding chunk writing to the dummy block: the real rows'
    greedy tokens equal the unpadded engine's and transformers'."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models["llama"]
    loaded = LoadedModel.load(str(folder), device=TEST_DEVICE, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    # 61 rows in the first step: bucketed to 64
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (13, 41, 7)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 5, 12)]
    ref = [hf_greedy(hf, p, m.max_tokens) for p, m in zip(prompts, params, strict=True)]
    outs, shapes = {}, {}
    for bucket in (False, True):
        config = EngineConfig(device="cpu", dtype="float32", block_size=4,
                              max_num_batched_tokens=128, num_kv_blocks=64, max_num_seqs=8)
        with Engine(config, loaded=loaded) as engine:
            runner = engine.runner
            runner.bucket_rows = bucket
            seen = shapes[bucket] = []
            real = runner.model.forward

            def forward(ids, pos, meta, caches, rows, _real=real, _seen=seen, _r=runner):
                dummy = int((meta.slot_mapping // _r.block_size == _r.dummy_block).sum())
                _seen.append((ids.shape[0], rows.shape[0], dummy))
                return _real(ids, pos, meta, caches, rows)

            runner.model.forward = forward
            try:
                outs[bucket] = [o.token_ids for o in engine.generate(prompts, params)]
            finally:
                del runner.model.forward
    assert outs[True] == outs[False] == ref
    assert len(shapes[True]) == len(shapes[False])  # the same schedule, step by step
    for (t, r, dummy), (t0, r0, dummy0) in zip(shapes[True], shapes[False], strict=True):
        assert (t, r) == (row_bucket(t0), row_bucket(r0) if r0 else 0)
        assert dummy0 == 0 and dummy == t - t0  # padding rows write to the dummy block only
    assert any(t != t0 for (t, *_), (t0, *_) in zip(shapes[True], shapes[False], strict=True))
