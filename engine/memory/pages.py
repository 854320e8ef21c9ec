"""Tensors on 2 MiB pages (Linux's transparent huge pages) for what a step streams.

A decode step reads every weight and its sequences' K/V once. On 4 KiB pages that is a TLB
miss every 64 cache lines, and the CPU's prefetchers stop at each page's end; in a virtual
machine every miss walks two page tables. Linux hands out 2 MiB pages to memory marked
MADV_HUGEPAGE before it is first touched, which is what `empty` does (the default
"madvise" setting gives them to no other memory). Elsewhere (another OS, a GPU tensor,
transparent huge pages off, under 2 MiB) it is plain `torch.empty`.
"""

from __future__ import annotations

import functools
import itertools
import math
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2**21
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def available() -> bool:
    """Whether this OS gives 2 MiB pages to memory that asks for them."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, on 2 MiB pages where `available` and it spans one."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not available():
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the faults take whole pages
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf mapped while it lives
    skip = -raw.data_ptr() % HUGE_PAGE  # start on a page: every 2 MiB of it is one page
    return raw[skip: skip + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.zeros`, on 2 MiB pages for a CPU tensor where `empty` gives them."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty(shape, dtype).zero_()


def gathered(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` in one buffer on 2 MiB pages, each on a cache line of its own
    (a model's matmuls are mostly under 2 MiB each, so apart they would get none), where
    `empty` gives them; else `tensors` as they are. The buffer lives while any copy does."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = list(itertools.accumulate((-(-n // 64) * 64 for n in sizes[:-1]), initial=0))
    if (not tensors or any(t.device.type != "cpu" for t in tensors) or not available()
            or starts[-1] + sizes[-1] < HUGE_PAGE):
        return list(tensors)
    buf = empty((starts[-1] + sizes[-1],), torch.uint8)
    out = []
    for t, start, n in zip(tensors, starts, sizes, strict=True):
        out.append(buf[start: start + n].view(t.dtype).view(t.shape).copy_(t))
    return out
