"""Datacenter tokens/s of a 16-user x 64-token race: the arena page's own figure (the app
served by `streamlit run`, driven by Chromium on the same machine) against the same race
run headless (`python -m workloads.race`). Rounds alternate page, headless, page, ...; prints
each round's page/headless ratio, their median, and best page / best headless.

Usage: .venv/bin/python scripts/page_open_throughput.py [--rounds 3] [--browser-nice 19]

On a hosted instance the viewer's browser runs on the viewer's machine. Here it shares the
server's two cores; `--browser-nice 19` is the closest this one machine gets to a remote
browser: Chromium runs under `nice -n 19` *and* its autogroup is set to nice 19. The
second part matters: Playwright starts Chromium in a session of its own, and with the
kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled) each session
gets a fair share of the CPU whatever its processes' nice values, so plain `nice` left
Chromium at ~20% of the CPU during a race. The server (page refreshes and engine) always
runs at normal priority.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from playwright.sync_api import sync_playwright  # noqa: E402
from test_browser import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_ARGS,
    click_run,
    free_port,
    set_up_race,
    total_tokens_per_s,
    wait_for_summary,
)

PROMPT = "Explain why the sky is blue."


def headless() -> float:
    out = subprocess.run(
        [sys.executable, "-m", "workloads.race", "--users", "16", "--max-tokens", "64",
         "--prompt", PROMPT], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"datacenter: \d+ tokens, ([\d.]+) tokens/s", out).group(1))


def open_arena(page, url: str) -> None:
    page.goto(url)
    page.get_by_label("Your prompt").wait_for()
    page.get_by_text("the same prompt", exact=True).click()


def browser_path(nice: int, folder: str) -> str:
    """Chromium itself, or a wrapper that sets its autogroup's nice (where the kernel has
    autogroups) and starts it under `nice -n <nice>`."""
    if nice == 0:
        return CHROMIUM
    wrapper = Path(folder) / "chromium-nice"
    wrapper.write_text(f"#!/bin/sh\n[ -w /proc/self/autogroup ] && echo {nice} > /proc/self/autogroup\n"
                       f'exec nice -n {nice} {CHROMIUM} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="page/headless pairs (default 2)")
    ap.add_argument("--browser-nice", type=int, default=0, choices=range(20), metavar="0-19",
                    help="run Chromium at nice N, its autogroup too (default 0: same priority)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
         "--server.fileWatcherType", "none", "--server.port", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://localhost:{port}"
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    results: dict[str, list[float]] = {"page": [], "headless": []}
    tmp = tempfile.TemporaryDirectory()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path(a.browser_nice, tmp.name),
                                        args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
            page.set_default_timeout(300_000)
            for _ in range(a.rounds):
                open_arena(page, url)
                set_up_race(page, PROMPT, 16, 64)
                click_run(page)
                page.locator(".st-key-summary").wait_for(state="detached")
                wait_for_summary(page)
                results["page"].append(total_tokens_per_s(page, "datacenter"))
                print(f"page: datacenter {results['page'][-1]} tok/s, "
                      f"local {total_tokens_per_s(page, 'local')} tok/s", flush=True)
                page.goto("about:blank")  # the page is closed while headless runs
                results["headless"].append(headless())
                print(f"headless: datacenter {results['headless'][-1]} tok/s; this round "
                      f"page/headless = {results['page'][-1] / results['headless'][-1]:.0%}",
                      flush=True)
            browser.close()
    finally:
        server.terminate()
        tmp.cleanup()
    ratios = [p / h for p, h in zip(results["page"], results["headless"], strict=True)]
    best_page, best_headless = max(results["page"]), max(results["headless"])
    print(f"Chromium nice {a.browser_nice}, {os.cpu_count()} CPUs: median round page/headless "
          f"= {statistics.median(ratios):.0%}; best page / best headless = "
          f"{best_page / best_headless:.0%}")


if __name__ == "__main__":
    main()
