"""Per-API-key rate limits: requests per minute and tokens per minute, over a sliding
60-second window, answered as OpenAI answers them (429, `rate_limit_error`, `Retry-After`).

    limits = RateLimiter(requests_per_minute=60, tokens_per_minute=20_000)
    charge = limits.admit(key, tokens=prompt_tokens + max_tokens)   # or APIError 429
    ...                                                               # the request runs
    charge.settle(prompt_tokens + completion_tokens)                  # what it really used

A request is charged at admission with the most it can use (its prompt and its
`max_tokens`), so a burst of admissions cannot overrun the budget, and settled to what it
used when it ends (a short answer or a cancel gives the rest back). `Retry-After` is the
time until enough of the window's oldest charges age out for the refused request to pass.
A request whose own tokens exceed the per-minute budget can never pass: its 429 says so and
carries no `Retry-After`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from server.errors import APIError

WINDOW_S = 60.0
SWEEP_S = 60.0  # how often keys with an empty window are forgotten


@dataclass
class Charge:
    """One admitted request's entry in its key's window."""

    time: float
    tokens: int

    def settle(self, tokens: int) -> None:
        """Replace the admission's estimate with the tokens the request really used."""
        self.tokens = max(0, min(self.tokens, tokens))


class RateLimiter:
    """Requests and tokens per minute, per key (None for either: no limit on it).
    Thread-safe; `clock` is `time.monotonic` (a test may pass its own)."""

    def __init__(self, requests_per_minute: int | None = None,
                 tokens_per_minute: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("requests_per_minute", requests_per_minute),
                            ("tokens_per_minute", tokens_per_minute)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self._windows: dict[str, deque[Charge]] = {}
        self._lock = threading.Lock()
        self._last_sweep = clock()

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def admit(self, key: str, tokens: int, who: str = "this API key") -> Charge:
        """Charge one request of up to `tokens` tokens to `key`, or raise `APIError` 429
        naming the limit (`who` names the key in the message, never the key itself)."""
        rpm, tpm = self.requests_per_minute, self.tokens_per_minute
        if tpm is not None and tokens > tpm:
            raise APIError(429, f"rate limit: this request may use {tokens} tokens (prompt "
                           f"and max_tokens), more than the {tpm} tokens per minute {who} "
                           "is allowed; lower max_tokens or shorten the prompt",
                           code="rate_limit_exceeded")
        with self._lock:
            now = self.clock()
            self._sweep(now)
            window = self._windows.setdefault(key, deque())
            while window and window[0].time <= now - WINDOW_S:
                window.popleft()
            if rpm is not None and len(window) >= rpm:
                wait = window[len(window) - rpm].time + WINDOW_S - now
                raise APIError(429, f"rate limit: {who} sent {len(window)} requests in the "
                               f"last minute (limit {rpm} per minute)",
                               code="rate_limit_exceeded", retry_after=wait)
            used = sum(c.tokens for c in window)
            if tpm is not None and used + tokens > tpm:
                wait, freed = 0.0, 0
                for c in window:  # oldest first: when does enough of the window age out
                    freed += c.tokens
                    wait = c.time + WINDOW_S - now
                    if used - freed + tokens <= tpm:
                        break
                raise APIError(429, f"rate limit: {who} used {used} of its {tpm} tokens per "
                               f"minute; this request may use {tokens} more",
                               code="rate_limit_exceeded", retry_after=wait)
            charge = Charge(now, tokens)
            window.append(charge)
            return charge

    def _sweep(self, now: float) -> None:
        """Forget keys whose window is empty (called under the lock)."""
        if now - self._last_sweep < SWEEP_S:
            return
        self._last_sweep = now
        for key in [k for k, w in self._windows.items()
                    if not w or w[-1].time <= now - WINDOW_S]:
            del self._windows[key]
