"""The `batchlens` command: one entry for everything that runs from a terminal.

    batchlens bench [...]            the engine against transformers and the local PC
    batchlens bench --host-overhead  host time per engine step around a stand-in model
    batchlens bench api [...]        the same requests over the API and in-process
    batchlens bench serve [...]      a load generator for any OpenAI-compatible server
    batchlens bench speculative [...]  speculative decoding on and off, 1 to 64 users
    batchlens bench parallel [...]   n candidates per request against n separate requests
    batchlens sweep [...]            the load sweep: 1 to 64 users on both sides
    batchlens scenario [NAME] [...]  a scripted scenario with prefix caching on, then off
    batchlens race [...]             one race, headless: the arena page's numbers
    batchlens soak --minutes N       races and API streams against a local server for N min
    batchlens fleet [...]            a day of a service: replicas, router, autoscaler (simulated)
    batchlens fleet check            that simulation against the live engine, side by side

Each command's module is imported only when it runs, so `batchlens --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module with `main(argv, prog)`, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("measure.bench.cli",
              "the engine against transformers and the local PC on one request mix "
              "(`bench api`: over the API vs in-process; `bench serve`: load any "
              "OpenAI-compatible server; `bench speculative` (alias `spec`): speculative "
              "decoding on and off; `bench parallel`: n candidates per request against "
              "n separate requests; "
              "`bench --host-overhead`: the engine loop's own cost per step)"),
    "sweep": ("workloads.sweep", "the load sweep: throughput and latency from 1 to 64 users"),
    "scenario": ("workloads.scenarios",
                 "a scripted scenario, with prefix caching on and then off"),
    "race": ("workloads.race", "one race headless: the same prompts on both sides"),
    "serve": ("server.cli", "the OpenAI-compatible API alone, without the dashboard"),
    "soak": ("measure.soak", "minutes of races and API streams against a server on "
             "127.0.0.1: errors, TTFT, KV blocks held at the end, server RSS"),
    "fleet": ("fleet.cli", "a day of a service on a simulated clock: replicas, a router and "
              "an autoscaler (`fleet check`: against the live engine)"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="batchlens", description="Why LLM inference is slow on a local PC and fast in "
        "a datacenter. The dashboard itself starts with `make run`.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command; its own `--help` lists its flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        ap.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        ap.error(f"unknown command {name!r} (choose from {', '.join(COMMANDS)})")
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest, prog=f"batchlens {name}") or 0)


if __name__ == "__main__":
    sys.exit(main())
