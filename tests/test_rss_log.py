"""`pytest --rss-log DIR` (tests/rss_log.py) writes a line per test with its RSS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_rss_log_writes_each_tests_rss_before_and_after(tmp_path: Path) -> None:
    (tmp_path / "test_grow.py").write_text(
        "def test_grows():\n    global KEPT\n    KEPT = b\"x\" * (64 * 2**20)\n\n"
        "def test_stays():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "rss_log", "-p", "no:cacheprovider",
         "--rss-log", str(tmp_path / "rss"), str(tmp_path / "test_grow.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("\t") for line in (tmp_path / "rss" / "main.log").read_text().splitlines()]
    assert [r[5] for r in rows] == ["test_grow.py::test_grows", "test_grow.py::test_stays"]
    grows = rows[0]
    assert int(grows[2]) - int(grows[1]) == int(grows[3]) >= 60  # the 64 MiB it kept
    assert all(int(r[4]) > 0 for r in rows)  # MemAvailable
