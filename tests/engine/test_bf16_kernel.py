"""csrc/bf16_gemm.cpp through engine.models.linear: the bfloat16 matmul kernel must give
F.linear's results at every row count (each tile size and remainder), with and without a
bias, on strided and 3-d inputs; a row's result must not depend on the rest of the batch;
and it must be taken exactly where `native.bf16_linear` says (CPU, bfloat16, the kernel
built: AMX, AVX512_BF16, or AVX2 and FMA).

The kernel tests need a CPU with AVX2 and FMA at least (every x86 CPU the project runs on);
elsewhere they skip, and `test_the_kernel_is_used_where_the_cpu_has_it` checks the fallback is chosen."""

import pytest
import torch
import torch.nn.functional as F

from engine.models import native
from engine.models.linear import Linear, kernel_fits, pack_for_kernel

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    not native.bf16_linear_built(), reason="this CPU or build has no bfloat16 matmul kernel")


def layer(n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return w, b


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the bfloat16 inputs, in float64."""
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 16, 17, 24, 25, 33, 64, 100, 515])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [200, 192])  # 192: AMX tiles where the CPU has them (32 K each)
def test_kernel_matches_the_exact_product_at_every_row_count(rows: int, bias: bool,
                                                             k: int) -> None:
    w, b = layer(96, k, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    lin = Linear(w, b, pack=True, kernel=True)
    assert lin.kernel and not lin.packed and lin.weight.shape == (3, k // 2, 32, 2)
    got = lin(x)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    want = reference(x, w, b)
    # float32 sums rounded once to bfloat16: within one bfloat16 step of the exact value
    err = (got.double() - want).abs() / want.abs().clamp_min(1.0)
    assert err.max().item() < 2 ** -7, err.max().item()
    # and as close to it as F.linear's own bfloat16 result is, give or take rounding
    theirs = (F.linear(x, w, b).double() - want).abs().mean().item()
    ours = (got.double() - want).abs().mean().item()
    assert ours <= theirs * 1.5 + 1e-3


@needs_kernel
@pytest.mark.parametrize("k", [130, 128])  # 128: AMX tiles where the CPU has them
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(k: int) -> None:
    w, b = layer(64, k, bias=True)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    lin = Linear(w, b, kernel=True)
    batch = lin(x)
    for i in (0, 11, 12, 36):
        assert torch.equal(lin(x[i:i + 1])[0], batch[i])
        assert torch.equal(lin(x[: i + 1])[i], batch[i])


@needs_kernel
def test_strided_and_3d_inputs() -> None:
    w, b = layer(64, 128, bias=False)
    wide = torch.randn(6, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    lin = Linear(w, b, kernel=True)
    x = wide[:, 64:192]  # rows 256 apart: read in place
    torch.testing.assert_close(lin(x), lin(x.contiguous()), rtol=0, atol=0)
    odd = torch.randn(4, 129, generator=torch.Generator().manual_seed(3)).bfloat16()[:, 1:]
    torch.testing.assert_close(lin(odd), lin(odd.contiguous()), rtol=0, atol=0)  # odd stride
    x3 = x.contiguous().view(2, 3, 128)
    assert torch.equal(lin(x3), lin(x.contiguous()).view(2, 3, 64))
    assert lin(torch.zeros(0, 128, dtype=torch.bfloat16)).shape == (0, 64)


@needs_kernel
def test_bad_shapes_are_named() -> None:
    w, _ = layer(64, 128, bias=False)
    packed = pack_for_kernel(w)
    op = torch.ops.batchlens.bf16_linear
    with pytest.raises(RuntimeError, match="x has K=64, w has K=128"):
        op(torch.zeros(2, 64, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.zeros(2, 128), packed, None)  # float32
    with pytest.raises(RuntimeError, match="w must be packed"):
        op(torch.zeros(2, 128, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(torch.zeros(2, 128, dtype=torch.bfloat16), packed, torch.zeros(3, dtype=torch.bfloat16))


def test_shapes_the_kernel_cannot_take_fall_back() -> None:
    w, b = layer(48, 128, bias=True)  # 48 outputs: not a multiple of 32
    assert not kernel_fits(w, b)
    lin = Linear(w, b, kernel=True)
    assert not lin.kernel
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    torch.testing.assert_close(lin(x).float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)
    assert not kernel_fits(torch.zeros(64, 127, dtype=torch.bfloat16), None)  # odd K
    assert not kernel_fits(torch.zeros(64, 128), None)  # float32


def test_the_kernel_is_used_where_the_cpu_has_it(monkeypatch) -> None:
    use = native.bf16_linear
    assert not use(CPU, torch.float32)
    assert not use(torch.device("cuda"), torch.bfloat16)
    amx_cpu = "amx_bf16" in native._cpu_flags()
    assert use(CPU, torch.bfloat16) is (native.bf16_linear_built()
                                        and (native.bf16_linear_amx() or not amx_cpu))
    assert ("matmuls: the bfloat16 kernel" in native.status(torch.bfloat16)) is use(
        CPU, torch.bfloat16)
    assert "matmuls" not in native.status(torch.float32)
    monkeypatch.setenv("BATCHLENS_BF16_KERNEL", "0")
    assert not use(CPU, torch.bfloat16)
    assert "matmuls: oneDNN" in native.status(torch.bfloat16)
    monkeypatch.delenv("BATCHLENS_BF16_KERNEL")
    assert ("(AMX tiles)" in native.status(torch.bfloat16)) is native.bf16_linear_amx()
    if native.bf16_linear_amx():  # built for this CPU: only where it has the tiles
        assert amx_cpu
    # a CPU with AMX whose tiles the kernel could not get keeps oneDNN's
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "amx_bf16"})
    monkeypatch.setattr(native, "bf16_linear_amx", lambda: False)
    assert not use(CPU, torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_bfloat16_model_runs_every_matmul_in_the_kernel(tiny_models, kind: str,
                                                          monkeypatch) -> None:
    """The tiny models (Qwen2 with q/k/v biases, a tied LM head): every linear layer in the
    kernel, so the runner pads no rows for oneDNN; logits close to oneDNN's."""
    from engine.models.llama import LlamaModel

    model = LlamaModel.from_folder(tiny_models[kind], CPU, torch.bfloat16)
    linears = [model.lm_head] + [lin for layer in model.layers
                                 for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(lin.kernel for lin in linears)
    assert not model.cpu_onednn_matmuls
    monkeypatch.setenv("BATCHLENS_BF16_KERNEL", "0")
    onednn = LlamaModel.from_folder(tiny_models[kind], CPU, torch.bfloat16)
    assert not any(lin.kernel for lin in [onednn.lm_head, onednn.layers[0].qkv])
    assert onednn.cpu_onednn_matmuls
    x = torch.randn(5, model.arch.hidden_size, generator=torch.Generator().manual_seed(5))
    x = x.bfloat16()
    for ours, theirs in ((model.layers[0].qkv, onednn.layers[0].qkv),
                         (model.lm_head, onednn.lm_head)):
        torch.testing.assert_close(ours(x).float(), theirs(x).float(), rtol=2e-2, atol=0.5)

