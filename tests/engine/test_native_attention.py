"""The native CPU decode-attention kernel against softmax attention computed in float64,
and the engine's bfloat16 steps with the kernel against the torch path."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.models import native
from engine.models.attention import pack_caches, packed_caches, pool_caches


def kernel():
    built, reason = native._build()
    if not built:
        pytest.skip(f"the kernels could not be built here: {reason}")
    return torch.ops.batchlens.paged_decode_attention


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


@pytest.mark.parametrize("dtype,block_size,d,group,tol", [
    (torch.bfloat16, 16, 64, 3, 2e-2),  # q·k and p·v by bfloat16 dot products (AVX512_BF16),
                                        # else float32 FMAs; one block per 16 keys
    (torch.bfloat16, 4, 64, 3, 2e-2),   # 16 keys span four blocks
    (torch.bfloat16, 48, 64, 3, 2e-2),  # a block holds three chunks of 16 keys
    (torch.bfloat16, 16, 128, 4, 2e-2),  # head_dim 128 (Llama, Mistral), 4 heads per kv head
    (torch.bfloat16, 16, 64, 1, 2e-2),  # one query head per kv head (no GQA)
    (torch.bfloat16, 16, 48, 3, 2e-2),  # no compiled instance for head_dim 48: portable path
    (torch.float32, 16, 64, 3, 1e-5),   # float32 by FMAs
    (torch.float32, 16, 128, 7, 1e-5),  # Qwen2's 7 heads per kv head
])
@pytest.mark.parametrize("strided", [False, True])  # q as rows of a wider QKV output
@pytest.mark.parametrize("path", ["", "avx2", "portable"])  # "": the fastest this CPU has
@pytest.mark.parametrize("packed", [False, True, "pool"])  # packed: the packed path (AMX or
                                                           # AVX512_BF16) where it serves,
                                                           # else the portable one;
                                                           # "pool": as views of one pool
def test_kernel_matches_float64_softmax_attention(dtype, block_size, d, group, tol, strided,
                                                  path, packed, monkeypatch):
    if path:
        monkeypatch.setenv("BATCHLENS_KERNEL_PATH", path)
    g = torch.Generator().manual_seed(0)
    kvh, num_blocks = 3, 1200
    lens = torch.tensor([1, 2, 7, 8, 9, 15, 16, 17, 33, 100, 250], dtype=torch.int32)
    width = -(-int(lens.max()) // block_size)
    k_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g).to(dtype)
    v_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g).to(dtype)
    # every request gets distinct, shuffled blocks: the kernel must follow the table
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width]
    tables = tables.view(len(lens), width).to(torch.int32)
    q = (torch.randn(len(lens), kvh * group, d, generator=g) * 2).to(dtype)
    if strided:
        wide = torch.zeros(len(lens), (kvh * group + 2 * kvh) * d, dtype=dtype)
        wide[:, : kvh * group * d] = q.view(len(lens), -1)
        q = wide[:, : kvh * group * d].view(len(lens), kvh * group, d)
        assert not q.is_contiguous()
    caches = (pool_caches if packed == "pool" else pack_caches)(k_cache, v_cache) if packed \
        else (k_cache, v_cache)
    got = kernel()(q, *caches, tables, lens, 0.125)
    want = reference(q, k_cache, v_cache, tables, lens, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - want).abs().max().item() < tol


@pytest.fixture
def two_threads():
    """Two threads for the kernel, whatever this machine has: few (request, kv head) pairs
    on more than one thread are cut into pieces of keys, merged after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,d,group,tol", [(torch.bfloat16, 64, 3, 2e-2),
                                               (torch.bfloat16, 128, 4, 2e-2),
                                               (torch.float32, 64, 3, 1e-5)])
