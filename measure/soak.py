"""`batchlens soak`: races and API streams against a batchlens server on 127.0.0.1 for N min.

Whether the server holds under minutes of mixed traffic: no errors, no KV blocks left
held, no memory growth.

    batchlens soak --minutes N [--json PATH] [--users 8] [--streams 6] [--dtype auto]

1. `batchlens serve` starts in a child process on a free 127.0.0.1 port; the RSS measured
   is that process's (/proc). A first request warms it up.
2. For N minutes, two drivers at once:
   - races: `workloads.race.Race`, the arena page's own race, with both sides
     `server.remote.RemoteSide`s on the server (datacenter: every user at once; local PC:
     one at a time), which is what a browser's race asks of the shared engine, without a
     browser; every third race is stopped a moment after it starts, as by a user's Stop,
     and so is one still running at the end;
   - API streams: `--streams` concurrent clients (httpx, one asyncio loop) sending
     streamed chat and completions requests of mixed prompt (5-300 words) and output
     (4-64 tokens) lengths; one in seven closes its connection after its first token (a
     client that goes away), one in ten is a bad request that must get an OpenAI-shaped 4xx.
3. The server is left to go quiet; /health then gives the KV blocks still held (must be
   0) and RSS is read again; the server is stopped.

Counted as errors: a request that should have been served and was not (an HTTP error,
an error event, a transport failure, a stream without content), a bad request answered
with anything but an OpenAI-shaped 4xx (a 5xx above all), a race that ended in an error.
TTFT is the client's (request sent -> first content chunk, `engine.metrics`) over the API
streams and the races' datacenter requests (the local side's one-at-a-time queue would
swamp it). RSS growth is measured from the end of the warm-up (the first fifth of the
run, at most a minute) to the end. Traffic goes only to 127.0.0.1, bounded in
concurrency and time; the run stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.config import DTYPES, SamplingParams
from engine.metrics import RequestMetrics, percentile
from server.child import child_server, free_port, serve_command
from server.connections import async_client
from workloads.prompts import chat, load_prompts

PROG = "batchlens soak"
HOST = "127.0.0.1"
START_TIMEOUT_S = 300.0
QUIET_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
RSS_EVERY_S = 5.0
STOP_EVERY = 3  # every third race is stopped mid-way (and one still running at the end)
CANCEL_ONE_IN, BAD_ONE_IN = 7, 10
BAD_BODIES: tuple[bytes, ...] = (
    b'{"prompt": "Hi", "max_tokens": "ten"}',
    b'{"prompt": "Hi", "max_tokens": -3}',
    b'{"prompt": "Hi", "max_tokens": 1000000}',
    b'{"prompt": "Hi", "temperature": [1]}',
    b'{"prompt": "\\ud800"}',
    b'{"messages": "hello"}',
    b'{"prompt": "Hi", "model": "no-such-model"}',
    b'{"prompt": ',
    b'[1, 2, 3]',
    ('{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}").encode(),
)


@dataclass
class Tally:
    """What the drivers saw; updated from several threads under `lock`."""

    requests: int = 0
    served: int = 0
    cancelled: int = 0
    bad_requests: int = 0
    errors: int = 0
    races: int = 0
    races_stopped: int = 0
    ttfts: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, message: str) -> None:
        with self.lock:
            self.errors += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(message[:300])


# ---- the server -----------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MiB (Linux /proc; psutil elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def wait_quiet(base: str, timeout: float = QUIET_TIMEOUT_S) -> dict[str, Any]:
    """/health once nothing runs or waits (or at `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            health = httpx.get(base + "/health", timeout=10).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RuntimeError(f"the server stopped answering /health: {exc}") from None
        idle = health.get("num_requests_running") == 0 == health.get("num_requests_waiting")
        if idle or time.monotonic() > deadline:
            return health
        time.sleep(0.25)


# ---- the races --------------------------------------------------------------------------
def run_races(base: str, users: int, deadline: float, tally: Tally, seed: int) -> None:
    """Races one after another until `deadline`, every `STOP_EVERY`-th stopped mid-way."""
    from server.remote import RemoteSide
    from workloads.race import Race

    rng = random.Random(seed)
    others = load_prompts().others
    datacenter = RemoteSide(base + "/v1", role="datacenter", timeout=REQUEST_TIMEOUT_S)
    local = RemoteSide(base + "/v1", role="local", timeout=REQUEST_TIMEOUT_S)
    try:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            prompts = [chat(rng.choice(others)) for _ in range(users)]
            params = SamplingParams(max_tokens=rng.randint(8, 24), temperature=0.0)
            race = Race(datacenter, local, prompts, params, heartbeat_timeout=None).start()
            stop_at = time.monotonic() + rng.uniform(0.2, 1.5) if n % STOP_EVERY == 0 \
                else deadline  # a race still running at the end is stopped too
            stopped = False
            while not race.join(0.1):
                if not stopped and time.monotonic() >= stop_at:
                    race.stop()
                    stopped = True
                if time.monotonic() > stop_at + REQUEST_TIMEOUT_S:
                    race.close()
                    tally.error("a race did not end within its time limit")
                    break
            snap = race.snapshot()
            with tally.lock:
                tally.races += 1
                tally.races_stopped += snap.phase == "stopped"
                for row in snap.rows:
                    tally.requests += 1
                    if row["finish_reason"] in ("stop", "length"):
                        tally.served += 1
                        if row["side"] == "datacenter" and row["ttft_s"] is not None:
                            tally.ttfts.append(row["ttft_s"])
                    elif row["finish_reason"] == "cancelled" and stopped:
                        tally.cancelled += 1
            bad = [r for r in snap.rows if r["finish_reason"] == "error"]
            for _ in bad:
                tally.error("a race request failed")
            if snap.error is not None:
                tally.error(f"race: {snap.error}")
    finally:
        datacenter.shutdown()
        local.shutdown()


# ---- the API streams ----------------------------------------------------------------------
def _stream_body(rng: random.Random, model: str, words: list[str]) -> tuple[str, dict]:
    """A streamed chat or completions request of mixed prompt and output lengths."""
    text = rng.choice(words) + " " + " ".join(f"item {i}," for i in range(rng.randint(5, 300)))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(4, 64), "stream": True,
                            "temperature": rng.choice((0.0, 0.8)),
                            "stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text
    return "/v1/completions", body


def _content(data: str) -> bool:
    """Whether an SSE data payload carries text."""
    chunk = json.loads(data)
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _one_stream(client: httpx.AsyncClient, path: str, body: dict, cancel: bool,
                      tally: Tally) -> None:
    start, first, done = time.monotonic(), None, False
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                tally.error(f"{path}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            event = ""
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = line[5:].strip()
                    if event == "error":
                        tally.error(f"{path}: error event: {data[:200]}")
                        return
                    if data == "[DONE]":
                        done = True
                        break
                    if first is None and _content(data):
                        first = time.monotonic()
                        if cancel:
                            break  # leaving the block closes the connection
    except (httpx.HTTPError, ValueError) as exc:
        tally.error(f"{path}: {type(exc).__name__}: {exc}")
        return
    if first is None or not (cancel or done):
        tally.error(f"{path}: the stream ended without content")
        return
    with tally.lock:
        if cancel:
            tally.cancelled += 1
        else:
            tally.served += 1
            tally.ttfts.append(RequestMetrics(arrival_time=start, token_times=[first]).ttft)


async def _one_bad(client: httpx.AsyncClient, body: bytes, tally: Tally) -> None:
    try:
        r = await client.post("/v1/completions", content=body,
                              headers={"Content-Type": "application/json"})
        err = r.json().get("error") if r.headers.get("content-type", "").startswith(
            "application/json") else None
    except (httpx.HTTPError, ValueError) as exc:
        tally.error(f"bad request: {type(exc).__name__}: {exc}")
        return
    if not (400 <= r.status_code < 500 and isinstance(err, dict)
            and isinstance(err.get("message"), str)):
        tally.error(f"bad request {body[:60]!r}: HTTP {r.status_code}: {r.text[:200]}")
        return
    with tally.lock:
        tally.bad_requests += 1


async def _api_worker(client: httpx.AsyncClient, model: str, deadline: float, tally: Tally,
                      rng: random.Random, words: list[str]) -> None:
    while time.monotonic() < deadline:
        with tally.lock:
            tally.requests += 1
        if rng.randrange(BAD_ONE_IN) == 0:
            await _one_bad(client, rng.choice(BAD_BODIES), tally)
            continue
        path, body = _stream_body(rng, model, words)
        await _one_stream(client, path, body, rng.randrange(CANCEL_ONE_IN) == 0, tally)


async def _api_streams(base: str, model: str, streams: int, deadline: float, tally: Tally,
                       seed: int) -> None:
    words = list(load_prompts().others)
    async with async_client(base_url=base, timeout=REQUEST_TIMEOUT_S, max_connections=streams,
                            max_keepalive_connections=streams) as client:
        await asyncio.gather(*(_api_worker(client, model, deadline, tally,
                                           random.Random(seed * 1000 + i), words)
                               for i in range(streams)))


# ---- the run --------------------------------------------------------------------------------
def _guarded(tally: Tally, what: str, fn: Any, *args: Any) -> None:
    """Run a driver; an exception that ends it early counts as an error."""
    try:
        fn(*args)
    except Exception as exc:
        tally.error(f"{what} driver failed: {type(exc).__name__}: {exc}")


def soak(minutes: float, users: int = 8, streams: int = 6, dtype: str = "auto",
         seed: int = 0, log: Path | None = None) -> dict[str, Any]:
    """Run the soak (see the module's notes); its figures as a JSON-ready dict."""
    log = log or Path(tempfile.gettempdir()) / "batchlens-soak-server.log"
    port = free_port()
    base = f"http://{HOST}:{port}"
    tally = Tally()
    rss: list[tuple[float, float]] = []
    cmd = serve_command(port, "--dtype", dtype, "--log-level", "warning", host=HOST)
    env = {k: v for k, v in os.environ.items() if k != "BATCHLENS_API_KEY"}
    with child_server(cmd, base + "/health", log=log, timeout=START_TIMEOUT_S,
                      env=env) as proc:
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        httpx.post(base + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   json={"model": model, "prompt": "Hello", "max_tokens": 4})  # warm-up
        duration = minutes * 60.0
        t0 = time.monotonic()
        deadline = t0 + duration
        warm_at = t0 + min(60.0, duration / 5)
        rss.append((0.0, rss_mb(proc.pid)))
        races = threading.Thread(target=_guarded, name="soak-races", daemon=True, args=(
            tally, "races", run_races, base, users, deadline, tally, seed))
        api = threading.Thread(target=_guarded, name="soak-api", daemon=True, args=(
            tally, "API streams", lambda: asyncio.run(_api_streams(
                base, model, streams, deadline, tally, seed))))
        races.start()
        api.start()
        rss_warm = None
        while races.is_alive() or api.is_alive():
            now = time.monotonic()
            if rss_warm is None and now >= warm_at:
                rss_warm = rss_mb(proc.pid)
            if not rss or now - t0 - rss[-1][0] >= RSS_EVERY_S:
                rss.append((now - t0, rss_mb(proc.pid)))
            if now > deadline + 2 * REQUEST_TIMEOUT_S + 60:
                tally.error("the drivers did not stop in time")
                break
            time.sleep(0.2)
        wall = time.monotonic() - t0
        health = wait_quiet(base)
        rss_end = rss_mb(proc.pid)
        rss.append((time.monotonic() - t0, rss_end))
    rss_warm = rss_warm or rss[0][1]
    return {
        "minutes": minutes, "duration_s": round(wall, 1), "users_per_race": users,
        "api_streams": streams, "dtype": dtype,
        "requests": tally.requests, "served": tally.served, "cancelled": tally.cancelled,
        "bad_requests": tally.bad_requests, "errors": tally.errors,
        "error_samples": tally.error_samples,
        "races": tally.races, "races_stopped": tally.races_stopped,
        "ttft_p50_s": _seconds(percentile(tally.ttfts, 50)),
        "ttft_p99_s": _seconds(percentile(tally.ttfts, 99)),
        "kv_blocks_held_at_end": health.get("kv_blocks_used"),
        "kv_blocks_total": health.get("kv_blocks_total"),
        "rss_start_mb": round(rss[0][1], 1), "rss_warm_mb": round(rss_warm, 1),
        "rss_end_mb": round(rss_end, 1),
        "rss_growth_after_warmup_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        "rss_mb_series": [[round(t, 1), round(m, 1)] for t, m in rss],
    }


def _seconds(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def format_report(doc: dict[str, Any]) -> str:
    """The figures as a few lines of text."""
    return "\n".join([
        f"soak: {doc['duration_s']:.0f} s against batchlens serve on {HOST} ({doc['dtype']})",
        f"requests: {doc['requests']} (served {doc['served']}, cancelled {doc['cancelled']}, "
        f"bad requests refused {doc['bad_requests']}); races: {doc['races']} "
        f"({doc['races_stopped']} stopped mid-way)",
        f"errors: {doc['errors']}" + "".join(f"\n  {m}" for m in doc["error_samples"]),
        f"TTFT p50 {_s(doc['ttft_p50_s'])}, p99 {_s(doc['ttft_p99_s'])}",
        f"KV blocks held at the end: {doc['kv_blocks_held_at_end']} of "
        f"{doc['kv_blocks_total']}",
        f"server RSS: {doc['rss_start_mb']:.0f} MiB at start, {doc['rss_warm_mb']:.0f} after "
        f"warm-up, {doc['rss_end_mb']:.0f} at the end "
        f"({doc['rss_growth_after_warmup_pct']:+.1f}% after warm-up)",
    ])


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, required=True, help="how long to send traffic")
    ap.add_argument("--json", type=Path, help="write the figures to this file")
    ap.add_argument("--users", type=int, default=8, help="users per race (default 8)")
    ap.add_argument("--streams", type=int, default=6,
                    help="concurrent API clients (default 6)")
    ap.add_argument("--dtype", choices=DTYPES, default="auto", help="the server's dtype")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the soak, print its figures; exit 1 on any error or a held block."""
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    if not 0 < a.minutes <= 24 * 60:
        ap.error("--minutes must be > 0 and at most a day")
    if not 1 <= a.users <= 256 or not 1 <= a.streams <= 256:
        ap.error("--users and --streams must be in [1, 256]")
    try:
        doc = soak(a.minutes, a.users, a.streams, a.dtype, a.seed)
    except RuntimeError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    print(format_report(doc))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))
    return 0 if doc["errors"] == 0 and doc["kv_blocks_held_at_end"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
