"""Datacenter tokens/s of a 16-user x 64-token race: the arena page's own figure (the app
served by `streamlit run`, driven by Chromium on the same machine) against the same race
run headless (`python -m engine.race`). Two rounds, alternating; prints the best of each.

Usage: .venv/bin/python scripts/page_open_throughput.py   (needs /usr/bin/chromium)
"""

from __future__ import annotations

import re
import subprocess
import sys
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
        [sys.executable, "-m", "engine.race", "--users", "16", "--max-tokens", "64",
         "--prompt", PROMPT], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"datacenter: \d+ tokens, ([\d.]+) tokens/s", out).group(1))


def open_arena(page, url: str) -> None:
    page.goto(url)
    page.get_by_label("Your prompt").wait_for()
    page.get_by_text("the same prompt", exact=True).click()


def main() -> None:
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
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
            page.set_default_timeout(300_000)
            for _ in range(2):
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
                print(f"headless: datacenter {results['headless'][-1]} tok/s", flush=True)
            browser.close()
    finally:
        server.terminate()
    best_page, best_headless = max(results["page"]), max(results["headless"])
    print(f"best page / best headless = {best_page / best_headless:.0%}")


if __name__ == "__main__":
    main()
