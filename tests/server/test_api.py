"""The OpenAI-compatible API with the official `openai` client against real uvicorn servers
on 127.0.0.1 (httpx's ASGI transport does not stream).

Model-free tests (the wire format, auth, every error caught before generation) run a
server over a stand-in engine; `model` tests serve a small real engine on the bundled
float32 model: chat and completions, streamed and not, usage and cached tokens, stop
strings, seeds, parity with `Engine.generate`, a full queue, a disconnect, an engine error
mid-stream.
"""

from __future__ import annotations

import json
import socket
import uuid
from types import SimpleNamespace

import httpx
import openai
import pytest
from http_server import serving
from polling import wait_for
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from engine import Engine, EngineConfig, SamplingParams
from engine.serving import busy_message
from server import protocol
from server.cli import build_parser, engine_config
from server.cli import main as serve_main
from server.errors import APIError, error_body
from server.routes import MAX_BODY_BYTES, api_routes, cors_middleware

STUB_MODEL = "stub-model"
KEY = "sekret"
TIMEOUT_S = 60.0


def client_for(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


class StubEngine:
    """Just enough of an engine for routes that never reach generation."""

    max_model_len = 2048
    loaded = SimpleNamespace(name=STUB_MODEL)

    def __init__(self) -> None:
        self.alive = True

    @property
    def stopped_reason(self) -> str | None:
        return None if self.alive else "stopped: the engine loop failed (stub)"

    def stats(self, steps_after=None):
        kv = SimpleNamespace(used_blocks=3, num_blocks=10)
        return SimpleNamespace(num_running=1, num_waiting=2, kv=kv)


@pytest.fixture(scope="module")
def stub():
    return StubEngine()


@pytest.fixture(scope="module")
def stub_url(stub):
    with serving(api_routes(lambda: stub, model_name=STUB_MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def stub_client(stub_url):
    with client_for(stub_url) as c:
        yield c


def quiet(eng: Engine) -> bool:
    s = eng.stats(steps_after=None)
    return s.num_running == 0 and s.num_waiting == 0 and s.kv.used_blocks == 0


# ---- the wire format, no server ------------------------------------------------------
def test_parse_defaults_and_vllm_extensions():
    req = protocol.parse_completion({"prompt": "Hi", "frobnicate": [1]}, STUB_MODEL)
    assert (req.prompt, req.params.max_tokens, req.params.temperature) == ("Hi", 16, 1.0)
    assert (req.stream, req.include_usage, req.n, req.max_tokens_param) == (False, False, 1, None)
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, STUB_MODEL)
    assert chat.params.max_tokens == protocol.CHAT_DEFAULT_MAX_TOKENS == 256
    body = {"model": STUB_MODEL, "prompt": [[1, 2, 3]], "top_k": -1, "stop": "\n",
            "seed": 3, "ignore_eos": True, "min_tokens": 2, "max_tokens": 9,
            "stream": True, "stream_options": {"include_usage": True}, "n": 1}
    req = protocol.parse_completion(body, STUB_MODEL)
    p = req.params
    assert req.prompt == [1, 2, 3] and req.stream and req.include_usage
    assert (p.top_k, p.stop, p.seed, p.ignore_eos, p.min_tokens, p.max_tokens) == (
        0, ["\n"], 3, True, 2, 9)


def test_parse_chat_content_parts_and_max_completion_tokens():
    body = {"messages": [{"role": "system", "content": None},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}],
            "max_tokens": 50, "max_completion_tokens": 7}
    req = protocol.parse_chat(body, STUB_MODEL)
    assert req.prompt == [{"role": "system", "content": ""}, {"role": "user", "content": "a\nb"}]
    assert (req.params.max_tokens, req.max_tokens_param) == (7, "max_completion_tokens")


@pytest.mark.parametrize(("chat", "body", "param"), [
    (False, {"prompt": "Hi", "temperature": -1}, "temperature"),
    (False, {"prompt": "Hi", "top_p": 2}, "top_p"),
    (False, {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    (True, {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    (False, {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    (False, {"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
    (False, {"prompt": "Hi", "ignore_eos": "yes"}, "ignore_eos"),
    (False, {"prompt": "Hi", "stop": 5}, "stop"),
    (False, {"prompt": "Hi", "stop": ["ok", ""]}, "stop"),
    (False, {"prompt": "Hi", "n": 17}, "n"),
    (False, {"prompt": "Hi", "n": 0}, "n"),
    (False, {"prompt": "Hi", "n": 2, "best_of": 3}, "best_of"),
    (False, {"prompt": "Hi", "seed": -1}, "seed"),
    (False, {"prompt": "Hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (False, {"prompt": "Hi", "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    (True, {"messages": [{"role": "user", "content": "Hi"}],
            "stream_options": {"include_usage": True}}, "stream_options"),
    (False, {"prompt": "   "}, "prompt"),
    (False, {}, "prompt"),
    (False, {"prompt": [["a", "b"]]}, "prompt"),
    (False, {"prompt": [1, "a"]}, "prompt"),
    (True, {"messages": []}, "messages"),
    (True, {"messages": "Hi"}, "messages"),
    (True, {"messages": [{"role": "user", "content": " "}]}, "messages"),
    (True, {"messages": [{"content": "Hi"}]}, "messages"),
    (True, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_parse_errors_name_the_param(chat, body, param):
    parse = protocol.parse_chat if chat else protocol.parse_completion
    with pytest.raises(APIError) as err:
        parse(body, STUB_MODEL)
    assert (err.value.status, err.value.param) == (400, param)
    assert param in err.value.message


def test_unknown_model_is_404_and_engine_errors_name_the_clients_field():
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"prompt": "Hi", "model": "gpt-x"}, STUB_MODEL)
    assert (err.value.status, err.value.param, err.value.code) == (404, "model",
                                                                     "model_not_found")
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "Hi"}],
                                "max_completion_tokens": 9000}, STUB_MODEL)
    e = chat.error("max_tokens: 9000 plus a 5-token prompt exceeds the limit of 4096 tokens")
    assert e.param == "max_completion_tokens" and e.message.startswith("max_completion_tokens:")
    assert chat.error("prompt: 5000 tokens does not fit").param == "messages"
    assert chat.error("something else").param is None
    assert error_body(e) == {"error": {"message": e.message, "type": "invalid_request_error",
                                       "param": "max_completion_tokens", "code": None}}


def test_a_default_max_tokens_is_cut_to_the_context_an_explicit_one_is_not():
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, STUB_MODEL)
    assert protocol.fit_default_max_tokens(chat, 4000, 4096).params.max_tokens == 96
    assert protocol.fit_default_max_tokens(chat, 10, 4096) is chat
    explicit = protocol.parse_completion({"prompt": "Hi", "max_tokens": 500}, STUB_MODEL)
    assert protocol.fit_default_max_tokens(explicit, 4000, 4096) is explicit


def test_reply_objects_have_openais_shape():
    chat, cmpl = protocol.Reply.new(True, "m"), protocol.Reply.new(False, "m")
    assert chat.id.startswith("chatcmpl-") and cmpl.id.startswith("cmpl-")
    usage = protocol.usage(10, 3, 8)
    assert usage == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                     "prompt_tokens_details": {"cached_tokens": 8}}
    whole = chat.whole("Paris.", "stop", usage)
    assert whole["object"] == "chat.completion" and whole["usage"] == usage
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    assert cmpl.whole("x", "length", usage)["choices"][0]["text"] == "x"
    first = chat.chunk("", role=True)["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    last = chat.chunk(None, "stop")
    assert last["object"] == "chat.completion.chunk"
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": "stop"}
    assert cmpl.chunk("hi")["object"] == "text_completion"
    assert cmpl.usage_chunk(usage)["choices"] == []
    assert protocol.sse({"a": 1}) == 'data: {"a":1}\n\n'
    assert protocol.sse_error(APIError(500, "boom")).startswith("event: error\ndata: {")


def test_serve_flags_become_the_engine_config():
    args = build_parser().parse_args(
        ["--port", "9000", "--block-size", "32", "--num-kv-blocks", "100",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--no-prefix-caching",
         "--dtype", "bfloat16", "--device", "cpu"])
    cfg = engine_config(args)
    assert (args.host, args.port, args.max_waiting) == ("127.0.0.1", 9000, 256)
    assert (cfg.block_size, cfg.num_kv_blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens,
            cfg.enable_prefix_caching, cfg.dtype, cfg.device) == (
        32, 100, 8, 256, False, "bfloat16", "cpu")
    from batchlens.cli import COMMANDS

    assert COMMANDS["serve"][0] == "server.cli"
    assert cfg.speculative is None  # off unless asked for


def test_serve_refuses_a_port_it_cannot_listen_on_before_loading_a_model(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, words in ((["--port", "99999"], "--port must be in [1, 65535], got 99999"),
                            (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}: "),
                            # TEST-NET-1: documentation only, no host has it
                            (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:8000: ")):
            with pytest.raises(SystemExit) as exc:
                serve_main(argv, prog="batchlens serve")
            assert exc.value.code == 2
            assert f"batchlens serve: error: {words}" in capsys.readouterr().err


def test_serve_takes_vllms_speculative_config_flag():
    config = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3}'
    cfg = engine_config(build_parser().parse_args(["--speculative-config", config]))
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == (
        "ngram", 6, 3)
    for bad, message in (('{"method": "eagle"}', "speculative must be None or one of"),
                         ('{"method": "ngram", "k": 2}', r"unknown keys \['k'\]"),
                         ("ngram", "not JSON")):
        with pytest.raises(ValueError, match=message):
            engine_config(build_parser().parse_args(["--speculative-config", bad]))


# ---- a server over a stand-in engine: everything refused before generation -----------
@pytest.mark.parametrize(("kind", "extra", "status", "param"), [
    ("completions", {"temperature": -1}, 400, "temperature"),
    ("completions", {"top_p": 2}, 400, "top_p"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("chat", {"messages": []}, 400, "messages"),
    ("completions", {"temperature": "hot"}, 400, "temperature"),
    ("chat", {"stop": {"a": 1}}, 400, "stop"),
    ("completions", {"n": 17}, 400, "n"),
    ("chat", {"n": 0}, 400, "n"),
    ("completions", {"model": "gpt-4"}, 404, "model"),
    ("chat", {"model": "gpt-4"}, 404, "model"),
])
def test_the_client_sees_the_status_and_param(stub_client, kind, extra, status, param):
    with pytest.raises(openai.APIStatusError) as err:
        if kind == "chat":
            stub_client.chat.completions.create(
                model=STUB_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                extra_body=extra)
        else:
            stub_client.completions.create(model=STUB_MODEL, prompt="Hi", max_tokens=4,
                                           extra_body=extra)
    e = err.value
    assert (e.status_code, e.param) == (status, param)
    assert e.type == "invalid_request_error" and e.message


def test_malformed_json_and_a_non_object_body_are_400_without_param(stub_url):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(stub_url + path, content=b'{"prompt": "Hi", ',
                       headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] is None and "malformed JSON" in err["message"]
        assert set(err) == {"message", "type", "param", "code"}
        r = httpx.post(stub_url + path, json=["Hi"], timeout=10)
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_models_and_health_over_a_stub(stub, stub_url, stub_client):
    models = stub_client.models.list()
    assert [m.id for m in models.data] == [STUB_MODEL]
    raw = httpx.get(stub_url + "/v1/models", timeout=10).json()
    assert raw["object"] == "list"
    assert raw["data"][0] | {"created": 0} == {
        "id": STUB_MODEL, "object": "model", "created": 0, "owned_by": "batchlens",
        "root": STUB_MODEL, "parent": None, "max_model_len": 2048}
    health = httpx.get(stub_url + "/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "num_requests_running": 1,
                             "num_requests_waiting": 2, "kv_blocks_used": 3,
                             "kv_blocks_total": 10}
    stub.alive = False
    try:
        health = httpx.get(stub_url + "/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["status"] == "engine stopped: the engine loop failed (stub)"
    finally:
        stub.alive = True
    assert httpx.get(stub_url + "/metrics", timeout=10).status_code == 404


def test_retrieve_version_and_routes_not_served_are_openai_shaped(stub_url, stub_client):
    """OpenAI's retrieve and vLLM's /version answer; any other /v1 path is a 404 naming the
    request and the routes served, a served path with the wrong method a 405 with Allow."""
    model = stub_client.models.retrieve(STUB_MODEL)
    assert (model.id, model.max_model_len) == (STUB_MODEL, 2048)
    with pytest.raises(openai.NotFoundError) as err:
        stub_client.models.retrieve("gpt-4")
    assert (err.value.body["param"], err.value.body["code"]) == ("model", "model_not_found")
    r = httpx.get(stub_url + "/version", timeout=10)
    assert r.status_code == 200 and r.json()["version"]
    with pytest.raises(openai.NotFoundError) as err:
        stub_client.embeddings.create(model=STUB_MODEL, input="Hi")
    body = err.value.body
    assert body["code"] == "route_not_found"
    assert body["message"].startswith("POST /v1/embeddings is not served here")
    assert "POST /v1/chat/completions" in body["message"]
    assert "GET /v1/models/{model}" in body["message"]
    for method, path, allow in (("GET", "/v1/chat/completions", "POST"),
                                ("POST", "/v1/models", "GET, HEAD"),
                                ("DELETE", "/v1/models/stub-model", "GET, HEAD")):
        r = httpx.request(method, stub_url + path, timeout=10)
        assert (r.status_code, r.headers["allow"]) == (405, allow), (method, path)
        assert r.json()["error"]["message"] == f"{method} {path}: this route takes {allow}"


def test_browsers_on_other_origins_may_call_the_api_paths_only(stub):
    """CORS as vLLM's server answers it: any origin by default, preflights with the API
    key's header included; a list narrows it; a path outside the API gets nothing."""
    preflight = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    routes = api_routes(lambda: stub, model_name=STUB_MODEL) + [
        Route("/elsewhere", lambda request: PlainTextResponse("page"))]
    with serving(routes, cors_middleware()) as url:
        r = httpx.options(url + "/v1/chat/completions", headers=preflight, timeout=10)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "*"
        assert "authorization" in r.headers["access-control-allow-headers"]
        for path in ("/v1/models", "/health", "/version"):
            r = httpx.get(url + path, headers={"Origin": "https://chat.example"}, timeout=10)
            assert r.headers["access-control-allow-origin"] == "*", path
        r = httpx.get(url + "/elsewhere", headers={"Origin": "https://chat.example"}, timeout=10)
        assert r.text == "page" and "access-control-allow-origin" not in r.headers
    with serving(routes, cors_middleware(["https://chat.example"])) as url:
        ok = httpx.get(url + "/v1/models", headers={"Origin": "https://chat.example"},
                       timeout=10)
        assert ok.headers["access-control-allow-origin"] == "https://chat.example"
        other = httpx.options(url + "/v1/models", timeout=10,
                              headers=preflight | {"Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert cors_middleware([]) == []


def test_serve_reads_vllms_allowed_origins_flag(capsys):
    assert build_parser().parse_args([]).allowed_origins == ["*"]
    flag = ["--allowed-origins", '["https://chat.example"]']
    assert build_parser().parse_args(flag).allowed_origins == ["https://chat.example"]
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):
            build_parser("batchlens serve").parse_args(["--allowed-origins", bad])
        assert "a JSON list of origins" in capsys.readouterr().err


def test_serve_takes_a_metrics_prefix_prometheus_accepts(capsys):
    assert build_parser().parse_args([]).metrics_prefix == "batchlens:"
    for given in ("vllm", "vllm:"):
        assert build_parser().parse_args(["--metrics-prefix", given]).metrics_prefix == "vllm:"
    for bad in ("9x", "vllm-2", ""):
        with pytest.raises(SystemExit):
            build_parser("batchlens serve").parse_args(["--metrics-prefix", bad])
        assert "letters, digits and underscores" in capsys.readouterr().err


def test_serve_takes_vllms_tool_and_template_flags(capsys, tmp_path):
    args = build_parser().parse_args([])
    assert not args.enable_auto_tool_choice and args.tool_call_parser is None
    assert args.chat_template is None
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = build_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser",
                                      "hermes", "--chat-template", str(template)])
    assert args.tool_call_parser == "hermes"
    assert args.chat_template == "{{ messages[0]['content'] }}"
    template.write_text("{% if %}")
    for bad, words in ((["--tool-call-parser", "mistral"], "invalid choice"),
                       (["--chat-template", str(template)], "line 1"),
                       (["--chat-template", str(tmp_path / "none")], "no such file"),
                       (["--enable-auto-tool-choice"], "needs --tool-call-parser")):
        with pytest.raises(SystemExit):
            serve_main(bad)
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a parser alone is said to serve nothing, then --port
        serve_main(["--tool-call-parser", "hermes", "--port", "0"])
    said = capsys.readouterr().err
    assert "only with --enable-auto-tool-choice" in said and "--port must be" in said


def test_no_engine_is_503():
    def no_engine():
        raise RuntimeError("still loading")

    with serving(api_routes(no_engine, model_name=STUB_MODEL)) as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=10)
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]


def test_a_queue_past_its_cap_is_429_busy_with_retry_after(stub):
    with serving(api_routes(lambda: stub, model_name=STUB_MODEL, max_waiting=2)) as url, \
            client_for(url) as c:
        with pytest.raises(openai.RateLimitError) as err:  # the stub has 2 waiting
            c.chat.completions.create(model=STUB_MODEL, max_tokens=4,
                                      messages=[{"role": "user", "content": "Hi"}])
        assert err.value.body == {"message": busy_message(2), "type": "rate_limit_error",
                                  "param": None, "code": "queue_full"}
        assert err.value.body["message"] == "busy: 2 waiting"
        assert err.value.response.headers["retry-after"] == "2"
        r = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": "x"},
                       timeout=10)
        assert r.status_code == 400  # a bad request is told what is wrong, busy or not
    with pytest.raises(ValueError, match="max_waiting must be an integer >= 0"):
        api_routes(lambda: stub, model_name=STUB_MODEL, max_waiting=-1)


def test_an_oversized_body_is_413_and_broken_unicode_400(stub_url):
    big = b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    r = httpx.post(stub_url + "/v1/completions", content=big, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["message"] == (
        f"request body too large: at most {MAX_BODY_BYTES} bytes")
    for body, param in [(b'{"prompt": "a\\ud800"}', "prompt"),
                        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
                        (b'{"prompt": "hi", "stop": ["\\ud83d"]}', "stop")]:
        path = "/v1/chat/completions" if param == "messages" else "/v1/completions"
        r = httpx.post(stub_url + path, content=body, timeout=10)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "lone surrogate" in r.text
    r = httpx.post(stub_url + "/v1/completions", content=b'{"prompt": "hi", "model": "\\ud800"}',
                   timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"  # still JSON
    r = httpx.post(stub_url + "/v1/completions", content=b'{"prompt": ' + b"[" * 10**5,
                   timeout=10)
    assert r.status_code == 400 and "malformed JSON body" in r.json()["error"]["message"]


def test_a_tiny_temperature_is_greedy_and_values_are_quoted_short():
    req = protocol.parse_completion({"prompt": "Hi", "temperature": 5e-324}, STUB_MODEL)
    assert req.params.temperature == 0.0 and req.params.greedy
    assert protocol.parse_completion({"prompt": "Hi", "temperature": 1e-3},
                                     STUB_MODEL).params.temperature == 1e-3
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"prompt": "Hi", "max_tokens": "9" * 10_000}, STUB_MODEL)
    assert err.value.param == "max_tokens" and len(err.value.message) < 120


def test_several_api_keys_each_open_the_api(stub):
    with serving(api_routes(lambda: stub, model_name=STUB_MODEL,
                            api_key=["first", "second"])) as url:
        for key in ("first", "second"):
            with client_for(url, key) as c:
                assert c.models.list().data[0].id == STUB_MODEL
        with client_for(url, "third") as c, pytest.raises(openai.AuthenticationError):
            c.models.list()


def test_an_api_key_guards_every_v1_route_but_not_health_or_metrics(stub):
    class Metrics:
        def render(self) -> tuple[bytes, str]:
            return b"batchlens:num_requests_running 0.0\n", "text/plain; version=0.0.4"

    routes = api_routes(lambda: stub, model_name=STUB_MODEL, api_key=KEY, metrics=Metrics())
    with serving(routes) as url:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/models/x"),
                             ("POST", "/v1/embeddings")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = httpx.request(method, url + path, headers=headers, json={}, timeout=10)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
        with client_for(url, "wrong") as wrong, pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=STUB_MODEL, prompt="Hi", max_tokens=2)
        with client_for(url, KEY) as right:
            assert right.models.list().data[0].id == STUB_MODEL
            with pytest.raises(openai.BadRequestError):  # past the key, into validation
                right.completions.create(model=STUB_MODEL, prompt="Hi", max_tokens=0)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/version", timeout=10).status_code == 200
        r = httpx.get(url + "/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert r.text.startswith("batchlens:num_requests_running")


# ---- a real engine -------------------------------------------------------------------
def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """GET /metrics, parsed by prometheus_client: (sample name, labels but the model's) ->
    value."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")):
            s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def client(url):
    with client_for(url) as c:
        yield c


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.model
def test_models_reports_the_engines_context(client, url, name, api_engine):
    assert client.models.list().data[0].id == name
    data = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    assert (data["root"], data["max_model_len"]) == (name, api_engine.max_model_len)
    assert httpx.get(url + "/health", timeout=10).status_code == 200


@pytest.mark.model
def test_greedy_text_over_the_api_equals_engine_generate(client, name, api_engine):
    greedy = SamplingParams(max_tokens=16, temperature=0)
    prompt = "The three primary colors are"
    ref = api_engine.generate([prompt], greedy)[0]
    got = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == ref.text
    assert got.choices[0].finish_reason == ref.finish_reason
    assert got.usage.completion_tokens == len(ref.token_ids)
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == name
    ref = api_engine.generate([CHAT], greedy)[0]
    chat = client.chat.completions.create(model=name, messages=CHAT, max_tokens=16,
                                          temperature=0)
    assert chat.choices[0].message.content == ref.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


@pytest.mark.model
def test_chat_streams_the_same_text_with_a_final_usage_chunk(client, name):
    whole = client.chat.completions.create(model=name, messages=CHAT, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=name, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.model
def test_completions_stream_as_server_sent_events(url, name):
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "usage" not in chunks[-1]  # not asked for
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks)


@pytest.mark.model
def test_the_same_long_prompt_twice_reports_cached_tokens(client, name):
    prompt = f"Note {uuid.uuid4().hex}: " + " ".join(f"item {i}," for i in range(60))
    first = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in second if c.usage][0]
    n = first.usage.prompt_tokens
    assert n > 64 and usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n and cached % 16 == 0


@pytest.mark.model
def test_stop_strings_cut_the_text(client, name):
    prompt = "Here is a list of fruits: apple, banana,"
    base = client.completions.create(model=name, prompt=prompt, max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    words = [w.strip(",.") for w in text.split()]
    stop = next(w for w in words if len(w) >= 3 and text.index(w) >= 3)
    expected = text[:text.index(stop)]
    cut = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0,
                                     stop=[stop, "@@@"], extra_body={"ignore_eos": True})
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    streamed = client.completions.create(model=name, prompt=prompt, max_tokens=24,
                                          temperature=0, stop=stop, stream=True,
                                          extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


@pytest.mark.model
def test_a_seed_makes_sampling_reproducible(client, name):
    def sample(seed: int) -> str:
        out = client.completions.create(model=name, prompt="Once upon a time", max_tokens=10,
                                        temperature=1.0, seed=seed)
        return out.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first} | {sample(s) for s in (1, 2, 3)}) >= 2


@pytest.mark.model
@pytest.mark.parametrize(("kind", "extra", "param"), [
    ("completions", {"max_tokens": 5000}, "max_tokens"),
    ("chat", {"max_completion_tokens": 5000}, "max_completion_tokens"),
    ("completions", {"prompt": [1] * 5000}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "hi " * 5000}]}, "messages"),
    ("completions", {"prompt": [10**7]}, "prompt"),
])
def test_over_the_context_is_400_naming_the_param(client, name, kind, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "chat":
            client.chat.completions.create(model=name, messages=CHAT, extra_body=extra)
        else:
            client.completions.create(model=name, prompt="Hi", extra_body=extra)
    assert err.value.param == param


@pytest.mark.model
def test_a_disconnected_stream_is_cancelled_and_frees_its_blocks(client, name, api_engine):
    stream = client.completions.create(model=name, prompt="Tell me a long story about a dragon.",
                                       max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    seen = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            seen.append(chunk)
        if len(seen) == 3:
            break
    rid = seen[0].id
    assert rid in api_engine.stats(steps_after=None).running_ids
    stream.close()
    wait_for(lambda: quiet(api_engine), timeout=2.0,
             message="the request was not cancelled or its blocks not freed within 2 s")
    assert rid not in api_engine.stats(steps_after=None).running_ids


@pytest.mark.model
def test_a_non_streaming_client_that_leaves_is_cancelled(url, name, api_engine):
    body = {"model": name, "prompt": "Tell me a long story.", "max_tokens": 400,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=1.0)
    wait_for(lambda: quiet(api_engine), timeout=3.0, message="the request was not cancelled")


@pytest.mark.model
def test_a_full_queue_answers_429(loaded, name):
    body = {"model": name, "prompt": "Count to a thousand:", "max_tokens": 300,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with Engine(EngineConfig(num_kv_blocks=64, max_num_seqs=1), loaded=loaded) as eng, \
            serving(api_routes(lambda: eng, model_name=name, max_waiting=1)) as url, \
            httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
        with http.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            wait_for(lambda: eng.stats(steps_after=None).num_running == 1, timeout=10)
            with http.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200
                wait_for(lambda: eng.stats(steps_after=None).num_waiting == 1, timeout=10)
                with client_for(url) as c, pytest.raises(openai.RateLimitError) as err:
                    c.completions.create(model=name, prompt="Hi", max_tokens=2)
                assert err.value.status_code == 429
                assert err.value.body["message"] == busy_message(1) == "busy: 1 waiting"
                assert err.value.code == "queue_full" and err.value.type == "rate_limit_error"
                assert err.value.response.headers["retry-after"] == "2"
        wait_for(lambda: quiet(eng), timeout=5, message="the streams were not cancelled")


class FailingRunner:
    """The engine's model runner, failing every step after the first `ok_steps`."""

    def __init__(self, runner, ok_steps: int) -> None:
        self.runner, self.ok_steps, self.calls = runner, ok_steps, 0

    def execute(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.ok_steps:
            raise RuntimeError("injected failure")
        return self.runner.execute(*args, **kwargs)


@pytest.mark.model
def test_an_engine_error_after_the_stream_began_is_an_error_event(loaded, name):
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with Engine(EngineConfig(num_kv_blocks=64), loaded=loaded) as eng, \
            serving(api_routes(lambda: eng, model_name=name)) as url:
        failing = eng.core.runner = FailingRunner(eng.core.runner, ok_steps=3)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            events = r.read().decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        error_event = events[-3]
        assert error_event.startswith("event: error\ndata: ")
        err = json.loads(error_event.split("data: ", 1)[1])["error"]
        assert err["type"] == "server_error" and "injected failure" in err["message"]
        assert any(json.loads(e[6:])["choices"][0]["text"] for e in events[:-3])

        failing.calls = 0
        with client_for(url) as c:
            with pytest.raises(openai.APIError, match="injected failure"):
                for _ in c.completions.create(model=name, prompt="Once upon a time",
                                              max_tokens=20, stream=True,
                                              extra_body={"ignore_eos": True}):
                    pass
            failing.calls = 0
            with pytest.raises(openai.InternalServerError, match="injected failure"):
                c.completions.create(model=name, prompt="Hi", max_tokens=20,
                                     extra_body={"ignore_eos": True})
        eng.shutdown()
        assert httpx.get(url + "/health", timeout=10).status_code == 503



@pytest.mark.model
def test_metrics_scraped_over_http_match_the_engine(client, url, name, api_engine):
    """Prometheus text from /metrics: the gauges equal the engine's stats at a quiet moment,
    and generation_tokens_total grows by exactly the tokens the requests received."""
    gen = ("batchlens:generation_tokens_total", frozenset())
    wait_for(lambda: quiet(api_engine), 30, "the engine did not go quiet")
    before = scrape(url)[gen]
    outs = [client.completions.create(model=name, prompt=f"Count to {i + 3}:",
                                      max_tokens=4 + i, temperature=0) for i in range(3)]
    received = sum(o.usage.completion_tokens for o in outs)
    assert received > 0
    # the exporter hears of a request just after its answer is handed over
    wait_for(lambda: scrape(url)[gen] - before == received, 5,
             "generation_tokens_total did not grow by the tokens received")
    wait_for(lambda: quiet(api_engine), 30, "the engine did not go quiet")
    got, stats = scrape(url), api_engine.stats(steps_after=None)
    assert got[("batchlens:num_requests_running", frozenset())] == stats.num_running
    assert got[("batchlens:num_requests_waiting", frozenset())] == stats.num_waiting
    assert got[("batchlens:kv_cache_usage_perc", frozenset())] == pytest.approx(stats.kv.usage)
    assert got[gen] - before == received  # nothing more arrived afterwards
