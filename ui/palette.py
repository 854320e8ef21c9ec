"""One set of side names and colours for every page, so a side looks the same on each
chart. The sides and their names are the workloads' (`workloads.sides`); here they are
capitalised for legends and given their colours."""

from __future__ import annotations

from workloads.sides import LABELS

SIDE_NAMES = {side: label[:1].upper() + label[1:] for side, label in LABELS.items()}
LOCAL, DATACENTER = SIDE_NAMES["local"], SIDE_NAMES["datacenter"]  # "Local PC", "Datacenter"
LOCAL_COLOR = "#e4572e"  # also "per user" and "does not fit": what one PC gets
DATACENTER_COLOR = "#2e86de"  # also "total" and the engine's own series
ACCENT = "#f3a712"  # a second series beside the datacenter's (KV cache, prefill)
INK = "#111827"  # rules and labels drawn on a chart
