"""Finished fleet runs kept on disk, so a scenario simulated once (a presenter's rehearsal,
or `batchlens fleet --scenario day`) shows its figures at once on every later start.

A run is keyed by what it was asked (the caller's key, e.g. the scenario's parameters) and
by the source of the code that computes it (fleet/ and the projection it reads), so a
change to the simulation never shows a stale figure. The simulation is seeded: the same
key gives the same run, so a stored one is the run itself, not an approximation.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from engine.models.loader import cache_root

HERE = Path(__file__).resolve().parent
# the code a run's figures come from, besides fleet/ itself
SOURCES = (HERE.parent / "measure" / "projection.py", HERE.parent / "measure" / "hardware.py")

Run = tuple[dict[str, Any], dict[str, list]]
FOLDER: Path | None = None  # None: <the user cache>/fleet (tests point it elsewhere)


@cache
def code_version() -> str:
    """A digest of the simulation's source files."""
    digest = hashlib.sha256()
    for path in sorted(HERE.glob("*.py")) + [p for p in SOURCES if p.exists()]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run_path(key: str, folder: Path | None = None) -> Path:
    """Where the run asked as `key` is kept."""
    name = hashlib.sha256(f"{code_version()}\n{key}".encode()).hexdigest()[:24]
    return (folder or FOLDER or cache_root() / "fleet") / f"{name}.json"


def stored_run(key: str, compute: Callable[[], Run], folder: Path | None = None) -> Run:
    """The run asked as `key`: read from disk when this code has computed it before, else
    `compute()`d now and written (an unreadable or unwritable file only costs the time)."""
    path = run_path(key, folder)
    try:
        data = json.loads(path.read_text())
        return data["summary"], data["series"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    summary, series = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "summary": summary, "series": series}))
        tmp.replace(path)  # atomic: two sessions computing the same run never see half a file
    except OSError:
        pass
    return summary, series
