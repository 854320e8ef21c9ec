"""KV snapshots as DataFrames for the KV cache page's charts (pure, no Streamlit).

Both block maps are grids of 16, 32 or 64 cells a row (`map_columns`: fewer for a small
pool, so its cells stay big), one block a cell; a pool bigger than `MAX_CELLS` blocks draws
`blocks_per_cell` consecutive blocks in each cell (its colour from the blocks it holds,
its counts exact), so a chart never carries more rows::

    paged       cell = block: colour of the request that owns it, ref count if shared
    contiguous  the same pool, each request reserving n_ctx tokens end to end
                (used blocks in its colour, reserved-but-unused ones pale)

Every count comes from the engine's `kv_snapshot()` / `stats()`; the colours are
decoration.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pandas as pd

from engine.engine import StepStats
from engine.kv_cache import BlockInfo, waste_for_block_size

GRID_COLUMNS = (16, 32, 64)
MAX_CELLS = GRID_COLUMNS[-1] * 48
MAX_STEPS = 300  # the timeline shows the last few hundred steps
FREE_COLOR = "#e9ecef"
CACHED_COLOR = "#8d99ae"
RESERVED_OPACITY = 0.28
PALETTE = (  # distinct hues, no greys (those mean free and cached)
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5",
    "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
)
MAP_COLUMNS = ["cell", "row", "col", "first_block", "last_block", "state", "owner", "owners",
               "ref_count", "label", "used", "cached", "free", "color"]
CONTIGUOUS_COLUMNS = ["cell", "row", "col", "first_block", "last_block", "state", "owner",
                      "used", "reserved", "free", "color", "opacity"]
STEP_COLUMNS = ["step", "kind", "tokens", "lo", "hi", "x0", "x1", "t", "ms", "num_seqs",
                "num_preempted", "kv_usage"]
WASTE_COLUMNS = ["block_size", "waste", "chosen", "label", "label_side"]


def request_color(request_id: str) -> str:
    """A stable colour per request: its trailing number picks the hue (user 3 is always
    the same colour), else a hash of the id."""
    m = re.search(r"(\d+)$", request_id)
    i = int(m.group(1)) if m else zlib.crc32(request_id.encode())
    return PALETTE[i % len(PALETTE)]


def blocks_per_cell(num_blocks: int, max_cells: int = MAX_CELLS) -> int:
    """How many consecutive blocks one cell draws so the map has at most `max_cells`."""
    return max(1, -(-num_blocks // max_cells))


def map_columns(num_blocks: int, max_cells: int = MAX_CELLS) -> int:
    """Cells a row for a pool of `num_blocks`: the fewest of GRID_COLUMNS whose square
    cells keep the map no taller than about 3/4 of its width, else the most."""
    cells = -(-num_blocks // blocks_per_cell(num_blocks, max_cells))
    return next((c for c in GRID_COLUMNS if 3 * c * c >= 4 * cells), GRID_COLUMNS[-1])


def _cell_place(cell: int, group: int, num_blocks: int, columns: int) -> dict:
    first = cell * group
    return {"cell": cell, "row": cell // columns, "col": cell % columns,
            "first_block": first, "last_block": min(first + group, num_blocks) - 1}


# ---- the paged block map -------------------------------------------------------------
def block_map_frame(blocks: Sequence[BlockInfo], max_cells: int = MAX_CELLS) -> pd.DataFrame:
    """One row per cell: state ("used" | "cached" | "free"), owner (the request most of
    its used blocks belong to first), ref_count (highest), label (the ref count of a
    shared block), and the exact number of used, cached and free blocks it draws."""
    n = len(blocks)
    group, columns = blocks_per_cell(n, max_cells), map_columns(n, max_cells)
    rows = []
    for cell, start in enumerate(range(0, n, group)):
        part = blocks[start:start + group]
        used = [b for b in part if b.state == "used"]
        cached = sum(b.state == "cached" for b in part)
        ref = max(b.ref_count for b in part)
        if used:
            assert all(b.owners for b in used), "a used block is in some block table"
            owner = Counter(b.owners[0] for b in used).most_common(1)[0][0]
            state, color = "used", request_color(owner)
        else:
            owner = ""
            state, color = ("cached", CACHED_COLOR) if cached else ("free", FREE_COLOR)
        owners = sorted({o for b in used for o in b.owners})
        rows.append({**_cell_place(cell, group, n, columns), "state": state, "owner": owner,
                     "owners": ", ".join(owners), "ref_count": ref,
                     "label": str(ref) if ref > 1 else "", "used": len(used),
                     "cached": cached, "free": len(part) - len(used) - cached,
                     "color": color})
    return pd.DataFrame.from_records(rows, columns=MAP_COLUMNS)


# ---- the contiguous (local PC) layout --------------------------------------------------
@dataclass(frozen=True)
class Reservation:
    """One request as the local PC holds it: n_ctx tokens reserved, a few used."""

    request_id: str
    reserved_blocks: int
    used_blocks: int


def contiguous_reservations(
    blocks: Iterable[BlockInfo], n_ctx: int, block_size: int,
) -> list[Reservation]:
    """Every request holding blocks now, reserving `n_ctx` tokens (in blocks) instead;
    used = the blocks of its block table (capped at the reservation)."""
    held: Counter[str] = Counter()
    for b in blocks:
        held.update(b.owners)
    reserved = -(-n_ctx // block_size)
    return [Reservation(rid, reserved, min(n, reserved))
            for rid, n in sorted(held.items(), key=lambda kv: _natural(kv[0]))]


def _natural(request_id: str) -> tuple[str, int]:
    m = re.match(r"(.*?)(\d+)$", request_id)
    return (m.group(1), int(m.group(2))) if m else (request_id, -1)


def fitting(reservations: Sequence[Reservation], num_blocks: int) -> int:
    """How many of the reservations fit the pool, laid end to end in order."""
    if not reservations:
        return 0
    return min(len(reservations), num_blocks // reservations[0].reserved_blocks)


def contiguous_frame(
    reservations: Sequence[Reservation], num_blocks: int, max_cells: int = MAX_CELLS,
) -> pd.DataFrame:
    """The pool of `num_blocks` with the reservations that fit laid end to end: one row
    per cell (cells as in `block_map_frame`), state "used" | "reserved" | "free", and the
    exact number of used, reserved-but-unused and free blocks it draws."""
    group, columns = blocks_per_cell(num_blocks, max_cells), map_columns(num_blocks, max_cells)
    fit = list(reservations[:fitting(reservations, num_blocks)])
    size = fit[0].reserved_blocks if fit else 1
    rows = []
    for cell, start in enumerate(range(0, num_blocks, group)):
        end = min(start + group, num_blocks)
        used: Counter[str] = Counter()
        reserved: Counter[str] = Counter()
        for i in range(start // size, min((end - 1) // size + 1, len(fit))):
            r, lo = fit[i], i * size
            u_lo, u_hi = max(start, lo), min(end, lo + r.used_blocks)
            r_lo, r_hi = max(start, lo + r.used_blocks), min(end, lo + size)
            used[r.request_id] += max(0, u_hi - u_lo)
            reserved[r.request_id] += max(0, r_hi - r_lo)
        n_used, n_res = sum(used.values()), sum(reserved.values())
        if n_used or n_res:
            owner = (used if n_used else reserved).most_common(1)[0][0]
            state = "used" if n_used else "reserved"
            color, opacity = request_color(owner), 1.0 if n_used else RESERVED_OPACITY
        else:
            owner, state, color, opacity = "", "free", FREE_COLOR, 1.0
        rows.append({**_cell_place(cell, group, num_blocks, columns), "state": state, "owner": owner,
                     "used": n_used, "reserved": n_res, "free": end - start - n_used - n_res,
                     "color": color, "opacity": opacity})
    return pd.DataFrame.from_records(rows, columns=CONTIGUOUS_COLUMNS)


# ---- the scheduler timeline -----------------------------------------------------------
def step_frame(steps: Sequence[StepStats], num_steps: int, last: int = MAX_STEPS) -> pd.DataFrame:
    """The last `last` steps, two rows each (prefill, decode tokens) stacked as [lo, hi]
    over [x0, x1] = step index -/+ 0.4, and two more where a step verified speculative
    drafts (accepted, rejected draft tokens) on top; `num_steps` is the engine's step
    count, so the index is the step's number since the engine started."""
    shown = list(steps)[-last:]
    first = num_steps - len(shown)
    t0 = shown[0].start if shown else 0.0
    rows = []
    for i, s in enumerate(shown):
        step = first + i
        common = {"step": step, "x0": step - 0.4, "x1": step + 0.4, "t": s.start - t0,
                  "ms": s.duration * 1e3, "num_seqs": s.num_seqs,
                  "num_preempted": s.num_preempted, "kv_usage": s.kv_usage}
        p, d = s.num_prefill_tokens, s.num_decode_tokens
        rows.append({**common, "kind": "prefill", "tokens": p, "lo": 0, "hi": p})
        rows.append({**common, "kind": "decode", "tokens": d, "lo": p, "hi": p + d})
        if s.num_draft_tokens:
            a, r = s.num_accepted_tokens, s.num_draft_tokens - s.num_accepted_tokens
            rows.append({**common, "kind": "accepted draft", "tokens": a, "lo": p + d,
                         "hi": p + d + a})
            rows.append({**common, "kind": "rejected draft", "tokens": r, "lo": p + d + a,
                         "hi": p + d + a + r})
    return pd.DataFrame.from_records(rows, columns=STEP_COLUMNS)


