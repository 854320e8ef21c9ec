"""The remote side against a real runtime: llama.cpp's own `llama-server` (`make compat`).

Stand-in servers (tests/server) pin every behaviour we know of; this checks that a real
peer agrees, with what only a real one does: its keep-alive close after 5 idle seconds,
its own stream chunks, its `llamacpp:*` gauges.

- Arena races (`workloads.race.Race`) with llama-server as the local PC (beside the
  in-process engine) and, started with `-np 8`, as the datacenter (beside the one-slot
  server as the local PC): ten races in a row on the same sides, 4-6 s of idle between
  them, so a request now and then takes a pooled connection as the server closes it.
  Every request must succeed.
- `batchlens bench serve` against it: every request completes.
- Its gauges through `RemoteSide.server_state()`: running and waiting, which move.

Each test prints what it measured, so `make compat` (pytest -s) shows the figures.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from polling import wait_for

from engine import SamplingParams
from engine.serving import ServingSide
from server.remote import RemoteSide
from workloads.prompts import Chat, chat, load_prompts
from workloads.race import Race
from workloads.sides import SIDES

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[2]
RACES = 10
USERS = 8
MAX_TOKENS = 32
IDLE_GAP_S = (4.0, 6.0)  # around the 5 s after which llama-server closes an idle connection
SEED = 0
RACE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RaceFigures:
    """One race's outcome: its requests and those that failed on either side (and the
    race's error); the remote side's mean TTFT, total tokens/s, and when its first request
    went out and its last one ended (None when a request failed: the race keeps no outputs
    then)."""

    requests: int
    failed: int
    error: str | None
    mean_ttft_s: float | None
    tokens_per_s: float | None
    first_sent: float | None
    last_done: float | None


def race_prompts(race: int) -> list[Chat]:
    """Eight different chats per race, different from the last race's: llama.cpp reuses
    a slot's previous prompt, so a repeated one would make its TTFT look instant."""
    others = load_prompts().others
    return [chat(others[(race * USERS + u) % len(others)]) for u in range(USERS)]


def race_order(race: int) -> tuple[str, ...]:
    """The datacenter first in even races, the local PC first in odd ones: the side that
    ends one race starts the next, so across every other gap the remote side idles for
    exactly the gap (across the others, for the gap and the in-process side's run)."""
    return SIDES if race % 2 == 0 else SIDES[::-1]


def one_race(datacenter: ServingSide, local: ServingSide, remote: str,
             race: int) -> RaceFigures:
    """Run one race to its end; the figures of side `remote`."""
    job = Race(datacenter, local, race_prompts(race), SamplingParams(max_tokens=MAX_TOKENS),
               order=race_order(race), heartbeat_timeout=None).start()
    assert job.join(timeout=RACE_TIMEOUT_S), f"race {race} did not end"
    snap = job.snapshot()
    failed = sum(r["finish_reason"] == "error" for r in snap.rows)
    ttfts = [r["ttft_s"] for r in snap.rows if r["side"] == remote and r["ttft_s"] is not None]
    metrics = [o.metrics for o in job.outputs(remote)]
    return RaceFigures(len(snap.rows), failed, snap.error,
                       statistics.fmean(ttfts) if ttfts else None,
                       snap.sides[remote].total_tokens_per_s,
                       min((m.arrival_time for m in metrics), default=None),
                       max((m.finish_time for m in metrics if m.finish_time), default=None))


