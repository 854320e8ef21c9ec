"""Speculative decoding bench: the "edit a paragraph" scenario with and without n-gram
speculation, at 1, 32 and 64 users.

    batchlens bench speculative [--users 1,32,64] [--repeat N] [--json PATH] [--dtype ...]

Each (users, speculation) pair runs once on an engine of its own (`workloads.speculative.
run_edit`): every one of the 8 paragraphs is edited at least once, `users` requests at a
time sent at one moment (1 user: the 8 one after another), greedy, EOS honoured, so with
and without speculation the answers should be the same tokens (compared and reported).
Prints tokens/s per user (median over requests of output tokens / E2E), total tokens/s,
acceptance rate and mean accepted length (tokens per verification step, the sampled one
included), and the gain per user. With `--repeat N` each pair runs N times, off and on in
turn, and the fastest of each counts (other processes may share the cores: their CPU use
during each run is reported, and every attempt is kept in the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from engine.models.loaded import LoadedModel
from workloads.cpu_load import cpu_sample, others_busy
from workloads.speculative import SCENARIO, SpecRun, run_edit, speedup

PROG = "batchlens bench speculative"
DEFAULT_USERS = (1, 32, 64)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--users", default=",".join(map(str, DEFAULT_USERS)),
                    help="comma-separated user counts (default: %(default)s)")
    ap.add_argument("--model", help="local HF folder or .gguf (default: the bundled model)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, help="torch.set_num_threads")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each pair, off and on in turn; the fastest counts "
                    "(default: %(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return ap


def parse_users(text: str) -> list[int]:
    """"1,32,64" -> [1, 32, 64]; `ValueError` naming the flag otherwise."""
    try:
        users = [int(u) for u in text.split(",")]
    except ValueError:
        raise ValueError(f"--users: expected numbers like 1,32,64, got {text!r}") from None
    if min(users) < 1:
        raise ValueError(f"--users: every count must be >= 1, got {text!r}")
    return users


def _rate(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(runs: list[SpecRun]) -> str:
    """One row per run, then the gain per user at each user count."""
    lines = [f"{'users':>5} {'speculation':>11} {'tok/s/user':>11} {'total tok/s':>12} "
             f"{'accepted':>9} {'mean len':>9} {'tokens':>7} {'same':>5}"]
    for r in runs:
        off = next((o for o in runs if o.users == r.users and not o.speculative), None)
        same = "" if not r.speculative or off is None else (
            "yes" if r.answers == off.answers else "no")
        lines.append(f"{r.users:>5} {'on' if r.speculative else 'off':>11} "
                     f"{r.tokens_per_s_per_user:>11.1f} {r.total_tokens_per_s:>12.1f} "
                     f"{_rate(r.acceptance_rate, '.0%'):>9} "
                     f"{_rate(r.mean_accepted_length, '.2f'):>9} {r.output_tokens:>7} "
                     f"{same:>5}")
    for users in dict.fromkeys(r.users for r in runs):
        gain = speedup(runs, users)
        if gain is not None:
            lines.append(f"{users} user{'s' if users > 1 else ''}: speculation gives "
                         f"{gain:.2f}x the tokens/s per user")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Load the model once, run every (users, speculation) pair, print, optionally save."""
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    try:
        users = parse_users(a.users)
    except ValueError as exc:
        ap.error(str(exc))
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    if a.threads is not None:
        if a.threads < 1:
            ap.error("--threads must be >= 1")
        torch.set_num_threads(a.threads)
    print("loading model ...", file=sys.stderr, flush=True)
    loaded = LoadedModel.load(a.model, a.device, a.dtype)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    info: dict[str, Any] = {"scenario": SCENARIO, "model": loaded.name,
                            "device": str(loaded.model.device), "dtype": dtype,
                            "threads": torch.get_num_threads(), "num_speculative_tokens": 4,
                            "prompt_lookup": [2, 4]}
    print(f"{SCENARIO}: model {loaded.name} on {loaded.model.device}, {dtype}, "
          f"{torch.get_num_threads()} threads; n-gram speculation: 4 drafts, lookup 2-4")
    info["repeat"] = a.repeat
    best: dict[tuple[int, bool], tuple[SpecRun, dict[str, Any]]] = {}
    attempts: list[dict[str, Any]] = []
    for n in users:
        for _ in range(a.repeat):
            for speculative in (False, True):
                print(f"run: {n} users, speculation {'on' if speculative else 'off'} ...",
                      file=sys.stderr, flush=True)
                t, cpu0 = time.monotonic(), cpu_sample()
                run = run_edit(loaded, n, speculative)
                assert run is not None  # nothing stops it
                row = {**run.as_dict(), "others_cpu": others_busy(cpu0, cpu_sample()),
                       "seconds": time.monotonic() - t}
                attempts.append(row)
                key = (n, speculative)
                if key not in best or run.wall_s < best[key][0].wall_s:
                    best[key] = (run, row)
                if a.json:
                    _save(a.json, info, list(best.values()), attempts)
    runs = [run for run, _ in best.values()]
    print("\n" + table(runs))
    print("others' CPU use in the runs shown: " + ", ".join(
        f"{row['others_cpu']:.0%}" for _, row in best.values()))
    return 0


def _save(path: str, info: dict[str, Any], best: list[tuple[SpecRun, dict[str, Any]]],
          attempts: list[dict[str, Any]]) -> None:
    """The figures so far (written after every run, so a killed bench keeps them): the
    fastest run of each pair, the gain per user, and every attempt."""
    runs = [run for run, _ in best]
    rows = []
    for run, row in best:
        off = next((o for o in runs if o.users == run.users and not o.speculative), None)
        same = (run.answers == off.answers) if run.speculative and off else None
        rows.append({**row, "same_answers_as_off": same})
    gains = {str(u): speedup(runs, u) for u in dict.fromkeys(r.users for r in runs)}
    with open(path, "w") as f:
        json.dump({**info, "runs": rows, "speedup_per_user": gains, "attempts": attempts},
                  f, indent=2)
