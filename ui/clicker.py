"""The presenter's clicker: PageDown or the right arrow starts the next scenario of the page,
PageUp or the left arrow the previous one (presenter remotes send these keys).

A small script in the page (a custom component, st.components.v2, which runs in the page
itself, not in an iframe) listens for the keys and sends "next" or "previous" to the
script as a trigger; `step()` reads it and `pick()` says which scenario that is. Keys typed
into a text field, a select or a slider are left alone.
"""

from __future__ import annotations

import streamlit as st

KEY = "presenter_clicker"
NEXT, PREVIOUS = "next", "previous"
HINT = "Clicker: PageDown or → starts the next scenario, PageUp or ← the previous one."

JS = """
export default function (component) {
  const { setTriggerValue } = component;
  const keys = { PageDown: "next", ArrowRight: "next", PageUp: "previous",
                 ArrowLeft: "previous" };
  const typing = (el) => el && (el.isContentEditable ||
    ["INPUT", "TEXTAREA", "SELECT"].includes(el.tagName) ||
    el.getAttribute("role") === "slider");
  const onKey = (event) => {
    const step = keys[event.key];
    if (!step || event.altKey || event.ctrlKey || event.metaKey || event.shiftKey) return;
    if (typing(document.activeElement)) return;
    event.preventDefault();
    setTriggerValue("step", step);
  };
  document.addEventListener("keydown", onKey);
  return () => document.removeEventListener("keydown", onKey);
}
"""

_component = st.components.v2.component("batchlens_clicker", js=JS)


def step() -> str | None:
    """Mount the key listener (once per run, in the main script so a key reruns the page);
    "next" or "previous" on the run a key press triggered, else None."""
    with st.container(key="clicker"):
        result = _component(key=KEY, on_step_change=lambda: None, height=0)
    value = getattr(result, "step", None)
    return value if value in (NEXT, PREVIOUS) else None


def pick(options: list[str] | tuple[str, ...], current: str | None,
         direction: str | None) -> str | None:
    """The option a clicker step leads to from `current`: the next or previous one, the
    first when none was played yet ("next"), None past either end or without a step."""
    if direction is None or not options:
        return None
    if current not in options:
        return options[0] if direction == NEXT else None
    i = options.index(current) + (1 if direction == NEXT else -1)
    return options[i] if 0 <= i < len(options) else None