def run_races(datacenter: ServingSide, local: ServingSide, remote: str) -> list[RaceFigures]:
    """`RACES` races on the same two sides (so the same connection pools), with a seeded
    idle gap before each but the first; prints one line per race and a total."""
    rng = random.Random(SEED)
    figures: list[RaceFigures] = []
    for race in range(RACES):
        gap = rng.uniform(*IDLE_GAP_S) if race else 0.0
        time.sleep(gap)  # the idle time is the stimulus: the server's keep-alive runs out
        f = one_race(datacenter, local, remote, race)
        before = figures[-1].last_done if figures else None
        idle = f.first_sent - before if f.first_sent and before else None
        figures.append(f)
        print(f"  race {race + 1:>2} after a {gap:.2f} s gap (the {remote} side idle "
              f"{'-' if idle is None else f'{idle:.2f} s'}): {f.failed}/{f.requests} failed, mean TTFT "
              f"{_ms(f.mean_ttft_s)}, {_num(f.tokens_per_s)} tok/s"
              + (f"; error: {f.error}" if f.error else ""), flush=True)
    done = [f.tokens_per_s for f in figures if f.tokens_per_s is not None]
    ttfts = [f.mean_ttft_s for f in figures if f.mean_ttft_s is not None]
    print(f"llama-server as the {remote}: {sum(f.failed for f in figures)} of "
          f"{sum(f.requests for f in figures)} requests failed over {RACES} races; "
          f"mean TTFT {_ms(statistics.fmean(ttfts) if ttfts else None)}, "
          f"{_num(statistics.fmean(done) if done else None)} tok/s", flush=True)
    return figures


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def assert_all_served(figures: list[RaceFigures]) -> None:
    errors = [f.error for f in figures if f.error]
    assert sum(f.failed for f in figures) == 0 and not errors, errors
    assert [f.requests for f in figures] == [2 * USERS] * RACES  # both sides, all done
    assert all(f.tokens_per_s and f.tokens_per_s > 0 for f in figures)


# ---- races --------------------------------------------------------------------------------
def test_races_with_llama_server_as_the_local_pc(llama_local, in_process_engine):
    with RemoteSide(llama_local, role="local", name="llama-server") as local:
        figures = run_races(in_process_engine, local, "local")
    assert_all_served(figures)


def test_races_with_llama_server_as_the_datacenter(llama_datacenter, llama_local):
    """Beside the one-slot llama-server as the local PC: the in-process local PC decodes
    one user at a time in torch, minutes per race on a busy 2-core machine."""
    with RemoteSide(llama_datacenter, role="datacenter", name="llama-server -np 8") as dc, \
            RemoteSide(llama_local, role="local", name="llama-server") as local:
        figures = run_races(dc, local, "datacenter")
    assert_all_served(figures)


# ---- the load generator -------------------------------------------------------------------
def test_bench_serve_against_llama_server(llama_datacenter, tmp_path):
    """`batchlens bench serve` as a user runs it: 32 requests, 8 at a time, each making
    exactly `MAX_TOKENS` (without a chat template this model often ends at once, and a
    stream without content counts as failed)."""
    out = tmp_path / "bench.json"
    n = 32
    cmd = [sys.executable, "-m", "batchlens.cli", "bench", "serve",
           "--base-url", llama_datacenter, "--num-prompts", str(n), "--max-concurrency", "8",
           "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(proc.stdout + proc.stderr, flush=True)
    assert proc.returncode == 0
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"], doc["errors"]) == (n, 0, {})
    assert doc["total_output_tokens"] == n * MAX_TOKENS  # llama.cpp honours ignore_eos
    assert doc["output_throughput"] > 0 and doc["ttft_ms"]["p50"] > 0
    print(f"bench serve on llama-server -np 8: {doc['output_throughput']:.1f} tok/s, "
          f"TTFT p50 {doc['ttft_ms']['p50']:.0f} ms", flush=True)


# ---- its gauges ---------------------------------------------------------------------------
def test_server_state_reads_llama_cpp_gauges(llama_datacenter):
    """`llamacpp:requests_processing` / `requests_deferred` as running / waiting: zero
    when idle, and running while eight long requests are out."""
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    with RemoteSide(llama_datacenter, role="datacenter") as side:
        idle = side.server_state()
        assert idle is not None and idle.source == "llamacpp"
        assert (idle.running, idle.waiting) == (0, 0)
        handles = side.submit_many([chat(p) for p in load_prompts().others[:USERS]],
                                   [params] * USERS)
        seen = []

        def busy() -> bool:
            state = side.server_state()
            seen.append(state)
            return state is not None and state.running > 0

        wait_for(busy, timeout=60, message="llama-server never reported a running request",
                 interval=0.1)
        outputs = [h.result(timeout=RACE_TIMEOUT_S) for h in handles]
    assert all(o.finish_reason == "length" for o in outputs)
    peak = max(s.running for s in seen if s is not None)
    print(f"llama-server gauges: idle running={idle.running:g} waiting={idle.waiting:g} "
          f"kv={idle.kv_usage}; busy running={seen[-1].running:g} "
          f"waiting={seen[-1].waiting:g} (peak running {peak:g})", flush=True)
