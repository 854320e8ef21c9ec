"""engine.models.linear: the oneDNN-packed path must give F.linear's results, and is taken
exactly where this machine's torch can pack (`should_pack` and the module's probe)."""

import pytest
import torch
import torch.nn.functional as F

from engine.models import linear
from engine.models.linear import Linear, should_pack


def bf16_layer(bias: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    return w, b, torch.randn(5, 64, generator=g).bfloat16()


def test_bfloat16_on_cpu_is_packed_exactly_where_packing_works() -> None:
    for bias in (False, True):
        w, b, x = bf16_layer(bias)
        can_pack = should_pack(torch.device("cpu"), torch.bfloat16) and linear._packing_works(w, b)
        lin = Linear(w, b, pack=should_pack(torch.device("cpu"), torch.bfloat16))
        assert lin.packed is can_pack
        assert (lin.weight is not w) is can_pack  # packed: oneDNN's blocked copy of W
        assert lin.out_features == 96
        got, want = lin(x), F.linear(x, w, b)
        assert got.shape == (5, 96) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_a_failing_probe_falls_back_to_f_linear(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_packing_works", lambda weight, bias: False)
    w, b, x = bf16_layer(bias=True)
    lin = Linear(w, b, pack=True)
    assert not lin.packed and lin.weight is w
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=0, atol=0)


def test_float32_and_cuda_are_never_packed() -> None:
    assert not should_pack(torch.device("cpu"), torch.float32)
    assert not should_pack(torch.device("cuda"), torch.bfloat16)
    w = torch.randn(8, 4)
    lin = Linear(w, pack=False)
    assert not lin.packed and lin.weight is w


GROWTH_PROBE = """
import torch
from engine.models.linear import Linear

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

torch.set_num_threads(1)
# float32 with oneDNN's packed weights: the LM head's path on every CPU with oneDNN
w = torch.randn(3072, 64, generator=torch.Generator().manual_seed(0))
lin = Linear(w, pack=True)
assert lin.packed, "oneDNN did not pack the weights"
for m in range(1, 41):  # warm-up: the first shapes, allocator pools
    lin(torch.zeros(m, 64))
for m in range(41, 341):  # 300 row counts never met before: the caches fill
    lin(torch.zeros(m, 64))
full = rss_mib()
for m in range(341, 641):  # 300 more: old entries must make room, not add up
    lin(torch.zeros(m, 64))
print(rss_mib() - full)
"""


@pytest.mark.exhaustive
def test_memory_stays_bounded_over_many_matmul_row_counts() -> None:
    """oneDNN keeps a primitive per matmul shape (packed weights on a CPU); importing the
    linear module bounds its caches, so once they are full, 300 more new row counts add
    nothing (unbounded, they add ~0.6 MiB each at this shape: ~180 MiB; bounded, 0 MiB
    and -29 MiB of allocator noise were seen)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/statm").exists():
        pytest.skip("reads RSS from /proc (Linux)")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN: nothing is packed, no primitive is cached")
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", GROWTH_PROBE], capture_output=True, text=True,
                         env=env, cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert out.returncode == 0, out.stderr
    growth = float(out.stdout.split()[-1])
    assert growth < 90, f"RSS grew {growth:.0f} MiB over 300 more new matmul row counts"
