"""`batchlens soak`, short: races and API streams (with cancels and bad requests) against a
real `batchlens serve` child process on 127.0.0.1 for half a minute (plus the server's
start); no errors, no KV block held at the end, the JSON's keys. The README's
10-minute run is the same command with `--minutes 10`."""

from __future__ import annotations

import json
import math

import pytest

from measure import soak


@pytest.mark.model  # the server loads the bundled model
def test_a_short_soak_has_no_errors_and_leaves_no_blocks(tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = soak.main(["--minutes", "0.5", "--users", "4", "--streams", "4", "--json",
                      str(out)])
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert {"errors", "requests", "kv_blocks_held_at_end", "rss_start_mb", "rss_end_mb",
            "ttft_p99_s"} <= doc.keys()
    assert doc["errors"] == 0, doc["error_samples"]
    assert doc["kv_blocks_held_at_end"] == 0 and doc["kv_blocks_total"] > 0
    assert code == 0
    assert doc["races"] >= 1 and doc["served"] > 0
    assert doc["requests"] >= doc["served"] + doc["cancelled"] + doc["bad_requests"]
    assert doc["cancelled"] > 0  # clients that went away mid-stream, or a stopped race
    assert 0 < doc["ttft_p50_s"] <= doc["ttft_p99_s"]
    assert doc["rss_start_mb"] > 100 and doc["rss_end_mb"] > 100  # the server's, not ours
    assert math.isfinite(doc["rss_growth_after_warmup_pct"])
    assert "KV blocks held at the end: 0 of" in printed and "errors: 0" in printed


@pytest.mark.parametrize("argv", [["--minutes", "0"], ["--minutes", "1", "--users", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        soak.main(argv)
    assert "must be" in capsys.readouterr().err
