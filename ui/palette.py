"""One set of names and colours for every page, so a side looks the same on each chart."""

from __future__ import annotations

LOCAL, DATACENTER = "Local PC", "Datacenter"
SIDE_NAMES = {"local": LOCAL, "datacenter": DATACENTER}  # workloads.race / workloads.sweep sides
LOCAL_COLOR = "#e4572e"  # also "per user" and "does not fit": what one PC gets
DATACENTER_COLOR = "#2e86de"  # also "total" and the engine's own series
ACCENT = "#f3a712"  # a second series beside the datacenter's (KV cache, prefill)
INK = "#111827"  # rules and labels drawn on a chart
