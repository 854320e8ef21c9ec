"""Presenter mode: a page that is the demo on a 1280x720 projector. One plain header line
(what runs where; the engineering details in its tooltip), the engine settings and each
page's settings form hidden, the five scripted scenarios one click (or one clicker key,
ui/clicker.py) away, and a large headline per side of a race.

On with the sidebar toggle or `?presenter=1` in the URL; it stays on for the browser
session across pages (and the URL keeps the parameter, so a reload keeps it too). Off, the
pages get `FIT_CSS` instead: rows of figures that wrap on a narrow screen.

On a shared instance visitors may use it: it is this session's view only. Hiding the
settings panel hides it from this session, not from anyone else, and changes no setting
(on a shared instance the settings are the admin's anyway, see ui/hosting.py); the
scripted scenarios are runs like any other, under the same one-run-per-session rule and
the admin's caps.
"""

from __future__ import annotations

import streamlit as st

KEY = "presenter"
QUERY = "presenter"
ON_VALUES = ("1", "true", "on", "yes")
KEY_KV_START = "kv_autostart"  # the KV cache page starts this scenario when it opens
SCENARIOS = ("one_user", "many_users", "shared_prefix", "laptop_70b",  # one button each
             "edit_paragraph")

# Sized for a 1280x720 projector: the scenario buttons and both sides of a race on the
# first screen. Metric values never wrap (each must fit its column); a side's headline
# (containers keyed "headline-...") is the large figure, the other metrics are smaller.
CSS = """
<style>
html { font-size: 18px; }
[data-testid="stMainBlockContainer"] {
  padding: 3.4rem 2rem 3rem 2rem !important; max-width: none;
}
[data-testid="stMainBlockContainer"] [data-testid="stVerticalBlock"] { gap: 0.55rem; }
h1, h1 * { font-size: 2rem !important; }
h2, h2 * { font-size: 1.5rem !important; padding-top: 0 !important; padding-bottom: 0 !important; }
h3, h3 * { font-size: 1.25rem !important; padding-top: 0 !important; padding-bottom: 0 !important; }
[data-testid="stMetricValue"], [data-testid="stMetricValue"] * {
  font-size: 1.45rem !important; font-weight: 700; line-height: 1.25;
}
[class*="st-key-headline"] [data-testid="stMetricValue"],
[class*="st-key-headline"] [data-testid="stMetricValue"] * {
  font-size: 2.9rem !important; line-height: 1.1;
}
[data-testid="stMetricLabel"] p { font-size: 0.9rem; }
/* labels and button titles wrap instead of ending in "..."; metric values do not wrap */
[data-testid="stMetricLabel"], [data-testid="stMetricLabel"] *,
[data-testid="stBaseButton-primary"] *, [data-testid="stBaseButton-secondary"] * {
  white-space: normal !important; overflow: visible !important; text-overflow: clip !important;
  overflow-wrap: normal !important; word-break: normal !important;
}
[data-testid="stCode"] pre, [data-testid="stCode"] code { font-size: 0.95rem; }
[data-testid="stCaptionContainer"] { font-size: 0.9rem; }
.st-key-clicker { display: none; }
</style>
"""


# Normal mode, at any width: a row of figures too wide for its columns (beside the
# sidebar on a 1024 px tablet or projector) wraps a figure to the next line instead of
# cutting its value or label short. Only innermost columns holding a figure take the rule,
# so the arena's two sides stay side by side while the rows inside each side wrap.
FIT_CSS = """
<style>
[data-testid="stColumn"]:has([data-testid="stMetric"]):not(:has([data-testid="stHorizontalBlock"])) {
  min-width: min-content;
}
[data-testid="stMetric"] { min-width: max-content; }
</style>
"""


def sync_from_url() -> bool:
    """Read `?presenter=` once per run into the session; return whether the mode is on."""
    ss = st.session_state
    value = st.query_params.get(QUERY)
    if value is not None:
        ss[KEY] = value.strip().lower() in ON_VALUES
    elif ss.get(KEY):
        st.query_params[QUERY] = "1"  # page switches drop query parameters; put it back
    ss.setdefault(KEY, False)
    return bool(ss[KEY])


def is_on() -> bool:
    return bool(st.session_state.get(KEY))


def wanted() -> bool:
    """Whether this run will be in presenter mode, read without changing anything (for the
    page config and the navigation, which come before `sync_from_url`)."""
    value = st.query_params.get(QUERY)
    if value is not None:
        return value.strip().lower() in ON_VALUES
    return is_on()


def toggle() -> None:
    """The sidebar switch; the URL follows it so the mode survives a reload."""
    st.sidebar.toggle("Presenter mode", key=KEY, on_change=_follow_url,
                      help="Big text for a projector, settings hidden, scripted scenarios. "
                           "Also: add ?presenter=1 to the URL.")


def _follow_url() -> None:
    if st.session_state.get(KEY):
        st.query_params[QUERY] = "1"
    else:
        st.query_params.pop(QUERY, None)


def figure_height(px: int) -> int | str:
    """A chart's height: `px` in presenter mode (so the page's main figure fits the first
    screen of a 1280x720 projector), else the chart's own ("content")."""
    return px if is_on() else "content"


def metric_columns(n: int, per_row: int) -> list:
    """Columns for `n` figures: one row on a presenter's full-width screen; rows of
    `per_row` beside the sidebar, where n in a row cut a laptop screen's figures short."""
    if is_on():
        return st.columns(n)
    return [col for _ in range(-(-n // per_row)) for col in st.columns(per_row)][:n]


def apply_style() -> None:
    """Presenter mode: enlarge text and metrics; normal mode: let rows of figures wrap
    (call on every run)."""
    st.html(CSS if is_on() else FIT_CSS)
