"""The figures as pages and terminals print them."""

from __future__ import annotations

import math

from measure.units import fmt_count, fmt_gib, fmt_number, fmt_seconds


def test_formats_read_well_on_a_projector():
    assert [fmt_number(v) for v in (1234.4, 56.71, 8.9, 0.27714)] == [
        "1,234", "56.7", "8.90", "0.277"]
    assert [fmt_seconds(s) for s in (0.3994, 8.712, 1853.0, 9000.0)] == [
        "399 ms", "8.71 s", "30.9 min", "2.50 h"]
    assert [fmt_count(n) for n in (0, 123_456, 999_999, 1_393_528, 12_500_000)] == [
        "0", "123,456", "999,999", "1.39M", "12.5M"]
    assert [fmt_gib(g) for g in (24, 19.5, 141, 1280)] == ["24", "19.5", "141", "1,280"]


def test_a_percentile_of_no_requests_reads_n_a():
    assert fmt_seconds(math.nan) == "n/a"
