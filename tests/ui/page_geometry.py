"""DOM geometry of a page in a real browser: does a figure lie inside the viewport, and does
every metric value fit its box on one line? No pixels are compared and nothing is timed:
each check reads `getBoundingClientRect()` and the text's line boxes at one moment.

    boxes(page, {"heading": ".st-key-side-local h3"})    -> {"heading": Box(...)}
    outside_viewport(page, [".st-key-side-local h3"])    -> what is not fully on screen
    overflowing_metrics(page)                             -> every stMetricValue too wide or
                                                             wrapped, with its text and sizes
    cut_labels(page)                                      -> every stMetricLabel cut short
    assert_fits(page, selectors)                          -> both, as one assertion

A presenter view of a page is one `PresenterView` row (tests/ui/test_browser_presenter.py
runs every row at each projector size).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# Every stMetricValue: its box, the union of its text's line boxes, and how many lines the
# text takes (line boxes at distinct heights). The text's own boxes are measured, not the
# element's, because a clipped or overflowing value keeps its box the column's width.
METRICS_JS = """
() => [...document.querySelectorAll('[data-testid="stMetricValue"]')].map(el => {
  const box = el.getBoundingClientRect();
  const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  const rects = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const range = document.createRange();
    range.selectNodeContents(n);
    rects.push(...[...range.getClientRects()].filter(r => r.width > 0 && r.height > 0));
  }
  const lines = [];
  for (const r of rects) {
    if (!lines.some(top => Math.abs(top - r.top) < r.height / 2)) lines.push(r.top);
  }
  const left = Math.min(...rects.map(r => r.left)), right = Math.max(...rects.map(r => r.right));
  return {text: el.innerText.trim(), boxLeft: box.left, boxRight: box.right,
          textLeft: rects.length ? left : box.left, textRight: rects.length ? right : box.left,
          lines: lines.length, scrollWidth: el.scrollWidth, clientWidth: el.clientWidth,
          visible: box.width > 0 && box.height > 0};
})
"""

# Every shown stMetricLabel's text (its markdown box): a label too long for its column is
# cut with an ellipsis, so that box scrolls (scrollWidth past clientWidth) without wrapping.
LABELS_JS = """
() => [...document.querySelectorAll(
    '[data-testid="stMetricLabel"] [data-testid="stMarkdownContainer"]')].filter(el => {
  const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0;
}).map(el => ({text: el.innerText.trim(), scrollWidth: el.scrollWidth,
               clientWidth: el.clientWidth}))
"""

BOXES_JS = """
(selectors) => Object.fromEntries(Object.entries(selectors).map(([name, sel]) => {
  const found = [...document.querySelectorAll(sel)].filter(el => {
    const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; });
  const r = found.length ? found[0].getBoundingClientRect() : null;
  return [name, r && {top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                      count: found.length}];
}))
"""

# How far the page is scrolled: Streamlit scrolls a container inside the page, so every
# scrolled ancestor of the main block counts, not only the window.
SCROLL_JS = """
() => { let el = document.querySelector('[data-testid="stMainBlockContainer"]'), y = 0;
  for (; el; el = el.parentElement) y += el.scrollTop || 0;
  return y + (window.scrollY || 0); }
"""

SLACK_PX = 1.0  # sub-pixel rounding of text boxes


@dataclass(frozen=True)
class Box:
    """An element's box in CSS pixels, relative to the viewport; `count`: visible matches."""

    top: float
    bottom: float
    left: float
    right: float
    count: int = 1


@dataclass(frozen=True)
class PresenterView:
    """One page's presenter view: open the dashboard with `?presenter=1`, follow the
    navigation link `link` (as a presenter moves between pages), press the button named
    `scenario` (None: the page has none), wait for `started` (a Playwright selector that
    matches once the scenario has begun), then every CSS selector in `above_fold` must lie
    inside the viewport and no metric value may overflow its box."""

    name: str
    link: str
    scenario: str | None
    started: str
    above_fold: tuple[str, ...]
    stop: str | None = None  # the button that ends the scenario, once measured
    # what the README's screenshot waits for past `started` (None: nothing): a sweep's
    # image shows its finished points, not the empty charts of its first second
    shot_when: str | None = None


