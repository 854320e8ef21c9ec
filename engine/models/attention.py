"""Paged attention in plain torch: write K/V by slot mapping, read them by block table.

KV cache layout of one layer (K and V alike)::

    cache[kv_head, block, offset_in_block, head_dim]   shape [kvh, num_blocks, block_size, d]

    slot = block_id * block_size + offset   (the slot mapping of a token)

    block table of a request: [7, 2, 9]  ->  its tokens live in blocks 7, 2, 9 in order

Gathering a request's blocks along dim 1 yields its K as one contiguous
[kvh, num_blocks_of_request * block_size, d] run, which is what a decode batch needs.

The flat batch of one step is ordered: all decode tokens first (one per request),
then each prefill chunk. Decode tokens are attended in one padded call for the whole
batch; each prefill chunk in one call of its own (chunks are few and large).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request's prefill chunk within the flat batch."""

    start: int  # first row of the chunk in the flat batch
    length: int  # tokens in the chunk
    context_len: int  # tokens in cache after the chunk (prior context + chunk)
    block_ids: torch.Tensor | None  # blocks covering context_len; None: no prior context

    @property
    def prior_len(self) -> int:
        return self.context_len - self.length


@dataclass
class AttentionMetadata:
    """Everything the attention of one step needs, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    num_decode: int = 0  # rows [0, num_decode) are decode tokens
    decode_block_ids: torch.Tensor | None = None  # [S * max_blocks] flattened block tables
    decode_max_blocks: int = 0
    decode_mask: torch.Tensor | None = None  # [1, S, 1, max_blocks * block_size] valid keys
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V ([T, kvh, d]) at their slots, one indexed copy each."""
    kvh, nb, bs, d = k_cache.shape
    k_cache.view(kvh, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kvh, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Read the blocks of `num_seqs` block tables: [kvh, S, max_blocks * block_size, d]."""
    kvh, _, bs, d = cache.shape
    return cache.index_select(1, block_ids).view(kvh, num_seqs, -1, d)


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
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    s = meta.num_decode
    if s:
        # query heads of one kv head act as that head's "query length": [kvh, S, group, d]
        qd = q[:s].view(s, kvh, group, d).transpose(0, 1)
        kd = gather_kv(k_cache, meta.decode_block_ids, s)
        vd = gather_kv(v_cache, meta.decode_block_ids, s)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:s] = od.transpose(0, 1).reshape(s, h, d)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if chunk.block_ids is None:
            kc = k[rows].transpose(0, 1).unsqueeze(0)
            vc = v[rows].transpose(0, 1).unsqueeze(0)
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kc = gather_kv(k_cache, chunk.block_ids, 1)[:, :, : chunk.context_len].transpose(0, 1)
            vc = gather_kv(v_cache, chunk.block_ids, 1)[:, :, : chunk.context_len].transpose(0, 1)
            qpos = torch.arange(chunk.prior_len, chunk.context_len, device=q.device)
            kpos = torch.arange(chunk.context_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[rows] = oc[0].transpose(0, 1)
    return out.view(t, h * d)
