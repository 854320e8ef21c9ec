"""Where presenter mode puts things on a projector's screen: start the dashboard, open each
page with `?presenter=1` in Chromium at 1280x720 and 1920x1080, start its scenario, and
print where the figures start (y px from the top of the page, scrolling included) and
which metric values overflow their boxes.

    PYTHONPATH=. python scripts/presenter_layout.py [--sizes 1280x720,1920x1080] [--end]

`--end` also measures the arena once its race has ended (every metric filled in). The
geometry is read from the DOM (tests/ui/page_geometry.py), as the browser tests read it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "ui"), str(ROOT / "tests")]

from conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from page_geometry import boxes, metric_values, overflows, scrolled  # noqa: E402
from test_browser import RACE_TIMEOUT_MS, streamlit_server  # noqa: E402

# (page, its link in the navigation, scenario button or None, what appears once it has
# begun, figures to place). Pages are opened from the navigation, as a presenter moves
# (and a page's own URL, opened before any session has run dashboard.py, runs that page
# alone: see docs/benchmarks.md).
VIEWS = (
    ("arena", "Arena", "32 users", ".st-key-side-local",
     {"local panel": ".st-key-side-local", "datacenter panel": ".st-key-side-datacenter",
      "local heading": ".st-key-side-local h3",
      "datacenter heading": ".st-key-side-datacenter h3",
      "local headline": ".st-key-headline-local",
      "datacenter headline": ".st-key-headline-datacenter"}),
    ("kv_cache", "KV cache", None, "[data-testid='stVegaLiteChart']",
     {"block map": "[data-testid='stColumn']:has(.st-key-kv-paged-caption) "
                   "[data-testid='stVegaLiteChart']",
      "first chart": "[data-testid='stVegaLiteChart']"}),
    ("sweep", "Sweep", None, "[data-testid='stVegaLiteChart']",
     {"first chart": "[data-testid='stVegaLiteChart']"}),
    ("hardware", "Hardware", None, "[data-testid='stVegaLiteChart']",
     {"first chart": "[data-testid='stVegaLiteChart']"}),
)


# a side's panel once its requests run: "Running..." outside presenter mode, a headline there
BEGUN_JS = r"""() => [...document.querySelectorAll('[class*="st-key-side-"]')].some(el =>
  /Running\.\.\.|had an answer after/.test(el.innerText))"""


def report(page, label: str, places: dict[str, str], shots: Path | None = None) -> None:
    found, down = boxes(page, places), scrolled(page)
    where = ", ".join(f"{name} y={box.top + down:.0f}" if box else f"{name} not shown"
                      for name, box in found.items())
    values = metric_values(page)
    bad = [why for m in values if (why := overflows(m))]
    print(f"{label}: {where}; {len(bad)} of {len(values)} metric values overflow")
    for why in bad:
        print(f"    {why}")
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shots / (label.replace(" ", "_").replace(",", "") + ".png")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1280x720,1920x1080")
    parser.add_argument("--end", action="store_true", help="also measure the ended race")
    parser.add_argument("--pages", default=",".join(v[0] for v in VIEWS))
    parser.add_argument("--shots", type=Path, help="a folder for a screenshot of each view")
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp, streamlit_server(Path(tmp)) as url, \
            sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for width, height in sizes:
            for name, link, button, started, places in VIEWS:
                if name not in args.pages.split(","):
                    continue
                page = browser.new_context(viewport={"width": width, "height": height}).new_page()
                page.set_default_timeout(400_000)
                page.goto(f"{url}/?presenter=1")
                page.get_by_role("button", name="One user", exact=True).wait_for()
                if name != "arena":
                    page.get_by_role("link", name=link, exact=True).click()
                page.locator(started).first.wait_for()
                if name == "arena":
                    page.get_by_role("button", name=button, exact=True).click()
                    page.wait_for_function(BEGUN_JS)
                    report(page, f"{width}x{height} {name}, race begun", places, args.shots)
                    if args.end:
                        page.locator(".st-key-summary").wait_for(timeout=RACE_TIMEOUT_MS)
                        report(page, f"{width}x{height} {name}, race ended", places, args.shots)
                else:
                    page.wait_for_timeout(2000)  # let the charts draw
                    report(page, f"{width}x{height} {name}", places, args.shots)
                page.context.close()
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