# ---- the block size trade-off ---------------------------------------------------------
def waste_frame(lengths: Sequence[int], block_sizes: Sequence[int], chosen: int) -> pd.DataFrame:
    """Waste (reserved-but-unused share of slots) of requests of `lengths` tokens at each
    block size; `chosen` marks the block size in use, its label on the side with room."""
    rows = []
    for i, bs in enumerate(block_sizes):
        waste = waste_for_block_size(lengths, bs)
        rows.append({"block_size": bs, "waste": waste, "chosen": bs == chosen,
                     "label": f"block size {bs}: {waste:.1%} empty" if bs == chosen else "",
                     "label_side": "left" if 2 * i < len(block_sizes) else "right"})
    return pd.DataFrame.from_records(rows, columns=WASTE_COLUMNS)


# ---- blocks shared between block tables ----------------------------------------------------
@dataclass(frozen=True)
class KVShared:
    """What sharing blocks between block tables saves: the blocks the tables would hold as
    separate copies, minus the distinct blocks they hold."""

    separate_blocks: int
    held_blocks: int
    block_bytes: int

    @property
    def saved_bytes(self) -> int:
        return (self.separate_blocks - self.held_blocks) * self.block_bytes

    @property
    def saved_share(self) -> float:
        return 1 - self.held_blocks / self.separate_blocks if self.separate_blocks else 0.0

    @property
    def line(self) -> str:
        return f"KV shared: {self.saved_bytes / 2**20:.1f} MiB saved ({self.saved_share:.0%})"


def kv_shared(reserved_slots: int, used_blocks: int, block_size: int,
              bytes_per_token: int) -> KVShared | None:
    """The saving of shared blocks (prefix-cache hits, forked candidates) from a pool's
    counts: `reserved_slots` counts a shared block once per table, `used_blocks` once. None
    when no block is shared."""
    separate = reserved_slots // block_size
    if separate <= used_blocks:
        return None
    return KVShared(separate, used_blocks, block_size * bytes_per_token)


def peak_kv_shared(steps: Iterable[StepStats], num_blocks: int, block_size: int,
                   bytes_per_token: int) -> KVShared | None:
    """The largest saving any of `steps` left (from each step's reserved slots and
    usage), or None when no step shared a block."""
    best = None
    for s in steps:
        k = kv_shared(s.kv_reserved_slots, round(s.kv_usage * num_blocks), block_size,
                      bytes_per_token)
        if k is not None and (best is None or k.saved_bytes > best.saved_bytes):
            best = k
    return best
