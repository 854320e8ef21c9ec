"""Helpers for the AppTest tests: the app on its default page, and run-until loops.

AppTest never fires `run_every` fragments, so a test reruns the whole app in a loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "dashboard.py")  # app.py serves it


def new_app(timeout: float = 120, secrets: dict | None = None) -> AppTest:
    """The app, run once, on its default page (arena).

    Work-around: AppTest 1.67 reruns a multipage app with the finished page's hash and
    then drops the entrypoint's elements (title, sidebar, status strip) from its tree,
    although a real browser keeps them. Requesting the default page ("") on every rerun
    keeps the whole app in view, as a browser shows it.
    """
    at = AppTest.from_file(APP, default_timeout=timeout)
    at.secrets.update(secrets or {})
    run = at._run

    def run_whole_app(*args, **kwargs):
        if not at._page_hash:
            at._finished_page_script_hash = ""
        return run(*args, **kwargs)

    at._run = run_whole_app
    return at.run()


def run_until(at: AppTest, done: Callable[[AppTest], bool], timeout: float = 180.0,
              pause: float = 0.3) -> AppTest:
    """Rerun the app (as the page's refresh would) until `done(at)`."""
    end = time.monotonic() + timeout
    while not done(at):
        assert not at.exception, at.exception
        assert time.monotonic() < end, "timed out waiting on the app"
        time.sleep(pause)
        at.run()
    return at


def keyed(at: AppTest, key: str):
    """The block of `st.container(key=...)`, searched depth-first."""
    stack = [at.main]
    while stack:
        node = stack.pop()
        if getattr(node, "key", None) == key:
            return node
        stack.extend(getattr(node, "children", {}).values())
    raise AssertionError(f"no container with key {key!r}")


def pick(at: AppTest, **picks) -> AppTest:
    """Set the main area's widgets (by key) to `picks` and rerun."""
    for key, value in picks.items():
        widget = next(w for w in at.main if getattr(w, "key", None) == key)
        widget.set_value(value)
    at.run()
    assert not at.exception, at.exception
    return at


def metric(at: AppTest, label: str) -> str:
    """The value of the metric labelled `label`."""
    return next(m.value for m in at.metric if m.label == label)


def metrics(at: AppTest, side: str) -> dict[str, str]:
    """The metric values shown in one side's column ("local" or "datacenter")."""
    return {m.label: m.value for m in keyed(at, f"side-{side}").metric}


def wait_idle(engine, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while engine.stats().num_running + engine.stats().num_waiting:
        assert time.monotonic() < end, "engine still busy"
        time.sleep(0.05)
