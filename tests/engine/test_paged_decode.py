"""engine.models.paged_decode: the torch reference against float64 softmax attention, and
the Triton kernel against the reference.

The kernel test runs on CUDA where a GPU exists (scripts/gpu_run.sh), else in Triton's
interpreter on CPU tensors. Triton is in the test extras, so these tests run on every CPU
run; where it is missing they fail and say how to install it (a skip would hide that the
GPU path went untested).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.models import paged_decode
from engine.models.attention import cache_shapes, gather_index, gather_kv, pack_caches, write_kv

HAS_TRITON = importlib.util.find_spec("triton") is not None


def inputs(dtype: torch.dtype, device: str, block_size: int = 16, d: int = 64,
           kvh: int = 3, group: int = 3):
    """Shuffled blocks (the kernel must follow the table), lengths across block edges."""
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([1, 2, 15, 16, 17, 33, 100, 250], dtype=torch.int32)
    width = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g)
    v_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width]
    tables = tables.view(len(lens), width).to(torch.int32)
    q = torch.randn(len(lens), kvh * group, d, generator=g) * 2
    return [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            for t in (q, k_cache, v_cache, tables, lens)]


def float64_attention(q, k_cache, v_cache, tables, lens, scale):
    """Per request: its blocks in table order, cut to its length, softmax(q k^T) v."""
    kvh, _, bs, d = k_cache.shape
    s, h, _ = q.shape
    out = torch.empty(s, h, d, dtype=torch.float64)
    for i in range(s):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)].long().cpu()
        k = k_cache.cpu()[:, blocks].reshape(kvh, -1, d)[:, :n].double()
        v = v_cache.cpu()[:, blocks].reshape(kvh, -1, d)[:, :n].double()
        qi = q[i].cpu().double().view(kvh, h // kvh, d)
        probs = torch.softmax(qi @ k.transpose(-1, -2) * scale, dim=-1)
        out[i] = (probs @ v).reshape(h, d)
    return out


@pytest.mark.parametrize("block_size,d,kvh,group", [(16, 64, 3, 3), (5, 48, 2, 4), (1, 8, 1, 1)])
def test_reference_matches_float64_attention(block_size, d, kvh, group):
    q, kc, vc, tables, lens = inputs(torch.float32, "cpu", block_size, d, kvh, group)
    got = paged_decode.reference(q, kc, vc, tables, lens, 0.125)
    want = float64_attention(q, kc, vc, tables, lens, 0.125)
    assert got.shape == q.shape and (got.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("block_size,d,kvh", [(16, 64, 3), (4, 48, 2), (2, 8, 1)])
def test_packed_caches_hold_what_caches_in_rows_hold(block_size, d, kvh):
    """write_kv into either layout, then gather_kv and the reference read the same K/V."""
    g = torch.Generator().manual_seed(4)
    num_blocks, tokens = 6, 11
    rows = [torch.zeros(cache_shapes(kvh, num_blocks, block_size, d, False)[0])
            for _ in range(2)]
    packed = [torch.zeros(shape) for shape in cache_shapes(kvh, num_blocks, block_size, d, True)]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    k, v = torch.randn(2, tokens, kvh, d, generator=g)
    write_kv(*rows, k, v, slots)
    write_kv(*packed, k, v, slots)
    assert all(torch.equal(a, b) for a, b in zip(pack_caches(*rows), packed, strict=True))
    index = gather_index(torch.tensor([3, 0, 5]), kvh, num_blocks)
    assert torch.equal(gather_kv(packed[0], index, 1), gather_kv(rows[0], index, 1))
    assert torch.equal(gather_kv(packed[1], index, 1, values=True), gather_kv(rows[1], index, 1))
    q = torch.randn(2, kvh * 2, d, generator=g)
    tables = torch.tensor([[3, 0, 5], [1, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([2 * block_size + 1, 3 * block_size], dtype=torch.int32)
    assert torch.equal(paged_decode.reference(q, *packed, tables, lens, 0.125),
                       paged_decode.reference(q, *rows, tables, lens, 0.125))


def _triton_kernel(monkeypatch) -> tuple[paged_decode.PagedDecode, str]:
    assert HAS_TRITON, "triton is missing: pip install -e '.[test]' (it is in the test extras)"
    if torch.cuda.is_available():
        kernel = paged_decode.kernel()
        assert kernel is not None
        return kernel, "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernel is defined
    return paged_decode._build_kernel(), "cpu"


@pytest.mark.parametrize("dtype,block_size,d,kvh,group,tol", [
    (torch.float32, 16, 64, 3, 3, 1e-5),   # SmolLM2's heads: 9 query heads on 3 kv heads
    (torch.float32, 5, 48, 2, 4, 1e-5),    # a key tile spans blocks; head_dim not a power of 2
    (torch.bfloat16, 16, 64, 3, 3, 2e-2),  # what the GPU serves in
])
def test_triton_kernel_matches_the_reference(monkeypatch, dtype, block_size, d, kvh, group,
                                             tol):
    kernel, device = _triton_kernel(monkeypatch)
    q, kc, vc, tables, lens = inputs(dtype, device, block_size, d, kvh, group)
    got = kernel(q, kc, vc, tables, lens, 0.125)
    want = float64_attention(q, kc, vc, tables, lens, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.cpu().double() - want).abs().max().item() < tol


def test_triton_kernel_reads_no_column_past_a_context(monkeypatch):
    """A padded row (context 1, table [dummy, garbage...]) reads only its first slot: what
    the padded decode path relies on when a graph replays with stale table columns."""
    kernel, device = _triton_kernel(monkeypatch)
    q, kc, vc, tables, lens = inputs(torch.float32, device)
    tables[:, 1:] = 10**6  # out of range: reading one would fault (or fail in the interpreter)
    lens.fill_(1)
    got = kernel(q, kc, vc, tables, lens, 0.125)
    want = float64_attention(q, kc, vc, tables[:, :1], lens, 0.125)
    assert (got.cpu().double() - want).abs().max().item() < 1e-5
