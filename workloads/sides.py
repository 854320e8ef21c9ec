"""The two serving sides every workload compares, by name, and how a sentence names them
(the pages' chart legends and colours are built from these in `ui.palette`)."""

from __future__ import annotations

SIDES = ("datacenter", "local")
LABELS = {"datacenter": "datacenter", "local": "local PC"}


def check_order(order: tuple[str, ...]) -> None:
    """Raise `ValueError` unless `order` names each side exactly once."""
    if sorted(order) != sorted(SIDES):
        raise ValueError(f"order: must name each of {SIDES} once, got {order}")
