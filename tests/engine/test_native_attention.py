"""The native CPU decode-attention kernel against softmax attention computed in float64,
and the engine's bfloat16 steps with the kernel against the torch path."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.models import native

HAS_AVX512 = "avx512" in torch.backends.cpu.get_cpu_capability().lower()


def kernel():
    op, reason = native._build()
    assert op is not None, reason
    return op


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Per request: gather its blocks, cut to its length, softmax(q k^T) v in float64."""
    kvh, _, bs, d = k_cache.shape
    s, h, _ = q.shape
    out = torch.empty(s, h, d, dtype=torch.float64)
    for i in range(s):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)].long()
        k = k_cache[:, blocks].reshape(kvh, -1, d)[:, :n].double()
        v = v_cache[:, blocks].reshape(kvh, -1, d)[:, :n].double()
        qi = q[i].double().view(kvh, h // kvh, d)
        probs = torch.softmax(qi @ k.transpose(-1, -2) * scale, dim=-1)
        out[i] = (probs @ v).reshape(h, d)
    return out


@pytest.mark.skipif(not HAS_AVX512, reason="the kernel is built for AVX-512 CPUs only")
@pytest.mark.parametrize("dtype,block_size,d,tol", [
    (torch.bfloat16, 16, 64, 2e-2),  # the AVX-512 path (q·k by bfloat16 dot products where
                                     # the CPU has them), one block per 16 keys
    (torch.bfloat16, 4, 64, 2e-2),   # 16 keys span four blocks
    (torch.bfloat16, 48, 64, 2e-2),  # a block holds three chunks of 16 keys
    (torch.bfloat16, 16, 48, 2e-2),  # head_dim not a multiple of 32: q·k by float32 FMAs
    (torch.float32, 16, 64, 1e-5),   # the generic path
])
def test_kernel_matches_float64_softmax_attention(dtype, block_size, d, tol):
    g = torch.Generator().manual_seed(0)
    kvh, group, num_blocks = 3, 3, 600
    lens = torch.tensor([1, 2, 15, 16, 17, 33, 100, 250], dtype=torch.int32)
    width = -(-int(lens.max()) // block_size)
    k_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g).to(dtype)
    v_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g).to(dtype)
    # every request gets distinct, shuffled blocks: the kernel must follow the table
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width]
    tables = tables.view(len(lens), width).to(torch.int32)
    q = (torch.randn(len(lens), kvh * group, d, generator=g) * 2).to(dtype)
    got = kernel()(q, k_cache, v_cache, tables, lens, 0.125)
    want = reference(q, k_cache, v_cache, tables, lens, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - want).abs().max().item() < tol


@pytest.mark.skipif(not HAS_AVX512, reason="the kernel is built for AVX-512 CPUs only")
def test_kernel_rejects_mismatched_inputs():
    q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 4, 16, 64, dtype=torch.bfloat16)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        kernel()(q, cache, cache, torch.zeros(2, 1, dtype=torch.long), lens, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel()(q.float(), cache, cache, torch.zeros(2, 1, dtype=torch.int32), lens, 0.125)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="context_lens"):  # 17 keys in one 16-slot block
        kernel()(q, cache, cache, table, torch.tensor([3, 17], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="block_tables"):  # block 4 of a 4-block cache
        kernel()(q, cache, cache, table + 4, lens, 0.125)


def test_only_cpu_bfloat16_uses_the_kernel():
    assert native.paged_decode(torch.device("cpu"), torch.float32) is None
    assert native.paged_decode(torch.device("cuda"), torch.bfloat16) is None
    expected = native._build()[0] is not None
    assert (native.paged_decode(torch.device("cpu"), torch.bfloat16) is not None) == expected
    assert native.status().startswith("decode attention: ")


@pytest.mark.model
@pytest.mark.skipif(not HAS_AVX512, reason="the kernel is built for AVX-512 CPUs only")
def test_engine_decode_logits_match_the_torch_path():
    """Same prompts, same schedule: the first decode step's logits agree either way."""
    prompts = ["The capital of France is", "Write a haiku about rain.",
               "1, 2, 3, 4,", "Explain paged attention in one sentence."]
    firsts = []
    for use_kernel in (True, False):
        with Engine(EngineConfig(device="cpu", dtype="bfloat16", max_num_seqs=8)) as eng:
            runner = eng.runner
            assert (runner.decode_kernel is not None) is True
            if not use_kernel:
                runner.decode_kernel = None
            seen = []
            forward = runner.model.forward

            def record(ids, pos, meta, caches, rows, _fwd=forward, _seen=seen):
                logits = _fwd(ids, pos, meta, caches, rows)
                if not meta.prefills:  # a decode-only step; rows ordered by position (the
                    # torch path sorts them by context length, the kernel path does not)
                    order = pos[rows].argsort()
                    _seen.append((meta.kernel_decode is not None, logits[order].clone()))
                return logits

            runner.model.forward = record
            try:
                eng.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
            finally:
                runner.model.forward = forward
            firsts.append(seen[0])
    (k_used, k_logits), (t_used, t_logits) = firsts
    assert k_used and not t_used
    k_p, t_p = k_logits.softmax(-1), t_logits.softmax(-1)
    # total variation distance per row: bfloat16 rounding moves little probability mass
    assert (0.5 * (k_p - t_p).abs().sum(-1)).max().item() < 0.1
    assert (k_p.argmax(-1) == t_p.argmax(-1)).sum().item() >= 3