@pytest.mark.parametrize("lens", [[1000], [700, 3], [256, 257], [1]])
@pytest.mark.parametrize("path", ["", "avx2"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_small_batch_cut_into_pieces_of_keys_matches_float64(dtype, d, group, tol, lens, path,
                                                               packed, two_threads, monkeypatch):
    if path:
        monkeypatch.setenv("BATCHLENS_KERNEL_PATH", path)
    g = torch.Generator().manual_seed(1)
    kvh, bs = 3, 16
    lens_t = torch.tensor(lens, dtype=torch.int32)
    width = -(-max(lens) // bs)
    num_blocks = len(lens) * width + 5
    k_cache = torch.randn(kvh, num_blocks, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(kvh, num_blocks, bs, d, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width]
    tables = tables.view(len(lens), width).to(torch.int32)
    # scores spread wide, so each piece's running max differs and the merge must rescale
    q = (torch.randn(len(lens), kvh * group, d, generator=g) * 4).to(dtype)
    caches = pack_caches(k_cache, v_cache) if packed else (k_cache, v_cache)
    got = kernel()(q, *caches, tables, lens_t, 0.125)
    want = reference(q, k_cache, v_cache, tables, lens_t, 0.125)
    assert (got.double() - want).abs().max().item() < tol
    torch.set_num_threads(1)  # one thread: no pieces, the same attention
    whole = kernel()(q, *caches, tables, lens_t, 0.125)
    assert (got.double() - whole.double()).abs().max().item() < tol


@pytest.mark.parametrize("d,kvh,group,block_size", [(64, 3, 3, 16), (128, 2, 4, 32),
                                                    (64, 1, 1, 16), (64, 2, 8, 16)])
@pytest.mark.parametrize("packed", [False, True])
def test_prompt_rows_each_over_its_own_prefix_match_float64(d, kvh, group, block_size, packed,
                                                            two_threads):
    """A mixed step's rows: a decode row, a prompt's 23 rows from position 0, another's 40
    after 37 cached tokens, a decode row. Rows of one prompt share a table and their lengths
    are one apart (the tile path takes them 16 query rows at a time, each with its own end)."""
    g = torch.Generator().manual_seed(5)
    num_blocks = 40
    k_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g).bfloat16()
    v_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g).bfloat16()
    width = -(-100 // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: 3 * width].to(torch.int32).view(3, width)
    rows = [(tables[0], 50)] + [(tables[1], i + 1) for i in range(23)]
    rows += [(tables[2], 37 + i + 1) for i in range(40)] + [(tables[0], 90)]
    table = torch.stack([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    for t, longest in zip(tables, (90, 23, 77), strict=True):  # no slot past them is read
        for cache in (k_cache, v_cache):
            blocks = cache[:, t.long()]  # a copy: filled, then put back
            blocks.view(kvh, -1, d)[:, longest:] = float("nan")
            cache[:, t.long()] = blocks
    assert k_cache.isnan().any() and v_cache.isnan().any()
    q = (torch.randn(len(rows), kvh * group, d, generator=g) * 2).bfloat16()
    caches = pack_caches(k_cache, v_cache) if packed else (k_cache, v_cache)
    got = kernel()(q, *caches, table, lens, 0.125)
    assert not got.isnan().any()
    want = reference(q, k_cache.nan_to_num(), v_cache.nan_to_num(), table, lens, 0.125)
    assert (got.double() - want).abs().max().item() < 2e-2
    # the same rows one at a time (a step of one row: a row alone, no run)
    for i in (0, 1, 5, 23, 24, 63, 64):
        alone = kernel()(q[i: i + 1], *caches, table[i: i + 1], lens[i: i + 1], 0.125)
        assert (alone.double() - want[i]).abs().max().item() < 2e-2


@pytest.mark.parametrize("packed", [False, True])
def test_slots_past_a_context_are_never_read(packed):
    """NaN in every slot past each request's length (a block's unwritten tail, which may
    hold anything): the output is that of the keys in context alone."""
    g = torch.Generator().manual_seed(3)
    kvh, bs, d, group = 3, 16, 64, 3
    lens = torch.tensor([1, 5, 16, 17, 40], dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    k_cache = torch.randn(kvh, len(lens) * width, bs, d, generator=g).bfloat16()
    v_cache = torch.randn(kvh, len(lens) * width, bs, d, generator=g).bfloat16()
    tables = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    for i, n in enumerate(lens.tolist()):
        k_cache.view(kvh, len(lens), width * bs, d)[:, i, n:] = float("nan")
        v_cache.view(kvh, len(lens), width * bs, d)[:, i, n:] = float("nan")
    q = torch.randn(len(lens), kvh * group, d, generator=g).bfloat16()
    caches = pack_caches(k_cache, v_cache) if packed else (k_cache, v_cache)
    got = kernel()(q, *caches, tables, lens, 0.125)
    assert not got.isnan().any()
    want = reference(q, k_cache.nan_to_num(), v_cache.nan_to_num(), tables, lens, 0.125)
    assert (got.double() - want).abs().max().item() < 2e-2


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
    k_packed, v_packed = pack_caches(cache, cache)
    with pytest.raises(RuntimeError, match="packed caches"):  # K and V swapped
        kernel()(q, v_packed, k_packed, table, lens, 0.125)
    torn = k_packed.transpose(3, 2).contiguous().transpose(3, 2)  # a block's rows apart
    with pytest.raises(RuntimeError, match="k_cache: a packed cache's blocks must each be"):
        kernel()(q, torn, v_packed, table, lens, 0.125)


def test_packed_views_of_one_pool_put_each_block_s_k_beside_its_v():
    pool = torch.zeros(4 * 3 * 2 * 16 * 64, dtype=torch.bfloat16)
    k, v = packed_caches(pool, 3, 4, 16, 64)
    assert k.shape == (3, 4, 32, 16, 2) and v.shape == (3, 4, 8, 64, 2)
    for h, b in ((0, 0), (2, 1), (1, 3)):  # K then V of (head, block), one run of 4 KiB
        k_at, v_at = k[h, b].data_ptr(), v[h, b].data_ptr()
        assert v_at - k_at == 16 * 64 * 2
        assert k_at - pool.data_ptr() == ((b * 3 + h) * 2) * 16 * 64 * 2
    k[2, 3].fill_(1)
    v[2, 3].fill_(2)
    assert pool[-2 * 1024:].tolist() == [1.0] * 1024 + [2.0] * 1024
    with pytest.raises(ValueError, match="pool must be 4 x 3 x 2 x 16 x 64"):
        packed_caches(pool[:-1], 3, 4, 16, 64)


def test_cpu_bfloat16_and_float32_use_the_kernel_where_it_is_built():
    assert native.paged_decode(torch.device("cuda"), torch.bfloat16) is None
    assert native.paged_decode(torch.device("cpu"), torch.float16) is None
    expected = native._build()[0]
    for dtype in (torch.bfloat16, torch.float32):
        assert (native.paged_decode(torch.device("cpu"), dtype) is not None) == expected
    assert native.status().startswith("native kernels: ")
    assert native.status(torch.float32).endswith(
        "decode attention: the kernel" if native._build()[0] else ")")


def test_bfloat16_caches_are_packed_where_the_tile_kernel_reads_them(monkeypatch):
    cpu = torch.device("cpu")
    tiles = native._build()[0] and torch.ops.batchlens.paged_packed_supported(64, 3, 16)
    assert native.packed_kv(cpu, torch.bfloat16, 16, 64, 3) == tiles
    assert native.packed_kv(cpu, torch.bfloat16, 32, 128, 4) == tiles
    assert not native.packed_kv(cpu, torch.float32, 16, 64, 3)
    assert not native.packed_kv(cpu, torch.bfloat16, 8, 64, 3)  # a block under 16 keys
    assert not native.packed_kv(cpu, torch.bfloat16, 16, 48, 3)  # no instance for head_dim 48
    assert not native.packed_kv(torch.device("cuda"), torch.bfloat16, 16, 64, 3)
    monkeypatch.setenv("BATCHLENS_KV_PACKED", "0")
    assert not native.packed_kv(cpu, torch.bfloat16, 16, 64, 3)


@pytest.mark.model
def test_engine_decode_logits_match_the_torch_path():
    """Same prompts, same schedule: the first decode step's logits agree either way."""
    kernel()  # skips where the kernels cannot be built
    prompts = ["The capital of France is", "Write a haiku about rain.",
               "1, 2, 3, 4,", "Explain paged attention in one sentence."]
    firsts = []
    for use_kernel in (True, False):
        with Engine(EngineConfig(device="cpu", dtype="bfloat16", max_num_seqs=8)) as eng:
            runner = eng.runner
            assert (runner.decode_kernel is not None) is True
            arch = runner.model.arch
            packed = native.packed_kv(runner.model.device, runner.model.dtype,
                                      runner.block_size, arch.head_dim,
                                      arch.num_heads // arch.num_kv_heads)
            k0, v0 = runner.kv_caches[0]
            assert k0.dim() == (5 if packed else 4)
            if packed:  # views of one pool per layer, a block's K beside its V
                assert v0.data_ptr() - k0.data_ptr() == k0[0, 0].numel() * 2
            # prompts by SDPA either way, so both runs decode the same first tokens (the
            # kernel's own prefill rows: test_prefill_rows_by_the_kernel_match_the_sdpa_path)
            runner.paged_prefill = False
            if not use_kernel:
                runner.decode_kernel = None
            seen = []
            forward = runner.model.forward

            def record(ids, pos, meta, caches, rows, _fwd=forward, _seen=seen):
                logits = _fwd(ids, pos, meta, caches, rows)
                if ids.shape == rows.shape:  # a decode-only step (every row sampled); rows
                    # ordered by position, then token (the torch path sorts them by context
                    # length, the kernel path does not)
                    order = (pos[rows] * 1_000_000 + ids[rows]).argsort()
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


@pytest.mark.model
def test_prefill_rows_by_the_kernel_match_the_sdpa_path():
    """One step of two decode rows, a fresh prompt and a second chunk over cached context:
    the kernel attending every row (each prefill row over its own prefix) gives the logits
    the SDPA path gives, and nothing is left for SDPA."""
    kernel()  # skips where the kernels cannot be built
    from engine.metrics import RequestMetrics
    from engine.models.loaded import LoadedModel
    from engine.runner import ModelRunner
    from engine.sequence import Sequence

    loaded = LoadedModel.load(None, device="cpu", dtype="bfloat16")
    runner = ModelRunner(loaded.model, num_blocks=64, block_size=8)
    assert runner.paged_prefill
    texts = ["The capital of France is", "Once upon a time, in a land far away, there lived",
             "Write a haiku about rain falling on a quiet city at night.",
             "A computer runs a program by fetching instructions from memory, decoding "
             "them and executing them one after another."]
    seqs, tables, start = [], {}, 0
    for k, text in enumerate(texts):
        ids = loaded.encode(text)
        seq = Sequence(f"r{k}", ids, SamplingParams(max_tokens=4, ignore_eos=True),
                       RequestMetrics(0.0))
        tables[seq.request_id] = list(range(start, start + -(-len(ids) // 8) + 1))
        start += len(tables[seq.request_id])
        seqs.append(seq)
    decode, fresh, chunked = seqs[:2], seqs[2], seqs[3]
    cached = 9  # the long prompt's first chunk (a block and one token), computed first
    runner.execute([(s, s.num_tokens - 1) for s in decode] + [(chunked, cached)], tables, {})
    for s in decode:
        s.num_computed_tokens = s.num_tokens - 1
    chunked.num_computed_tokens = cached
    entries = [(s, 1) for s in decode] + [(fresh, fresh.num_tokens),
                                          (chunked, chunked.num_tokens - cached)]
    logits = {}
    for paged in (True, False):
        runner.paged_prefill = paged
        ids, pos, meta, rows, sampled = runner.prepare(entries, tables)
        assert (not meta.prefills) is paged
        out = loaded.model.forward(ids, pos, meta, runner.kv_caches, rows)[: len(sampled)]
        logits[paged] = out.softmax(-1)
    assert logits[True].shape == (4, loaded.model.arch.vocab_size)
    assert (0.5 * (logits[True] - logits[False]).abs().sum(-1)).max().item() < 0.1
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))
