"""A request body's structured output: the one field that asks for it -> `StructuredOutput`.

Each name a client may use, as its own server defines it:

- OpenAI's `response_format`: `{"type": "json_object"}`, or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}` (`{"type": "text"}`: none);
- vLLM's `structured_outputs`: exactly one of `json` (a schema, as an object or JSON
  text), `regex`, `choice` (a list of strings), `grammar` (EBNF) or `json_object: true`;
- vLLM's names before its 0.12 release, `guided_json`, `guided_regex`, `guided_choice`
  and `guided_grammar`, which older clients still send;
- llama.cpp's server's `json_schema` and `grammar` (GBNF, which xgrammar's EBNF reads).

A request that sets two of them, a spec of the wrong type, or an option this server does
not implement (a whitespace pattern, structural tags, the switches that turn the
grammar's fallbacks off) is a 400 naming the field. Whether the spec compiles is known
where the tokenizer is: the engine's `check` (a 400 naming the same field).
"""

from __future__ import annotations

import json
from typing import Any

from engine.config import StructuredOutput
from server.errors import bad_request, shown

Body = dict[str, Any]

# vLLM's structured_outputs keys -> this engine's kind
KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
         "json_object": "json_object"}
# vLLM's options this server does not implement (a value other than these is a 400)
OPTIONS = {"disable_fallback": (None, False), "disable_any_whitespace": (None, False),
           "disable_additional_properties": (None, False), "whitespace_pattern": (None, ""),
           "structural_tag": (None, ""), "backend": (None, "", "auto", "xgrammar"),
           "_backend": (None, "", "auto", "xgrammar"), "_backend_was_auto": (None, False, True)}
# older and other servers' single-kind fields -> kind
SINGLE = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar", "json_schema": "json", "grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *SINGLE)


def parse(body: Body) -> tuple[StructuredOutput | None, str | None]:
    """The body's structured output and the field it came from; (None, None) when it
    asks for none."""
    found = [(name, body[name]) for name in FIELDS if not _unset(name, body.get(name))]
    if not found:
        return None, None
    if len(found) > 1:
        names = " and ".join(n for n, _ in found)
        raise bad_request(f"{found[1][0]}: only one structured output per request "
                          f"(got {names})", found[1][0])
    name, value = found[0]
    if name == "response_format":
        return from_response_format(value), name
    if name == "structured_outputs":
        return _from_vllm(value), name
    return _make(SINGLE[name], value, name), name


def _unset(name: str, value: Any) -> bool:
    if name == "response_format":
        return value is None or (isinstance(value, dict) and value.get("type") == "text"
                                 and len(value) == 1)
    return value is None or value in ({}, [], "")


def from_response_format(value: Any, name: str = "response_format") -> StructuredOutput | None:
    """OpenAI's response_format (or the Responses API's `text.format`, flat: `name` and
    `schema` beside `type`) as a structured output; text is none."""
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {shown(value)}", name)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema", value) if name == "response_format" else value
        if not isinstance(inner, dict) or inner.get("schema") is None:
            where = f"{name}.json_schema" if name == "response_format" else name
            raise bad_request(f"{where}.schema is required for type json_schema (got "
                              f"{shown(value)})", name)
        return _make("json", inner["schema"], name)
    raise bad_request(f"{name}.type must be text, json_object or json_schema here, got "
                      f"{shown(kind)}", name)


def _from_vllm(value: Any) -> StructuredOutput:
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {shown(value)}", name)
    for key, v in value.items():
        if key in KINDS:
            continue
        if key not in OPTIONS:
            raise bad_request(f"{name}.{key} is not a structured-outputs option (the kinds "
                              f"are {', '.join(KINDS)})", name)
        if v not in OPTIONS[key]:
            raise bad_request(f"{name}.{key} is not supported here (got {shown(v)})", name)
    kinds = [k for k in KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(f"{name} must set exactly one of {', '.join(KINDS)} (got "
                          f"{', '.join(kinds) or 'none'})", name)
    kind = kinds[0]
    if kind == "json_object":
        if value[kind] is not True:
            raise bad_request(f"{name}.json_object must be true, got {shown(value[kind])}", name)
        return StructuredOutput("json_object")
    return _make(kind, value[kind], f"{name}.{kind}", param=name)


def _make(kind: str, spec: Any, where: str, param: str | None = None) -> StructuredOutput:
    """A `StructuredOutput` of `kind` from the body's `spec`; a 400 naming `where`."""
    param = param or where
    if kind == "json":
        if isinstance(spec, str):
            try:
                json.loads(spec)
            except json.JSONDecodeError as exc:
                raise bad_request(f"{where}: the JSON schema is not valid JSON: {exc}",
                                  param) from None
        elif isinstance(spec, dict | bool):
            spec = json.dumps(spec)
        else:
            raise bad_request(f"{where} must be a JSON schema (an object), got {shown(spec)}",
                              param)
    elif kind == "choice":
        if (not isinstance(spec, list) or not spec
                or any(not isinstance(c, str) or not c for c in spec)):
            raise bad_request(f"{where} must be a non-empty list of non-empty strings, got "
                              f"{shown(spec)}", param)
        spec = tuple(spec)
    elif not isinstance(spec, str) or not spec.strip():
        raise bad_request(f"{where} must be a non-empty string, got {shown(spec)}", param)
    return StructuredOutput(kind, spec)
