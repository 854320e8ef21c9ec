"""A shared (hosted) instance: whether this server is one, and what its visitors may do.

    hosted  =  `hosted = true` in Streamlit secrets, or BATCHLENS_HOSTED=1, or a bind
               address other than loopback (Streamlit's `server.address`; this repository's
               .streamlit/config.toml binds localhost, so `make run` is a local instance)
    hosted  -> the engine settings are read-only unless the admin password is entered (with
               no `admin_password` configured they cannot be changed at all), and the
               browser never shows a traceback (`client.showErrorDetails = "none"`)
    always  -> one run (race, sweep or KV scenario) at a time per browser session, and the
               admin's caps from secrets: `max_race_users`, `max_race_tokens` (users x max
               tokens of one race or sweep point) and `max_waiting` (new runs are refused
               with "busy: N waiting" while that many requests wait: the API's 429 too)

Presenter mode is a per-session view (big text, this session's settings panel hidden): it
changes nothing shared, and its scripted scenarios are runs like any other, under the same
caps, so visitors may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import streamlit as st

from engine.serving import ServingSide, busy_message
from workloads.sides import count

LOOPBACK = ("localhost", "127.0.0.1", "::1")
ON = ("1", "true", "yes", "on")
DEFAULT_MAX_WAITING = 256  # as the API's default


def _secret(key: str) -> Any:
    """A value from Streamlit secrets, or None (no secrets file, or no such key)."""
    try:
        return st.secrets.get(key)
    except Exception:  # no secrets file at all
        return None


def is_hosted() -> bool:
    """Whether this server is a shared instance (see the module's notes)."""
    if os.environ.get("BATCHLENS_HOSTED", "").strip().lower() in ON:
        return True
    if str(_secret("hosted") or "").strip().lower() in ON:
        return True
    address = st.get_option("server.address")
    return not address or not (address in LOOPBACK or address.startswith("127."))


def admin_password() -> str | None:
    """The admin password from Streamlit secrets, or None when none is set."""
    value = _secret("admin_password")
    return str(value) if value else None


_CONFIGURED_ERRORS = st.get_option("client.showErrorDetails")  # before any change below


def protect_errors() -> None:
    """On a shared instance, uncaught exceptions show the browser a generic line only (the
    type, message and traceback go to the server's log); elsewhere, what config says."""
    want = "none" if is_hosted() else _CONFIGURED_ERRORS
    if st.get_option("client.showErrorDetails") != want:
        st.set_option("client.showErrorDetails", want)


@dataclass(frozen=True)
class Caps:
    """What one run may ask of a shared instance; None: no cap."""

    max_users: int | None = None  # users of one race (requests of one sweep point)
    max_tokens: int | None = None  # users x max tokens of one race (or sweep point)
    max_waiting: int = DEFAULT_MAX_WAITING  # refuse new runs while this many requests wait

    def check(self, users: int, max_tokens: int, what: str = "race") -> None:
        """`ValueError` naming the cap a run of `users` x `max_tokens` goes over."""
        if self.max_users is not None and users > self.max_users:
            raise ValueError(f"users: this instance allows at most "
                             f"{count(self.max_users, 'user')} per {what}, got {users:,}")
        total = users * max_tokens
        if self.max_tokens is not None and total > self.max_tokens:
            raise ValueError(f"users x max tokens: {count(users, 'user')} x {max_tokens:,} "
                             f"= {total:,} tokens, over this instance's cap of "
                             f"{self.max_tokens:,} per {what}; lower either")

    def check_queue(self, engine: ServingSide) -> None:
        """`ValueError` "busy: N waiting" while the engine's queue is at its cap."""
        waiting = engine.stats(steps_after=None).num_waiting
        if waiting >= self.max_waiting:
            raise ValueError(f"{busy_message(waiting)}; try again in a moment")


def _cap(key: str, default: int | None, low: int = 1) -> int | None:
    value = _secret(key)
    if value is None or value == "":
        return default
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"secrets {key} must be a whole number, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"secrets {key} must be a whole number, got {value!r}") from None
    if number < low:
        raise ValueError(f"secrets {key} must be >= {low}, got {number}")
    return number


def caps() -> Caps:
    """The admin's caps from Streamlit secrets (BATCHLENS_MAX_WAITING, as for the API,
    overrides `max_waiting`); `ValueError` naming a key that is not a whole number."""
    env = os.environ.get("BATCHLENS_MAX_WAITING", "").strip()
    waiting = int(env) if env.isdigit() else _cap("max_waiting", DEFAULT_MAX_WAITING, 0)
    return Caps(_cap("max_race_users", None), _cap("max_race_tokens", None),
                DEFAULT_MAX_WAITING if waiting is None else waiting)
