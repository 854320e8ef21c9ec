"""The plain-torch attention backend: decode rows in padded groups, prefill chunks by SDPA.

Decode rows are sorted by context length and split into groups (`split_by_length`); each
group gathers its members' blocks into one padded copy and masks the keys past each
context with a bias::

    sorted decode rows   [ d0 d1 d2 | d3 d4 ]      context lens 5 6 7 | 30 31
    group 0 keys         3 x 2 blocks (bs 4)       bias 0 .. 0 -inf ..
    group 1 keys         2 x 8 blocks

A small group runs through the fused SDPA kernel, a large one through two batched matmuls
(`DecodeGroup.fused`). A prefill chunk with cached context before it gathers its blocks
(`PrefillChunk.gather_index`); a chunk without attends only to its own K/V.
"""

from __future__ import annotations

import torch

from engine.attention.common import Entries, FlatBatch, InputBuilder, StepInputs, decode_entries
from engine.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk, gather_index

GROUP_OVERHEAD = 24  # cost of one more decode group, in padded (request x block) units
# A decode group with at most this many padded keys in all (requests x keys) runs through
# the fused SDPA kernel; larger ones through two batched matmuls, which scale better on CPU
# (on a small CPU SDPA is 3-4x faster at 1 request and 2x slower at 16).
SDPA_MAX_KEYS = 1024


def split_by_length(num_blocks: list[int], depth: int = 2) -> list[tuple[int, int]]:
    """Split ascending per-request block counts into runs [start, end) padded separately.

    A group pads every member to its longest one; splitting saves padded work but costs
    more calls per layer. Take the best single split if it saves more than that overhead,
    then try again inside each half (up to 2**depth groups).
    """
    return _split(num_blocks, 0, len(num_blocks), depth)


def _split(nb: list[int], start: int, end: int, depth: int) -> list[tuple[int, int]]:
    if end <= start:
        return []
    whole = (end - start) * nb[end - 1]
    best, cut = whole, None
    if depth > 0:
        for i in range(start + 1, end):
            cost = (i - start) * nb[i - 1] + (end - i) * nb[end - 1] + GROUP_OVERHEAD
            if cost < best:
                best, cut = cost, i
    if cut is None:
        return [(start, end)]
    return _split(nb, start, cut, depth - 1) + _split(nb, cut, end, depth - 1)


class Gather:
    """Gather indices into one layer's cache of `num_blocks` blocks (the dummy included)."""

    def __init__(self, num_kv_heads: int, num_blocks: int, device: torch.device) -> None:
        self.num_kv_heads, self.num_blocks, self.device = num_kv_heads, num_blocks, device

    def __call__(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        return gather_index(ids, self.num_kv_heads, self.num_blocks).to(self.device)


def gathered_prefills(batch: FlatBatch, gather: Gather, block_size: int) -> list[PrefillChunk]:
    """The batch's prefill chunks for SDPA: each chunk with cached context before it gets
    the gather index of its blocks up to its context's end."""
    out = []
    for k, c in enumerate(batch.prefills):
        index = None
        if c.prior_len > 0 and k < len(batch.chunk_tables):
            index = gather(batch.chunk_tables[k][: -(-c.context_len // block_size)])
        out.append(PrefillChunk(c.start, c.length, c.context_len, index))
    return out


class TorchGroupedBackend:
    """Attention in torch ops only: decode groups padded separately, SDPA per chunk."""

    kernel = None  # no decode kernel: what the runner reports as its `decode_kernel`

    def __init__(self, inputs: InputBuilder, gather: Gather, dtype: torch.dtype) -> None:
        self.inputs, self.gather, self.dtype = inputs, gather, dtype

    def build(self, entries: Entries, block_tables: dict[str, list[int]]) -> StepInputs:
        """The step's inputs, decode rows sorted by context length (similar lengths share
        a padded group)."""
        decode = sorted(decode_entries(entries), key=lambda i: entries[i][0].num_computed_tokens)
        batch = self.inputs.flat_batch(entries, decode, block_tables)
        meta = AttentionMetadata(slot_mapping=batch.slot_mapping)
        if batch.decode is not None:
            meta.decode_groups = self.decode_groups(batch.decode.tables,
                                                    batch.decode.context_lens)
        meta.prefills = gathered_prefills(batch, self.gather, self.inputs.block_size)
        return batch.to_device(meta, self.gather.device)

    def decode_groups(self, tables: torch.Tensor, context_lens: torch.Tensor) -> list[DecodeGroup]:
        """Decode rows (sorted by length) in groups padded separately: each group's gather
        index, its -inf bias past every context, and whether SDPA runs it."""
        bs, dev = self.inputs.block_size, self.gather.device
        lens = context_lens.tolist()
        groups = []
        for start, end in split_by_length([-(-n // bs) for n in lens]):
            max_blocks = -(-lens[end - 1] // bs)
            s = end - start
            index = self.gather(tables[start:end, :max_blocks].reshape(-1))
            keys = torch.arange(max_blocks * bs)
            pad = keys[None, :] >= context_lens[start:end, None]
            bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))
            groups.append(DecodeGroup(
                start, s, index, bias.view(1, s, 1, -1).to(device=dev, dtype=self.dtype),
                pad.numel() <= SDPA_MAX_KEYS))
        return groups
