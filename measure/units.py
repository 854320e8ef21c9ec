"""Figures as a person reads them, on a page or a terminal: a number to about three
significant figures, a count, a duration in its best unit, a memory size."""

from __future__ import annotations

import math


def fmt_number(value: float) -> str:
    """About three significant figures, thousands separated: 1,234 · 56.7 · 8.90 · 0.277."""
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def fmt_count(value: int) -> str:
    """A count as a figure reads it in a quarter of a laptop screen: 123,456 · 1.39M."""
    return f"{value:,}" if value < 1_000_000 else f"{value / 1e6:.3g}M"


def fmt_seconds(seconds: float) -> str:
    """A duration in the unit a person reads best: ms, s, min or h ("n/a" for NaN, the
    percentile of no requests)."""
    if math.isnan(seconds):
        return "n/a"
    if seconds < 1:
        return f"{fmt_number(seconds * 1e3)} ms"
    if seconds < 120:
        return f"{fmt_number(seconds)} s"
    if seconds < 7200:
        return f"{fmt_number(seconds / 60)} min"
    return f"{fmt_number(seconds / 3600)} h"


def fmt_gib(value: float) -> str:
    """A memory size as its label reads: 24, 141, 640, 19.5."""
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"
