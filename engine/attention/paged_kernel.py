"""The paged-kernel attention backend: decode rows to a kernel that reads K/V in place
through the block table (the native CPU kernel, engine/models/native.py; on CUDA the
Triton kernel, engine/models/paged_decode.py, for the steps no CUDA graph replays).

Decode rows stay in entry order: the kernel's work per row follows the row's own context,
so nothing is gained by grouping similar lengths. With `paged_prefill` (a CPU in bfloat16)
the kernel attends every row of the step, each prefill row as a query over its own prefix
(causal: the chunk's K/V are already in the cache), and no SDPA call runs::

    rows          [ d0  d1 | p0 p0 p0 | pad pad ]
    context_lens  [ 9   17 | 4  5  6  | 1   1   ]      (p0: 3 cached tokens, then 3 new)
    tables        d0's, d1's, p0's table on each of its rows, the dummy block for padding

Without it (float32, CUDA) prefill chunks run as the torch backend's: SDPA over the
gathered context.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.common import Entries, FlatBatch, InputBuilder, StepInputs, decode_entries
from engine.attention.torch_grouped import Gather, gathered_prefills
from engine.models.attention import AttentionMetadata, KernelDecode
from engine.models.native import PagedDecode


class PagedKernelBackend:
    """Decode rows (and with `paged_prefill` every row) to one paged-decode kernel call."""

    def __init__(self, inputs: InputBuilder, gather: Gather, kernel: PagedDecode,
                 paged_prefill: bool) -> None:
        self.inputs, self.gather, self.kernel = inputs, gather, kernel
        self.paged_prefill = paged_prefill

    def build(self, entries: Entries, block_tables: dict[str, list[int]]) -> StepInputs:
        """The step's inputs, decode rows in entry order."""
        batch = self.inputs.flat_batch(entries, decode_entries(entries), block_tables)
        meta = AttentionMetadata(slot_mapping=batch.slot_mapping)
        dev = self.gather.device
        if self.paged_prefill and batch.prefills:
            meta.kernel_decode = self.kernel_rows(batch)
        else:
            if (d := batch.decode) is not None:
                meta.kernel_decode = KernelDecode(self.kernel, d.tables.to(dev),
                                                  d.context_lens.to(dev))
            meta.prefills = gathered_prefills(batch, self.gather, self.inputs.block_size)
        return batch.to_device(meta, dev)

    def kernel_rows(self, batch: FlatBatch) -> KernelDecode:
        """Every row of the step for the kernel: the decode rows as they are, each prefill
        row with its request's block table and its own position + 1 keys, a padding chunk
        one key of the dummy block. No gathered copy, no SDPA call per chunk."""
        bs, chunks, d = self.inputs.block_size, batch.prefills, batch.decode
        num_real = len(batch.chunk_tables)
        widths = [-(-c.context_len // bs) for c in chunks[:num_real]]
        width = max(widths + ([d.tables.shape[1]] if d is not None else []) + [1])
        tables = np.zeros((batch.num_rows, width), dtype=np.int32)
        lens = np.ones(batch.num_rows, dtype=np.int32)
        if d is not None:
            s, w = d.tables.shape
            tables[:s, :w], lens[:s] = d.tables.numpy(), d.context_lens.numpy()
        for k, c in enumerate(chunks):
            rows = slice(c.start, c.start + c.length)
            if k < num_real:
                tables[rows, : widths[k]] = batch.chunk_tables[k][: widths[k]]
                lens[rows] = np.arange(c.prior_len + 1, c.context_len + 1, dtype=np.int32)
            else:
                tables[rows, 0] = self.inputs.dummy_block
        return KernelDecode(self.kernel, torch.from_numpy(tables), torch.from_numpy(lens))
