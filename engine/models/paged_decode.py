"""Decode attention that reads K/V in place through the block table: a Triton kernel for
CUDA and a pure-torch reference with the same signature.

    q             [S, H, D]                 one new token per request
    k_cache       [KVH, NUM_BLOCKS, BS, D]  v_cache alike (the layout of attention.py)
    block_tables  [S, MAX_BLOCKS] int32     columns past a request's context are not read
    context_lens  [S] int32                 keys per request, the new token included
    returns       [S, H, D]

The kernel runs one program per (request, kv head): it walks the request's keys a tile at
a time (a tile may span several blocks; each key's block is looked up in the table), keeps
a running softmax in float32 for the query heads that share the kv head, and writes their
outputs. Nothing is gathered into a padded copy, and the work per request follows its own
context length, so one captured CUDA graph serves any mix of lengths.

`kernel()` returns the Triton kernel where Triton and CUDA are present (or where
TRITON_INTERPRET=1 runs it on CPU tensors, as the tests do), else None.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from engine.models.attention import cache_dims, decode_attention, gather_index, gather_kv

PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
KEY_TILE = 32  # keys scored per loop iteration of a program


def reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The same attention in plain torch: gather every table into a padded copy, mask the
    keys past each context with -inf, two batched matmuls (the torch decode path's math)."""
    s, h, d = q.shape
    kvh, nb, bs, _ = cache_dims(k_cache)
    keys = block_tables.shape[1] * bs
    index = gather_index(block_tables.long().reshape(-1), kvh, nb)
    k = gather_kv(k_cache, index, s)  # [kvh, S, keys, d]
    v = gather_kv(v_cache, index, s, values=True)
    pad = torch.arange(keys, device=q.device)[None, :] >= context_lens.long()[:, None]
    bias = torch.zeros(pad.shape, dtype=q.dtype, device=q.device).masked_fill_(pad, float("-inf"))
    qd = q.view(s, kvh, h // kvh, d).transpose(0, 1)  # [kvh, S, group, d]
    out = decode_attention(qd, k, v, bias.view(1, s, 1, keys), scale)
    return out.transpose(0, 1).reshape(s, h, d)


@functools.cache
def kernel() -> PagedDecode | None:
    """The Triton kernel, or None where Triton (or a GPU, unless interpreting) is missing."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not (interpret or torch.cuda.is_available()):
        return None
    if importlib.util.find_spec("triton") is None:
        return None
    return _build_kernel()


tl: Any = None  # triton.language, bound by `_build_kernel` (Triton is imported only then)


def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, scale,
    stride_qs, stride_qh, stride_kh, stride_kb, stride_kt, stride_bs, stride_os, stride_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, TILE: tl.constexpr,
):
    """One program per (request, kv head); compiled by `triton.jit` in `_build_kernel`
    (a module-level function, so Triton finds `tl` among its globals)."""
    s = tl.program_id(0)
    kh = tl.program_id(1).to(tl.int64)  # kh x stride_kh can pass 2**31 in a large pool
    ctx = tl.load(lens_ptr + s)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, TILE)
    gd_mask = (g[:, None] < G) & (d[None, :] < D)
    heads = kh * G + g
    q = tl.load(q_ptr + s * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=gd_mask, other=0.0).to(tl.float32) * scale
    m = tl.full([G_PAD], -3.0e38, tl.float32)  # finite: no inf - inf on the first tile
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(0, ctx, TILE):
        pos = start + t
        valid = pos < ctx
        blk = tl.load(bt_ptr + s * stride_bs + pos // BS, mask=valid, other=0).to(tl.int64)
        off = kh * stride_kh + blk * stride_kb + (pos % BS) * stride_kt
        kv_mask = valid[:, None] & (d[None, :] < D)
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G, TILE]
        scores = tl.where(valid[None, :], scores, -3.0e38)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + s * stride_os + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gd_mask)


def _build_kernel() -> PagedDecode:
    """Compile-on-first-call wrapper around the Triton kernel (interpreted where
    TRITON_INTERPRET=1 is set when this runs)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    jitted = triton.jit(_paged_decode_kernel)

    def paged_decode(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        s, h, d = q.shape
        kvh, _, bs, _ = k_cache.shape
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
        assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
        group = h // kvh
        out = torch.empty_like(q)
        jitted[(s, kvh)](
            q, k_cache, v_cache, block_tables, context_lens, out, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
            G=group, G_PAD=triton.next_power_of_2(group), D=d,
            D_PAD=triton.next_power_of_2(d), BS=bs, TILE=KEY_TILE,
        )
        return out

    return paged_decode
