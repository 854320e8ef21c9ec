"""API errors as OpenAI clients expect them: an HTTP status and the body
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

# status -> the OpenAI error type a client sees for it
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the API answers with. `param` names the request field at fault (None when
    no single field is); `type` defaults from the status; `code` is a short machine-readable
    reason such as "model_not_found" (None when the status says enough)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.code = code

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=param)


def error_body(err: APIError) -> dict[str, Any]:
    """The JSON body of an error response (and of a streamed `error` event)."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}
