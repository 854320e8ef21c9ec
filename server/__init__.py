"""The OpenAI-compatible API over the datacenter engine.

- `server.protocol`: request bodies -> prompt and `SamplingParams`; response objects.
- `server.fields`: which request fields are served, refused (400) or ignored.
- `server.responses`: OpenAI's Responses API as the chat underneath it.
- `server.routes`: `api_routes(get_engine, ...)`, the Starlette routes the dashboard's
  server mounts beside its pages and `batchlens serve` serves alone; `cors_middleware`.
- `server.errors`: `APIError` and the OpenAI error body.
- `server.cli`: `batchlens serve`.

Nothing heavy is imported here: each module is imported where it is used.
"""
