"""Paged attention in plain torch: write K/V by slot mapping, read them by block table.

KV cache layout of one layer (K and V alike)::

    cache[kv_head, block, offset_in_block, head_dim]   shape [kvh, num_blocks, block_size, d]

    slot = block_id * block_size + offset   (the slot mapping of a token)

    block table of a request: [7, 2, 9]  ->  its tokens live in blocks 7, 2, 9 in order

Gathering a request's blocks along dim 1 yields its K as one contiguous
[kvh, num_blocks_of_request * block_size, d] run, which is what a decode batch needs.

Packed (5-dim), where the CPU decode kernel reads bfloat16 pairs (`native.packed_kv`: AMX
tiles or AVX512_BF16 dot products): within a block K keeps its dims in pairs, each pair row
holding the block's keys, and V its keys in pairs, so the kernel reads 16 keys' K and V as
tiles where they lie::

    k_cache[kv_head, block, d // 2, offset, d % 2]        [kvh, num_blocks, d/2, block_size, 2]
    v_cache[kv_head, block, offset // 2, d, offset % 2]   [kvh, num_blocks, block_size/2, d, 2]

Blocks are on dim 1 in both layouts: a copy of whole blocks need not know which it is.
Packed K and V are views of one pool tensor per layer (`packed_caches`), each kv head's K
block beside its V block, block after block::

    pool[block, kv_head, k_or_v, ...]                     [num_blocks, kvh, 2, block_size * d]

so what the kernel reads of one (request, kv head) per block is one run of 4 KiB (16 keys
of 64 dims), not two of 2 KiB in tensors far apart: a run the hardware prefetchers keep up
with where the block table jumps about the pool (docs/benchmarks.md).

The flat batch of one step is ordered: all decode tokens first (one per request),
then each prefill chunk. Decode tokens are attended in one padded call for the whole
batch; each prefill chunk in one call of its own (chunks are few and large). On a CPU with
the native kernel (engine/models/native.py) every row of the step, prefill rows included,
is attended by one kernel call instead, reading K/V in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.memory import pages


@dataclass
class PrefillChunk:
    """One request's prefill chunk within the flat batch."""

    start: int  # first row of the chunk in the flat batch
    length: int  # tokens in the chunk
    context_len: int  # tokens in cache after the chunk (prior context + chunk)
    gather_index: torch.Tensor | None  # gather_index of its blocks; None: no prior context

    @property
    def prior_len(self) -> int:
        return self.context_len - self.length


@dataclass
class DecodeGroup:
    """Decode rows [start, start + num_seqs) whose block tables are padded to one length."""

    start: int
    num_seqs: int
    gather_index: torch.Tensor  # gather_index of the padded block tables
    bias: torch.Tensor  # [1, S, 1, max_blocks * block_size]: 0 for real keys, -inf for padding
    fused: bool = False  # small group: SDPA with `bias` (model dtype) as its mask


@dataclass
class KernelDecode:
    """Rows [0, num_seqs) for the native kernel, which reads blocks in place: the decode
    rows, and on a CPU every row of the step (a prefill row attends to its own position + 1
    keys of its request's table: `PagedKernelBackend.paged_prefill`)."""

    kernel: Callable[..., torch.Tensor]  # native.PagedDecode
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    context_lens: torch.Tensor  # [S] int32

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


@dataclass
class AttentionMetadata:
    """Everything the attention of one step needs, built once and shared by all layers.

    Decode rows go either to `kernel_decode` (the native kernel on a CPU, or the Triton one)
    or to `decode_groups` (the torch path); never both. When `kernel_decode` covers every
    row, `prefills` is empty.
    """

    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # rows from 0 on
    prefills: list[PrefillChunk] = field(default_factory=list)
    kernel_decode: KernelDecode | None = None


