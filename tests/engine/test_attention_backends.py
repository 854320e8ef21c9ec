"""Each attention backend's metadata builder on a hand-made batch, with no model.

The batch (block size 4, a pool of 10 blocks plus the dummy block 10, 2 kv heads)::

    entry 0  a: 5 prompt + 2 output tokens, decoding position 6   table [3, 7]
    entry 1  c: 10-token prompt, 4 cached, a chunk of 6 (4..9)     table [1, 2, 9]
    entry 2  b: 2 prompt + 1 output token, decoding position 2     table [5]

    slots: a 7 * 4 + 2 = 30; b 5 * 4 + 2 = 22; c 8 9 10 11 (block 2) 36 37 (block 9)
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.attention.common import InputBuilder, row_bucket
from engine.attention.cuda_graphs import PaddedDecode
from engine.attention.paged_kernel import PagedKernelBackend
from engine.attention.torch_grouped import Gather, TorchGroupedBackend
from engine.config import SamplingParams
from engine.metrics import RequestMetrics
from engine.sequence import Sequence

BS, POOL, KVH = 4, 10, 2
DUMMY = POOL
CPU = torch.device("cpu")
INF = float("-inf")


def seq(rid: str, prompt: list[int], output: list[int], computed: int) -> Sequence:
    s = Sequence(rid, prompt, SamplingParams(max_tokens=8), RequestMetrics(0.0))
    s.output_token_ids.extend(output)
    s.num_computed_tokens = computed
    return s


def batch() -> tuple[list[tuple[Sequence, int]], dict[str, list[int]]]:
    a = seq("a", [11, 12, 13, 14, 15], [50, 51], computed=6)
    c = seq("c", list(range(100, 110)), [], computed=4)
    b = seq("b", [21, 22], [60], computed=2)
    return [(a, 1), (c, 6), (b, 1)], {"a": [3, 7], "c": [1, 2, 9], "b": [5]}


def builder(bucket_rows: bool = False) -> InputBuilder:
    return InputBuilder(BS, max_blocks=4, dummy_block=DUMMY, bucket_rows=bucket_rows)


def gather() -> Gather:
    return Gather(KVH, POOL + 1, CPU)


def stand_in_kernel(*args: object) -> torch.Tensor:
    raise AssertionError("a metadata builder never runs the kernel")


def test_the_torch_backend_sorts_decode_rows_into_one_group_and_gathers_the_chunk():
    entries, tables = batch()
    s = TorchGroupedBackend(builder(), gather(), torch.float32).build(entries, tables)
    assert s.input_ids.tolist() == [60, 51, 104, 105, 106, 107, 108, 109]  # b, a, then c
    assert s.positions.tolist() == [2, 6, 4, 5, 6, 7, 8, 9]
    assert s.meta.slot_mapping.tolist() == [22, 30, 8, 9, 10, 11, 36, 37]
    assert s.logits_rows.tolist() == [0, 1, 7] and s.sampled == [2, 0, 1] and s.prompt == []
    assert s.meta.kernel_decode is None
    [g] = s.meta.decode_groups  # 1 and 2 blocks: a split would save less than it costs
    assert (g.start, g.num_seqs, g.fused) == (0, 2, True)
    # rows b [5, 0], a [3, 7]; kv head 1's rows start at POOL + 1
    assert g.gather_index.tolist() == [5, 0, 3, 7, 16, 11, 14, 18]
    assert g.bias.shape == (1, 2, 1, 8)
    assert g.bias[0, :, 0].tolist() == [[0, 0, 0, INF, INF, INF, INF, INF],
                                        [0, 0, 0, 0, 0, 0, 0, INF]]
    [chunk] = s.meta.prefills
    assert (chunk.start, chunk.length, chunk.context_len, chunk.prior_len) == (2, 6, 10, 4)
    assert chunk.gather_index.tolist() == [1, 2, 9, 12, 13, 20]


def test_the_torch_backend_splits_decode_rows_of_very_different_lengths():
    entries, tables = [], {}
    for k, n in enumerate([2] * 6 + [60] * 6):  # 1 block each, then 16 blocks each
        s = seq(f"r{k}", list(range(n)), [7], computed=n)
        tables[s.request_id] = list(range(16))
        entries.append((s, 1))
    backend = TorchGroupedBackend(InputBuilder(BS, 16, 16), Gather(1, 17, CPU), torch.float32)
    groups = backend.build(entries, tables).meta.decode_groups
    assert [(g.start, g.num_seqs) for g in groups] == [(0, 6), (6, 6)]
    assert [g.bias.shape[-1] for g in groups] == [4, 64]


def test_the_kernel_backend_keeps_entry_order_and_gathers_the_chunk_for_sdpa():
    entries, tables = batch()
    backend = PagedKernelBackend(builder(), gather(), stand_in_kernel, paged_prefill=False)
    s = backend.build(entries, tables)
    assert s.input_ids.tolist() == [51, 60, 104, 105, 106, 107, 108, 109]  # a, b, then c
    assert s.meta.slot_mapping.tolist() == [30, 22, 8, 9, 10, 11, 36, 37]
    assert s.logits_rows.tolist() == [0, 1, 7] and s.sampled == [0, 2, 1]
    kd = s.meta.kernel_decode
    assert kd.kernel is stand_in_kernel and kd.num_seqs == 2
    assert kd.block_tables.tolist() == [[3, 7], [5, 0]]
    assert kd.context_lens.tolist() == [7, 3] and kd.context_lens.dtype == torch.int32
    assert not s.meta.decode_groups
    [chunk] = s.meta.prefills
    assert chunk.gather_index.tolist() == [1, 2, 9, 12, 13, 20]


def test_the_kernel_backend_with_paged_prefill_gives_every_row_to_the_kernel():
    entries, tables = batch()
    backend = PagedKernelBackend(builder(), gather(), stand_in_kernel, paged_prefill=True)
    s = backend.build(entries, tables)
    assert s.meta.prefills == [] and not s.meta.decode_groups
    kd = s.meta.kernel_decode
    assert kd.num_seqs == 8  # every row: each prefill row over its own prefix
    assert kd.block_tables.tolist() == [[3, 7, 0], [5, 0, 0]] + [[1, 2, 9]] * 6
    assert kd.context_lens.tolist() == [7, 3, 5, 6, 7, 8, 9, 10]
    assert s.logits_rows.tolist() == [0, 1, 7]


def test_bucketed_rows_end_in_a_padding_chunk_on_the_dummy_block():
    entries, tables = batch()
    long = seq("p", list(range(200, 235)), [], computed=0)  # 35 rows: 2 + 6 + 35 = 43
    entries.append((long, 35))
    tables["p"] = list(range(9))
    for backend in (TorchGroupedBackend(builder(True), gather(), torch.float32),
                    PagedKernelBackend(builder(True), gather(), stand_in_kernel, True)):
        s = backend.build(entries, tables)
        rows = row_bucket(43)
        assert rows == 44 and s.input_ids.shape[0] == rows
        assert s.meta.slot_mapping[43:].tolist() == [DUMMY * BS]
        assert s.logits_rows.tolist() == [0, 1, 7, 42]  # 4 rows: exact below 32
    kd = s.meta.kernel_decode  # the kernel's padding row: one key of the dummy block
    assert kd.block_tables[43].tolist()[0] == DUMMY and kd.context_lens[43] == 1


def test_the_padded_path_fills_fixed_buffers_and_pads_with_the_dummy_block():
    entries, tables = batch()
    # a one-token prompt chunk asking for no logprobs: computed, neither sampled nor recorded
    entries[1] = (seq("c", list(range(100, 110)), [], computed=4), 1)
    seen = {}

    def forward(ids, pos, meta, caches, rows):
        seen.update(ids=ids.clone(), pos=pos.clone(), meta=meta, rows=rows.clone())
        return torch.arange(ids.shape[0], dtype=torch.float32)[:, None].repeat(1, 5)

    model = SimpleNamespace(device=CPU, forward=forward)
    padded = PaddedDecode(model, [], stand_in_kernel, max_num_seqs=8, block_size=BS,
                          max_blocks=4, dummy_block=DUMMY)
    assert padded.sizes == [1, 2, 4, 8] and padded.fits(8) and not padded.fits(9)
    d = builder().decode_rows(entries, [0, 1, 2], tables)
    assert d.logits_rows == [0, 2] and d.sampled == [0, 2]
    logits = padded.step(d)  # 3 rows padded to 4
    assert seen["ids"].tolist() == [51, 104, 60, 0] and seen["pos"].tolist() == [6, 4, 2, 0]
    meta = seen["meta"]
    assert meta.slot_mapping.tolist() == [30, 8, 22, DUMMY * BS]
    assert meta.kernel_decode.kernel is stand_in_kernel
    assert meta.kernel_decode.block_tables.tolist() == [[3, 7], [1, 2], [5, 0], [DUMMY, 0]]
    assert meta.kernel_decode.context_lens.tolist() == [7, 5, 3, 1]
    assert logits[:, 0].tolist() == [0.0, 2.0]  # the sampled rows' logits only