def scrolled(page) -> float:
    """How far the page is scrolled down, in CSS pixels (0: its first screen)."""
    return float(page.evaluate(SCROLL_JS))


def viewport(page) -> tuple[int, int]:
    size = page.viewport_size
    return size["width"], size["height"]


def boxes(page, selectors: dict[str, str]) -> dict[str, Box | None]:
    """The first visible element of each selector's box (None where none is visible)."""
    found = page.evaluate(BOXES_JS, selectors)
    return {name: Box(**b) if b else None for name, b in found.items()}


def outside_viewport(page, selectors: list[str] | tuple[str, ...]) -> list[str]:
    """Each selector whose first visible element is missing or not wholly on screen, with
    its box: [] when every one lies inside the viewport."""
    width, height = viewport(page)
    out = []
    for sel, box in boxes(page, {s: s for s in selectors}).items():
        if box is None:
            out.append(f"{sel}: not shown")
        elif (box.top < -SLACK_PX or box.left < -SLACK_PX or box.bottom > height + SLACK_PX
              or box.right > width + SLACK_PX):
            out.append(f"{sel}: top {box.top:.0f} bottom {box.bottom:.0f} left {box.left:.0f} "
                       f"right {box.right:.0f} (viewport {width}x{height})")
    return out


def metric_values(page) -> list[dict]:
    """Every shown stMetricValue: text, box and text extents, lines."""
    return [m for m in page.evaluate(METRICS_JS) if m["visible"]]


def overflows(metric: dict) -> str | None:
    """Why a metric value does not fit (wider than its box, or wrapped), or None."""
    if metric["lines"] > 1:
        return f"{metric['text']!r} wraps onto {metric['lines']} lines"
    if (metric["textRight"] > metric["boxRight"] + SLACK_PX
            or metric["textLeft"] < metric["boxLeft"] - SLACK_PX
            or metric["scrollWidth"] > metric["clientWidth"] + SLACK_PX):
        return (f"{metric['text']!r} is {metric['textRight'] - metric['textLeft']:.0f} px "
                f"wide in a {metric['boxRight'] - metric['boxLeft']:.0f} px box")
    return None


def overflowing_metrics(page) -> list[str]:
    """Every metric value wider than its box or wrapped, in words ([] when all fit)."""
    return [why for m in metric_values(page) if (why := overflows(m))]


def cut_labels(page) -> list[str]:
    """Every shown metric label that Streamlit cuts short with an ellipsis (its text wider
    than its box), in words ([] when all fit)."""
    return [f"label {m['text']!r} is {m['scrollWidth']} px wide in a {m['clientWidth']} px box"
            for m in page.evaluate(LABELS_JS) if m["scrollWidth"] > m["clientWidth"] + SLACK_PX]


def misfits(page, selectors: list[str] | tuple[str, ...]) -> list[str]:
    """What is off the first screen among `selectors` (the page scrolled counts: the
    audience must see it without scrolling), and every metric value that overflows."""
    down = scrolled(page)
    moved = [f"the page is scrolled down {down:.0f} px"] if down > SLACK_PX else []
    return moved + outside_viewport(page, selectors) + overflowing_metrics(page)


def assert_fits(page, selectors: list[str] | tuple[str, ...]) -> None:
    problems = misfits(page, selectors)
    assert not problems, f"at {viewport(page)}: {problems}"


def cut_figures(page, settle_s: float = 15.0) -> list[str]:
    """Every metric value or label cut short, once the page has settled: a page's style
    blocks (st.html) can land a moment after its figures on a loaded machine, so the
    check is made again until it passes or `settle_s` is up ([] when all fit)."""
    end = time.monotonic() + settle_s
    while (problems := overflowing_metrics(page) + cut_labels(page)) and \
            time.monotonic() < end:
        page.wait_for_timeout(250)
    return problems
