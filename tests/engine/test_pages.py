"""CPU tensors on 2 MiB pages for what a step streams (engine/memory/pages.py)."""

from __future__ import annotations

import pytest
import torch

from engine.memory import pages

MIB = 2**20


def huge_kib_at(address: int) -> int:
    """KiB on huge pages in the mapping of this process that holds `address` (Linux)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: its range
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not pages.available(), reason="this OS gives no 2 MiB pages on request")
def test_a_large_tensor_starts_on_a_page_and_takes_huge_pages():
    t = pages.zeros((16 * MIB // 2,), torch.bfloat16)  # 16 MiB
    assert t.data_ptr() % pages.HUGE_PAGE == 0
    assert t.shape == (8 * MIB,) and t.dtype == torch.bfloat16 and not t.any()
    assert huge_kib_at(t.data_ptr()) >= 8 * 1024  # at least half of it: the OS may be short
    t.fill_(3.0)
    assert t.sum().item() == 3.0 * t.numel()


def test_small_tensors_and_no_huge_pages_fall_back_to_torch(monkeypatch):
    small = pages.empty((10, 10), torch.float32)
    assert small.shape == (10, 10) and small.untyped_storage().nbytes() == 400
    monkeypatch.setattr(pages, "available", lambda: False)
    big = pages.zeros((4 * MIB,), torch.float32)
    assert big.untyped_storage().nbytes() == 16 * MIB and not big.any()
    ts = [torch.randn(1024, 1024), torch.randn(300)]
    assert all(a is b for a, b in zip(pages.gathered(ts), ts, strict=True))


def test_gathered_copies_share_one_buffer_each_on_its_own_lines():
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(960, 576, generator=gen).bfloat16(), torch.randn(7, generator=gen),
          torch.randn(576, 1536, generator=gen).bfloat16(), torch.randn(33).to(torch.int32)]
    out = pages.gathered(ts)
    for a, b in zip(ts, out, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0
    ptrs = sorted((b.data_ptr(), b.numel() * b.element_size()) for b in out)
    assert all(p + n <= q for (p, n), (q, _) in zip(ptrs, ptrs[1:], strict=False))  # apart
    if pages.available():
        assert len({b.untyped_storage().data_ptr() for b in out}) == 1
        assert out[0].data_ptr() % pages.HUGE_PAGE == 0
    ts[0].zero_()  # copies, not views
    assert out[0].abs().sum() > 0


def test_the_models_streamed_weights_sit_in_one_buffer(loaded):
    model = loaded.model
    if model.device.type != "cpu" or not pages.available():
        pytest.skip("2 MiB pages are for CPU weights on an OS that gives them")
    weights = [lin.weight for lin in [model.lm_head] + [
        lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not lin.packed]
    assert weights, "no weight is streamed by the kernel or F.linear here"
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1


def test_the_kv_pool_starts_on_pages(loaded):
    from engine.runner import ModelRunner

    if loaded.model.device.type != "cpu" or not pages.available():
        pytest.skip("2 MiB pages are for a CPU pool on an OS that gives them")
    runner = ModelRunner(loaded.model, 512, 16)  # 6 KiB of K per block and layer: 3 MiB
    try:
        for k, v in runner.kv_caches:
            assert k.data_ptr() % pages.HUGE_PAGE == 0 and v.data_ptr() % pages.HUGE_PAGE == 0
            assert not k.any() and not v.any()
    finally:
        runner.release_kv()
