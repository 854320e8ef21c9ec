"""engine.models.linear: the oneDNN-packed path must give F.linear's results."""

import torch
import torch.nn.functional as F

from engine.models.linear import Linear, should_pack


def test_packed_bfloat16_matches_f_linear() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(5, 64, generator=g).bfloat16()
    for bias in (None, b):
        lin = Linear(w, bias, pack=should_pack(torch.device("cpu"), torch.bfloat16))
        assert lin.out_features == 96
        got, want = lin(x), F.linear(x, w, bias)
        assert got.shape == (5, 96) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_float32_and_cuda_are_never_packed() -> None:
    assert not should_pack(torch.device("cpu"), torch.float32)
    assert not should_pack(torch.device("cuda"), torch.bfloat16)
    w = torch.randn(8, 4)
    lin = Linear(w, pack=False)
    assert not lin.packed and lin.weight is w
