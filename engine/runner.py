"""Turns a scheduled step into flat tensors, runs the model, returns sampled tokens.

Flat batch layout for one step (T tokens)::

    rows:  [ d0 d1 d2 ... d(S-1) | p0 p0 p0 p0 | p1 p1 ... ]
             decode: 1 token each   prefill chunk of request p0, then p1 ...

    input_ids[T], positions[T], slot_mapping[T]  (slot = block_table[pos // bs] * bs + pos % bs)

Any entry with exactly one new token is attended as a decode row (its context is read
from the cache), whatever phase its request is in.
"""

from __future__ import annotations

import torch

from engine import compute
from engine.models import native
from engine.models.attention import (
    AttentionMetadata,
    DecodeGroup,
    KernelDecode,
    PrefillChunk,
    gather_index,
)
from engine.models.llama import LlamaModel, ModelSpec
from engine.sampler import sample
from engine.sequence import Sequence

GROUP_OVERHEAD = 24  # cost of one more decode group, in padded (request x block) units
# A decode group with at most this many padded keys in all (requests x keys) runs through
# the fused SDPA kernel; larger ones through two batched matmuls, which scale better on CPU
# (measured on the 2-core CPU: SDPA 3-4x faster at 1 request, 2x slower at 16).
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


class ModelRunner:
    """Owns the KV tensors and runs one step of the model."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        spec = model.spec
        self.num_kv_heads = spec.num_kv_heads
        self.decode_kernel = native.paged_decode(model.device, model.dtype)
        self.kv_caches = compute.run(self._allocate, spec, num_blocks, block_size)

    def _allocate(
        self, spec: ModelSpec, num_blocks: int, block_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        model = self.model
        shape = (spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
        return [
            (
                torch.zeros(shape, dtype=model.dtype, device=model.device),
                torch.zeros(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(spec.num_layers)
        ]

    def _gather_index(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long)
        return gather_index(ids, self.num_kv_heads, self.num_blocks).to(self.model.device)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(
        self, entries: list[tuple[Sequence, int]], block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """Build input ids, positions, attention metadata and the rows to sample.

        Returns (input_ids, positions, meta, logits_rows, sampled_entry_indices).
        """
        bs = self.block_size
        # decode rows sorted by context length, so similar lengths share a padded group
        decode = sorted((i for i, (_, n) in enumerate(entries) if n == 1),
                        key=lambda i: entries[i][0].num_computed_tokens)
        prefill = [i for i, (_, n) in enumerate(entries) if n > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[int] = []
        ctx_lens = []
        dec_tables = []
        for i in decode:
            seq, _ = entries[i]
            p = seq.num_computed_tokens
            table = block_tables[seq.request_id]
            ids.append(seq.token_at(p))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            ctx_lens.append(p + 1)
            dec_tables.append(table[: -(-(p + 1) // bs)])
            if p + 1 == seq.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled.append(i)
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
        dev = self.model.device
        if self.decode_kernel is not None and dec_tables:
            width = len(dec_tables[-1])
            meta.kernel_decode = KernelDecode(
                self.decode_kernel,
                torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.int32),
                torch.tensor(ctx_lens, dtype=torch.int32))
            dec_tables = []  # no torch-path groups
        for start, end in split_by_length([len(t) for t in dec_tables]):
            tables, lens = dec_tables[start:end], ctx_lens[start:end]
            max_blocks = len(tables[-1])
            flat = [b for t in tables for b in t + [0] * (max_blocks - len(t))]
            pad = torch.arange(max_blocks * bs)[None, :] >= torch.tensor(lens)[:, None]
            bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))
            fused = pad.numel() <= SDPA_MAX_KEYS
            meta.decode_groups.append(DecodeGroup(
                start, end - start, self._gather_index(flat),
                bias.view(1, end - start, 1, -1).to(device=dev, dtype=self.model.dtype),
                fused))
        for i in prefill:
            seq, n = entries[i]
            start = seq.num_computed_tokens
            table = block_tables[seq.request_id]
            tokens = seq.token_ids[start : start + n]
            row = len(ids)
            ids.extend(tokens)
            pos.extend(range(start, start + n))
            slots.extend(self._slots(table, start, start + n))
            ctx = start + n
            index = self._gather_index(table[: -(-ctx // bs)]) if start > 0 else None
            meta.prefills.append(PrefillChunk(row, n, ctx, index))
            if ctx == seq.num_tokens:
                logits_rows.append(row + n - 1)
                sampled.append(i)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sampled,
        )

    def execute(
        self,
        entries: list[tuple[Sequence, int]],
        block_tables: dict[str, list[int]],
        generators: dict[str, torch.Generator | None],
    ) -> dict[int, int]:
        """Run one step on the compute thread; map entry index -> sampled token for the
        requests whose last token was computed."""

        def step() -> dict[int, int]:
            ids, pos, meta, rows, sampled = self.prepare(entries, block_tables)
            logits = self.model.forward(ids, pos, meta, self.kv_caches, rows)
            params = [entries[i][0].params for i in sampled]
            gens = [generators.get(entries[i][0].request_id) for i in sampled]
            tokens = sample(logits, params, gens)
            return dict(zip(sampled, tokens, strict=True))

        return compute.run(step)
