"""The fused layer ops (csrc/layer_ops.cpp) against the torch ops they replace, and the
bfloat16 forward with them against the forward without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import native
from engine.models.attention import cache_shapes, pack_caches, packed_caches


@pytest.fixture(autouse=True)
def built() -> None:
    """Built on first use (not while tests are collected); skipped where it cannot be."""
    ok, reason = native._build()
    if not ok:
        pytest.skip(f"the native kernels could not be built here: {reason}")

# float32: the same math, other rounding order; bfloat16: one rounding instead of torch's
# rounding after every op
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


def ops():
    return torch.ops.batchlens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows: split across threads
def test_add_rms_norm_adds_the_residual_in_place_then_normalises(dtype, rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    residual = x + delta  # torch's add, rounded to the dtype as the engine's add was
    want = F.rms_norm(residual.float(), (576,), w.float(), eps=1e-5)
    got = ops().add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, residual)  # the residual stream, updated in place
    assert got.dtype == dtype and got.shape == (rows, 576)
    assert (got.float() - want).abs().max().item() < TOL[dtype] * want.abs().max().item()
    alone = ops().add_rms_norm(x, None, w, 1e-5)  # no delta: the norm of x as it is
    torch.testing.assert_close(alone, got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_rotates_q_and_k_in_place_and_stores_k_v_at_their_slots(dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, rows = 9, 3, 64, 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angles = torch.randn(100, d // 2, generator=g)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    positions = torch.tensor([0, 3, 99, 50, 7])
    slots = torch.tensor([9, 0, 31, 12, 4])  # any order, any block
    k_cache = torch.zeros(kv_heads, 4, 8, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    before = qkv.clone()
    ops().rope_write_kv(qkv, cos, sin, positions, k_cache, v_cache, slots, heads, kv_heads)
    x = before[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d).float()
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    want = x * cos[positions].float()[:, None] + rotated * sin[positions].float()[:, None]
    got = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d).float()
    assert (got - want).abs().max().item() < TOL[dtype] * want.abs().max().item()
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], before[:, (heads + kv_heads) * d:])
    k_at = k_cache.view(kv_heads, 32, d)[:, slots].transpose(0, 1)
    v_at = v_cache.view(kv_heads, 32, d)[:, slots].transpose(0, 1)
    assert torch.equal(k_at, qkv[:, heads * d: (heads + kv_heads) * d].view(rows, kv_heads, d))
    assert torch.equal(v_at, before[:, (heads + kv_heads) * d:].view(rows, kv_heads, d))
    assert k_cache.view(kv_heads, 32, d)[:, 1].abs().sum() == 0  # no other slot written
    packed = [torch.zeros(shape, dtype=dtype) for shape in cache_shapes(kv_heads, 4, 8, d, True)]
    pool = packed_caches(torch.zeros(2 * k_cache.numel(), dtype=dtype), kv_heads, 4, 8, d)
    for caches in (packed, pool):  # apart, and as the engine holds them: views of one pool
        ops().rope_write_kv(before.clone(), cos, sin, positions, *caches, slots, heads, kv_heads)
        assert all(torch.equal(a, b) for a, b in zip(pack_caches(k_cache, v_cache), caches,
                                                     strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_the_gate_times_up(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(37, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops().silu_mul(gate_up)
    assert got.shape == (37, 1536) and got.dtype == dtype
    assert (got.float() - want).abs().max().item() < TOL[dtype] * want.abs().max().item()
    # exp over/underflow, in the 16-wide vector path and the scalar tail alike
    gate = torch.tensor([-200.0, 0.0, 200.0, -90.0, 90.0] * 4)[:17]
    extreme = torch.cat([gate, torch.ones(17)])[None].to(dtype)
    want = torch.where(gate > 0, gate, torch.zeros(17))[None]
    torch.testing.assert_close(ops().silu_mul(extreme).float(), want)


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    qkv = torch.zeros(2, 5 * 64, dtype=torch.bfloat16)
    table = torch.zeros(10, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 8 outside"):
        ops().rope_write_kv(qkv, table, table, torch.tensor([0, 1]), cache, cache.clone(),
                            torch.tensor([0, 8]), 3, 1)
    with pytest.raises(RuntimeError, match="position 10"):
        ops().rope_write_kv(qkv, table, table, torch.tensor([10, 1]), cache, cache.clone(),
                            torch.tensor([0, 1]), 3, 1)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops().add_rms_norm(torch.zeros(2, 8), None, torch.zeros(4), 1e-5)


def test_only_cpu_reduced_precision_takes_the_fused_ops():
    assert not native.layer_ops(torch.device("cpu"), torch.float32)  # transformers' exact ops
    assert not native.layer_ops(torch.device("cuda"), torch.bfloat16)
    assert native.layer_ops(torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 33, 1000, 49152])
def test_argmax_rows_is_torch_argmax(dtype, width):
    """Random rows, then ties (the first index wins), NaN (above everything, the first
    one), -inf everywhere, and rows of a wider tensor."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(70, width, generator=g).to(dtype)  # 70 rows: split across threads
    if width >= 17:
        x[1, [3, 16]] = 9.0  # ties inside and across 16-lane groups
        x[2, [width - 1, 5]] = 9.0
        x[3, width // 2] = float("nan")
        x[4, [width - 1, 2]] = float("nan")
        x[5] = float("-inf")
        x[6, :] = 0.0
    assert torch.equal(ops().argmax_rows(x), x.argmax(dim=-1))
    if width > 2:
        part = x[::3, 1:]  # rows with a stride, not the tensor's own
        assert torch.equal(ops().argmax_rows(part), part.argmax(dim=-1))


@pytest.mark.parametrize("width", [1, 31, 32, 33, 1000, 49152, 49157])
def test_bar_tokens_bars_exactly_the_clear_bits_of_the_listed_rows(width):
    """A structured output's mask: each listed row's tokens whose bit is clear become -inf
    (bit i of int32 word w: token 32w + i, the sign bit included), others and unlisted
    rows untouched; the same as xgrammar's own apply. Bad arguments are errors."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(width)
    x = torch.randn(70, width, generator=g)  # 70 rows: split across threads
    words = (width + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (70, words), generator=g, dtype=torch.int32)
    bitmask[2] = -1  # every token allowed
    bitmask[4] = 0  # none
    bitmask[6] = torch.tensor(-(2**31), dtype=torch.int32)  # only each word's bit 31
    rows = [0, 2, 4, 6, 9, 69]
    got = x.clone()
    ops().bar_tokens(got, bitmask, torch.tensor(rows))
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(70, -1)[:, :width].bool()
    want = x.clone()
    for r in rows:
        want[r] = x[r].masked_fill(~allowed[r], float("-inf"))
    assert torch.equal(got, want)
    assert torch.isinf(got[4]).all() and torch.equal(got[2], x[2])
    assert torch.equal(got[1], x[1])  # not listed
    if width >= 32:  # a vocabulary's width (xgrammar's apply differs on a 1-token one)
        theirs = x.clone()
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=width, indices=rows)
        assert torch.equal(got, theirs)
    with pytest.raises(RuntimeError, match="out of range"):
        ops().bar_tokens(x, bitmask, torch.tensor([70]))
    with pytest.raises(RuntimeError, match="float32"):
        ops().bar_tokens(x.bfloat16(), bitmask, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="bitmask must be"):
        ops().bar_tokens(x, bitmask[:, :1] if words > 1 else bitmask[:1], torch.tensor([0]))


def test_greedy_sampling_reads_bfloat16_logits_in_place():
    from engine.sampler import greedy

    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert greedy(logits) == logits.float().argmax(dim=-1).tolist()
    assert greedy(logits.float()) == logits.float().argmax(dim=-1).tolist()


@pytest.mark.model
def test_the_fused_bfloat16_forward_gives_the_unfused_logits(tiny_models):
    """A tiny random Llama, one prefill of two prompts: the same logits up to bfloat16
    rounding, with or without the fused ops."""
    from engine.models.attention import AttentionMetadata, PrefillChunk
    from engine.models.llama import LlamaModel

    model = LlamaModel.from_folder(tiny_models["llama"], torch.device("cpu"), torch.bfloat16)
    assert model.fused_ops
    arch = model.arch
    ids = torch.tensor([5, 9, 300, 17, 2, 44, 81, 7, 600, 3])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    meta = AttentionMetadata(slot_mapping=torch.arange(10),
                             prefills=[PrefillChunk(0, 6, 6, None), PrefillChunk(6, 4, 4, None)])
    logits = []
    for fused in (True, False):
        model.fused_ops = fused
        caches = [(torch.zeros(arch.num_kv_heads, 4, 8, arch.head_dim, dtype=torch.bfloat16),
                   torch.zeros(arch.num_kv_heads, 4, 8, arch.head_dim, dtype=torch.bfloat16))
                  for _ in range(arch.num_layers)]
        logits.append(model.forward(ids, positions, meta, caches, torch.tensor([5, 9])))
    fused, plain = logits
    assert fused.dtype == torch.bfloat16 and fused.shape == (2, arch.vocab_size)
    fused, plain = fused.float(), plain.float()
    assert (fused - plain).abs().max().item() < 0.05 * plain.abs().max().item()
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.model
@pytest.mark.skipif(not native.bf16_linear(torch.device("cpu"), torch.bfloat16),
                    reason="the layer stack runs where every matmul is the bfloat16 kernel")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_the_layer_stack_in_one_call_gives_the_per_layer_logits_bit_for_bit(tiny_models, kind):
    """csrc/decoder.cpp runs every layer in one call: the same ops on the same tensors as
    the per-layer loop, so the same bits, on a step whose rows (two prompts, each row a
    query over its own prefix) all go to the attention kernel; the K/V it writes too."""
    from engine.models.attention import AttentionMetadata, KernelDecode
    from engine.models.llama import LlamaModel

    model = LlamaModel.from_folder(tiny_models[kind], torch.device("cpu"), torch.bfloat16)
    stack = model.layer_stack
    assert stack is not None and len(stack) == 7 * model.arch.num_layers
    arch = model.arch
    ids = torch.tensor([5, 9, 300, 17, 2, 44, 81, 7, 600, 3])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    tables = torch.tensor([[0]] * 6 + [[1]] * 4, dtype=torch.int32)
    lens = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2, 3, 4], dtype=torch.int32)
    runs = []
    head = model.stack_head
    assert head.numel() > 0  # the LM head is the kernel: the one call runs it too
    ops().forward_times(True)  # the one call timed (scripts/step_anatomy.py): the same bits
    # the call with the head, then without (it returns the normed rows), then per layer
    for layers, model.stack_head in ((stack, head), (stack, head[:0]), (None, head)):
        model.layer_stack = layers
        meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 8, 9, 10, 11]),
                                 kernel_decode=KernelDecode(model.attention_kernel, tables, lens))
        caches = [(torch.zeros(arch.num_kv_heads, 2, 8, arch.head_dim, dtype=torch.bfloat16),
                   torch.zeros(arch.num_kv_heads, 2, 8, arch.head_dim, dtype=torch.bfloat16))
                  for _ in range(arch.num_layers)]
        runs.append((model.forward(ids, positions, meta, caches, torch.tensor([5, 9])), caches))
        if layers is stack and model.stack_head is head:
            times = ops().forward_times(False)
    # microseconds of matmuls, attention, norms, RoPE + K/V writes, SiLU x up, the final
    # norm and LM head; whole calls
    assert len(times) == 7 and all(t > 0 for t in times)
    assert times[6] >= sum(times[:6])
    assert ops().forward_times(False) == [0.0] * 7  # timing off: the later runs add none
    (one_call, kv_one), (head_apart, _), (per_layer, kv_per) = runs
    assert one_call.shape == (2, arch.vocab_size)
    assert torch.equal(one_call, per_layer)
    assert torch.equal(head_apart, per_layer)
    assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv_one, kv_per, strict=True)
               for a, b in ((ka, kb), (va, vb)))
    assert kv_one[0][0].abs().sum() > 0  # the K/V were written


@pytest.mark.model
@pytest.mark.skipif(not native.packed_kv(torch.device("cpu"), torch.bfloat16, 16, 64, 2),
                    reason="the attention kernel stores K/V itself on its packed path only "
                           "(AMX or AVX512_BF16)")
@pytest.mark.parametrize("lens", [[300], [1, 16, 17, 32, 33, 64, 40]])
def test_a_decode_steps_kv_stored_by_the_attention_kernel_gives_the_same_bits(tiny_llama_d64,
                                                                                lens):
    """In a step whose rows are each alone (decode rows), the layer stack leaves the K/V
    stores to the attention kernel, in the step of its walk that reads their block: the
    same logits and caches, bit for bit, as the per-layer loop storing them first. [300]:
    one request, its keys cut into pieces over the threads; the others: newest keys at
    either edge of a block."""
    from engine.models.attention import AttentionMetadata, KernelDecode
    from engine.models.llama import LlamaModel

    model = LlamaModel.from_folder(tiny_llama_d64, torch.device("cpu"), torch.bfloat16)
    stack, arch = model.layer_stack, model.arch
    assert stack is not None and arch.head_dim == 64
    bs, g = 16, torch.Generator().manual_seed(3)
    blocks = [-(-n // bs) for n in lens]
    order = torch.randperm(sum(blocks), generator=g).tolist()  # tables shuffled over the pool
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(order[taken: taken + n])
        taken += n
    context = torch.tensor(lens, dtype=torch.int32)
    positions = context.long() - 1
    slots = torch.stack([tables[i, p // bs].long() * bs + p % bs
                         for i, p in enumerate(positions.tolist())])
    ids = torch.randint(0, arch.vocab_size, (len(lens),), generator=g)
    shape = (arch.num_kv_heads, sum(blocks), bs, arch.head_dim)
    rows = [(torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
            for _ in range(arch.num_layers)]
    assert ops().attention_stores_kv(pack_caches(*rows[0])[0], arch.num_heads, tables, context,
                                     slots)
    runs = []
    for layers in (stack, None):
        model.layer_stack = layers
        caches = [pack_caches(k, v) for k, v in rows]
        meta = AttentionMetadata(slot_mapping=slots,
                                 kernel_decode=KernelDecode(model.attention_kernel, tables,
                                                            context))
        runs.append((model.forward(ids, positions, meta, caches, torch.arange(len(lens))),
                     caches))
    (one_call, kv_one), (per_layer, kv_per) = runs
    assert torch.equal(one_call, per_layer)
    assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv_one, kv_per, strict=True)
               for a, b in ((ka, kb), (va, vb)))
    fresh = [pack_caches(k, v) for k, v in rows]
    assert not all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv_one, fresh, strict=True)
                   for a, b in ((ka, kb), (va, vb)))  # the step's keys were stored


@pytest.mark.skipif(not native.packed_kv(torch.device("cpu"), torch.bfloat16, 16, 64, 2),
                    reason="the attention kernel stores K/V itself on its packed path only "
                           "(AMX or AVX512_BF16)")
def test_the_attention_kernel_stores_kv_only_where_every_row_is_alone_at_its_slot():
    k = torch.zeros(cache_shapes(2, 8, 16, 64, True)[0], dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1], [2, 3], [2, 3]], dtype=torch.int32)
    decode = torch.tensor([20, 5, 9], dtype=torch.int32)  # rows alone, two sharing a table
    slots = torch.tensor([16 + 3, 2 * 16 + 4, 2 * 16 + 8])
    assert ops().attention_stores_kv(k, 4, tables, decode, slots)
    assert not ops().attention_stores_kv(k, 4, tables, decode, slots + 1)  # another slot
    prompt = torch.tensor([20, 5, 6], dtype=torch.int32)  # rows 2 and 3: a run of one prompt
    assert not ops().attention_stores_kv(k, 4, tables, prompt, torch.tensor([19, 36, 37]))
    assert not ops().attention_stores_kv(k.float(), 4, tables, decode, slots)