def cache_shapes(num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                 packed: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of one layer's K and V cache tensors, in rows or packed (see above)."""
    if packed:
        return ((num_kv_heads, num_blocks, head_dim // 2, block_size, 2),
                (num_kv_heads, num_blocks, block_size // 2, head_dim, 2))
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return shape, shape


def packed_caches(pool: torch.Tensor, num_kv_heads: int, num_blocks: int, block_size: int,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed K and V (`cache_shapes`) as views of one layer's `pool` of
    num_blocks x kvh x 2 x block_size x head_dim elements: [block, kv head, K or V]."""
    kvh, nb, bs, d = num_kv_heads, num_blocks, block_size, head_dim
    if pool.numel() != nb * kvh * 2 * bs * d or not pool.is_contiguous():
        raise ValueError(f"pool must be {nb} x {kvh} x 2 x {bs} x {d} contiguous elements, "
                         f"got {tuple(pool.shape)}")
    head, block = 2 * bs * d, kvh * 2 * bs * d
    k_shape, v_shape = cache_shapes(kvh, nb, bs, d, True)
    k = pool.as_strided(k_shape, (head, block, 2 * bs, 2, 1), pool.storage_offset())
    v = pool.as_strided(v_shape, (head, block, 2 * d, 2, 1), pool.storage_offset() + bs * d)
    return k, v


def cache_dims(k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(kv heads, blocks, block size, head_dim) of a K cache in either layout."""
    if k_cache.dim() == 5:
        kvh, nb, half, bs, _ = k_cache.shape
        return kvh, nb, bs, 2 * half
    kvh, nb, bs, d = k_cache.shape
    return kvh, nb, bs, d


def pack_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed copies of K and V caches in rows (tests and benchmarks build them so)."""
    kvh, nb, bs, d = k_cache.shape
    return (k_cache.view(kvh, nb, bs, d // 2, 2).transpose(2, 3).contiguous(),
            v_cache.view(kvh, nb, bs // 2, 2, d).transpose(3, 4).contiguous())


def pool_caches(k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed copies of K and V caches in rows as the runner holds them: views of one pool
    (`packed_caches`), on 2 MiB pages where `pages.zeros` gives them (tests and benchmarks
    build them so)."""
    kvh, nb, bs, d = k_cache.shape
    views = packed_caches(pages.zeros((2 * k_cache.numel(),), k_cache.dtype), kvh, nb, bs, d)
    for view, packed in zip(views, pack_caches(k_cache, v_cache), strict=True):
        view.copy_(packed)
    return views


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V ([T, kvh, d]) at their slots, one indexed copy each."""
    kvh, nb, bs, d = cache_dims(k_cache)
    if k_cache.dim() == 5:
        block, off = slot_mapping // bs, slot_mapping % bs
        k_cache[:, block, :, off, :] = k.reshape(-1, kvh, d // 2, 2)  # [T, kvh, d/2, 2]
        v_cache[:, block, off // 2, :, off % 2] = v  # [T, kvh, d]
        return
    k_cache.view(kvh, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kvh, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_index(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row ids into the cache viewed as [kvh * num_blocks, block_size * d] for `block_ids`.

    Gathering whole rows along dim 0 is ~2x faster on CPU than indexing dim 1.
    """
    heads = torch.arange(num_kv_heads, device=block_ids.device)[:, None] * num_blocks
    return (heads + block_ids[None, :]).reshape(-1)


def gather_kv(cache: torch.Tensor, index: torch.Tensor, num_seqs: int,
              values: bool = False) -> torch.Tensor:
    """Read blocks by a `gather_index`: [kvh, S, max_blocks * block_size, d]. `values`: the
    cache is a V cache (packed K and V differ; in rows they do not)."""
    kvh, nb = cache.shape[:2]
    if cache.is_contiguous():
        rows = cache.view(kvh * nb, -1).index_select(0, index)
    else:  # a view of a packed pool (packed_caches): heads and blocks do not merge
        rows = cache.flatten(2)[index // nb, index % nb]
    if cache.dim() == 4:
        return rows.view(kvh, num_seqs, -1, cache.shape[3])
    if values:  # [.., bs/2, d, 2] -> [.., bs/2, 2, d]
        half, d = cache.shape[2], cache.shape[3]
        blocks = rows.view(kvh, num_seqs, -1, half, d, 2).transpose(4, 5)
    else:  # [.., d/2, bs, 2] -> [.., bs, d/2, 2]
        half, bs = cache.shape[2], cache.shape[3]
        blocks = rows.view(kvh, num_seqs, -1, half, bs, 2).transpose(3, 4)
        d = 2 * half
    return blocks.reshape(kvh, num_seqs, -1, d)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax(q k^T * scale + bias) v with q [kvh, S, group, d], k/v [kvh, S, L, d].

    Two batched matmuls and a softmax (computed in float32 inside the kernel, whatever the
    input dtype): on CPU this beats the fused SDPA kernel for many requests at once.
    `bias` is in the model dtype (0 or -inf).
    """
    scores = torch.matmul(q, k.transpose(-1, -2))
    probs = torch.softmax(scores.mul_(scale).add_(bias), dim=-1)
    return torch.matmul(probs, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a flat batch. q: [T, H, d]; k, v: [T, kvh, d] (already in cache).

    Returns [T, H * d].
    """
    t, h, d = q.shape
    kvh = k.shape[1]
    group = h // kvh
    if (kd := meta.kernel_decode) is not None and kd.num_seqs == t:  # every row by the kernel
        return kd.kernel(q, k_cache, v_cache, kd.block_tables, kd.context_lens, scale).view(t, -1)
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if (kd := meta.kernel_decode) is not None:
        s = kd.num_seqs
        out[:s] = kd.kernel(q[:s], k_cache, v_cache, kd.block_tables, kd.context_lens, scale)
    for g in meta.decode_groups:
        rows, s = slice(g.start, g.start + g.num_seqs), g.num_seqs
        # query heads of one kv head act as that head's "query length": [kvh, S, group, d]
        qd = q[rows].view(s, kvh, group, d).transpose(0, 1)
        kd = gather_kv(k_cache, g.gather_index, s)
        vd = gather_kv(v_cache, g.gather_index, s, values=True)
        if g.fused:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.bias, scale=scale)
        else:
            od = decode_attention(qd, kd, vd, g.bias, scale)
        out[rows] = od.transpose(0, 1).reshape(s, h, d)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if chunk.gather_index is None:
            kc = k[rows].transpose(0, 1).unsqueeze(0)
            vc = v[rows].transpose(0, 1).unsqueeze(0)
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kc = gather_kv(k_cache, chunk.gather_index, 1)[:, :, : chunk.context_len].transpose(0, 1)
            vc = gather_kv(v_cache, chunk.gather_index, 1, values=True)[
                :, :, : chunk.context_len].transpose(0, 1)
            qpos = torch.arange(chunk.prior_len, chunk.context_len, device=q.device)
            kpos = torch.arange(chunk.context_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[rows] = oc[0].transpose(0, 1)
    return out.view(t, h * d)
