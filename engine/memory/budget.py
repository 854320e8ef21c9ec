"""Device memory for the KV pool: what a new pool may take, checked before anything is
allocated, and a refusal that names the largest pool that fits.

RAM is read from /proc/meminfo (or psutil), GPU memory from `torch.cuda.mem_get_info`;
block accounting itself is `engine.kv_cache`, pure Python. `GIB` is the repo's one binary
gigabyte, `gib` formats bytes for a message::

    device memory now:  |<----------------- available ----------------->|  (in use) |
                        |<------ what a new pool may take ----->|reserve|

    reserve = max(1 GiB, 10% of the device): activations, the local sides' contiguous
    KV, Python and the page; the model's weights are already loaded (not "available")
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
RESERVE_MIN_BYTES = GIB
RESERVE_SHARE = 0.10


@dataclass(frozen=True)
class MemoryBudget:
    """What a new KV pool may take on one device: `available` bytes now minus `reserve`."""

    what: str  # "RAM" or "GPU memory"
    available: int
    reserve: int

    @property
    def limit(self) -> int:
        return max(self.available - self.reserve, 0)


def gib(num_bytes: float) -> str:
    """Bytes as GiB for a message: "1.00 GiB", "3,433 GiB"."""
    value = num_bytes / GIB
    return f"{value:,.0f} GiB" if value >= 100 else f"{value:.2f} GiB"


def pool_bytes(num_blocks: int, block_size: int, bytes_per_token: int) -> int:
    """Bytes of a paged pool: blocks x block size x KV bytes per token (K and V, all layers)."""
    return num_blocks * block_size * bytes_per_token


def memory_budget(device: str = "cpu") -> MemoryBudget | None:
    """What a new pool may take on `device` ("cpu", "cuda", "cuda:1") now: RAM from
    /proc/meminfo's MemAvailable (or psutil), GPU memory from `torch.cuda.mem_get_info`;
    None when it cannot be read."""
    if device.startswith("cuda"):
        import torch  # only here: the RAM path needs no torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return MemoryBudget("GPU memory", free, _reserve(total))
    ram = _ram()
    return None if ram is None else MemoryBudget("RAM", ram[0], _reserve(ram[1]))


def _reserve(total: int) -> int:
    return max(RESERVE_MIN_BYTES, int(total * RESERVE_SHARE))


def _ram() -> tuple[int, int] | None:
    """(available, total) bytes of RAM, or None."""
    try:
        with open("/proc/meminfo") as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
        return kib["MemAvailable"] * 1024, kib["MemTotal"] * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    vm = psutil.virtual_memory()
    return vm.available, vm.total


def largest_pool(block_size: int, bytes_per_token: int, budget: MemoryBudget) -> int:
    """The most blocks of `block_size` tokens that fit the budget."""
    return budget.limit // (block_size * bytes_per_token)


def check_pool_memory(num_blocks: int, block_size: int, bytes_per_token: int,
                      device: str = "cpu", budget: MemoryBudget | None = None) -> None:
    """Raise `ValueError` (one line: the pool, the limit, the largest pool that fits) when
    a pool would not fit the device's memory (`budget`, else read now); nothing is
    allocated either way. Unknown memory passes."""
    budget = budget or memory_budget(device)
    need = pool_bytes(num_blocks, block_size, bytes_per_token)
    if budget is None or need <= budget.limit:
        return
    fits = largest_pool(block_size, bytes_per_token, budget)
    raise ValueError(
        f"num_kv_blocks: a pool of {num_blocks:,} blocks x {block_size} tokens ({gib(need)}) "
        f"does not fit the {gib(budget.limit)} of {budget.what} free for it "
        f"({gib(budget.available)} available minus {gib(budget.reserve)} kept for the model "
        f"and the local side); the largest pool that fits is {fits:,} blocks "
        f"({gib(pool_bytes(fits, block_size, bytes_per_token))})")
