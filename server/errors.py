"""API errors as OpenAI clients expect them: an HTTP status and the body
`{"error": {"message", "type", "param", "code"}}`; a 429 carries `Retry-After`."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Sequence
from typing import Any

from engine.serving import busy_message

_SHOWN = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 2, 60, 60
_SHOWN.maxlist = _SHOWN.maxdict = 4

# status -> the OpenAI error type a client sees for it
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the API answers with. `param` names the request field at fault (None when
    no single field is); `type` defaults from the status; `code` is a short machine-readable
    reason such as "model_not_found" (None when the status says enough); `retry_after`:
    seconds a client should wait before trying again (sent as the `Retry-After` header);
    `allow`: the methods a 405's route takes (the `Allow` header)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, code: str | None = None,
                 retry_after: float | None = None, allow: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.code = code
        self.retry_after = retry_after
        self.allow = tuple(allow)

    @property
    def headers(self) -> dict[str, str]:
        """The response headers this error adds: `Retry-After` in whole seconds (>= 1),
        `Allow` for a 405."""
        headers = {"Allow": ", ".join(self.allow)} if self.allow else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return headers

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=param)


def busy(num_waiting: int, retry_after: float) -> APIError:
    """The 429 for a full waiting queue: "busy: N waiting" (the pages' wording too)."""
    return APIError(429, busy_message(num_waiting), code="queue_full",
                    retry_after=retry_after)


def error_body(err: APIError) -> dict[str, Any]:
    """The JSON body of an error response (and of a streamed `error` event)."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def shown(value: Any) -> str:
    """`repr(value)` clipped for a message (long strings, deep or long lists shortened)."""
    return _SHOWN.repr(value)
