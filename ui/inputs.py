"""Number inputs that say when a value is out of range, instead of ignoring it.

A `st.number_input` with bounds drops a typed number outside them without a word (the box
goes back to the old value). These take any number and show, under the box, what is
allowed; the caller gets None and keeps its Run button disabled.
"""

from __future__ import annotations

import streamlit as st
from streamlit.delta_generator import DeltaGenerator


def range_error(label: str, value: float | None, low: float, high: float,
                whole: bool = True) -> str | None:
    """Why `value` cannot be used for `label` (a number in [low, high], whole unless
    `whole` is False), or None."""
    allowed = f"{'a whole number' if whole else 'a number'} from {_num(low)} to {_num(high)}"
    if value is None:
        return f"{label}: enter {allowed}"
    if (whole and value != int(value)) or not low <= value <= high:
        return f"{label}: {_num(value)} is out of range; enter {allowed}"
    return None


def _num(value: float) -> str:
    """1,000 for whole numbers, 0.5 otherwise."""
    return f"{int(value):,}" if value == int(value) else f"{value:g}"


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


def number(label: str, low: float, high: float, default: float, *, step: float, key: str,
           where: DeltaGenerator | None = None) -> float | None:
    """A number box for `label` taking any number; the value when it lies in [low, high],
    else None with the reason shown under the box."""
    box = where or st
    value = box.number_input(label, value=float(default), step=float(step), key=key)
    error = range_error(label, value, low, high, whole=False)
    if error:
        box.error(error)
        return None
    return float(value)
