"""Whole-number inputs that say when a value is out of range, instead of ignoring it.

A `st.number_input` with bounds drops a typed number outside them without a word (the box
goes back to the old value). These take any number and show, under the box, what is
allowed; the caller gets None and keeps its Run button disabled.
"""

from __future__ import annotations

import streamlit as st
from streamlit.delta_generator import DeltaGenerator


def range_error(label: str, value: float | None, low: int, high: int) -> str | None:
    """Why `value` cannot be used for `label` (a whole number in [low, high]), or None."""
    allowed = f"a whole number from {low:,} to {high:,}"
    if value is None:
        return f"{label}: enter {allowed}"
    if value != int(value) or not low <= value <= high:
        shown = f"{value:,}" if value == int(value) else f"{value:g}"
        return f"{label}: {shown} is out of range; enter {allowed}"
    return None


def whole_number(label: str, low: int, high: int, default: int, *, key: str,
                 disabled: bool = False, help: str | None = None,
                 where: DeltaGenerator | None = None) -> int | None:
    """A number box for `label` taking any whole number; the value when it lies in
    [low, high], else None with the reason shown under the box."""
    box = where or st
    value = box.number_input(label, value=default, step=1, key=key, disabled=disabled,
                             help=help)
    error = range_error(label, value, low, high)
    if error:
        box.error(error)
        return None
    return int(value)
