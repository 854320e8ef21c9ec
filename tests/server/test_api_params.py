"""The OpenAI parameters beyond the basics, as vLLM's server has them: log-probabilities
(with `echo`, as lm-evaluation-harness's `local-completions` asks), a list of prompts,
penalties, `logit_bias`, `min_p`, `/tokenize` and `/detokenize`, and a 400 naming every
field this server knows but does not implement.

Model-free tests check the wire format and the refusals (over a stand-in engine); `model`
tests serve the bundled float32 model and compare with transformers' own logits and with
a plain reference of the sampling rules (`sampling_ref`).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from http_server import serving
from sampling_ref import reference_draw, reference_process

from engine import SamplingParams
from server import protocol
from server.errors import APIError
from server.routes import api_routes

STUB_MODEL = "stub-model"
TIMEOUT_S = 120.0


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                         timeout=TIMEOUT_S)


# ---- the wire format, no server -------------------------------------------------------
def test_a_list_of_prompts_is_one_request_each():
    req = protocol.parse_completion({"prompt": ["Hi", [1, 2, 3], "there"]}, STUB_MODEL)
    assert req.prompts == ("Hi", [1, 2, 3], "there")
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"prompt": ["Hi"] * (protocol.MAX_PROMPTS + 1)}, STUB_MODEL)
    assert err.value.param == "prompt" and str(protocol.MAX_PROMPTS) in err.value.message
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"prompt": ["Hi", " "]}, STUB_MODEL)
    assert err.value.param == "prompt" and "prompt[1]" in err.value.message


UNSUPPORTED = [
    (False, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (True, "tool_choice", "required"),  # with no tools
    (False, "tool_choice", "auto"),
    (True, "functions", [{"name": "f"}]),
    (True, "function_call", "auto"),
    (False, "response_format", {"type": "json_schema", "json_schema": {}}),
    (True, "response_format", {"type": "structural_tag", "format": {}}),
    (False, "suffix", "the end"),
    (False, "best_of", 2),
    (False, "length_penalty", 0.5),
    (True, "structured_outputs", {"json": {"type": "object"}, "whitespace_pattern": " "}),
    (False, "guided_whitespace_pattern", "[ ]?"),
    (True, "guided_decoding_backend", "outlines"),
    (False, "structural_tag", '{"structures": []}'),
    (True, "audio", {"voice": "alloy"}),
    (True, "modalities", ["text", "audio"]),
    (True, "prediction", {"type": "content", "content": "x"}),
    (True, "web_search_options", {"search_context_size": "low"}),
    (True, "reasoning_effort", "low"),
    (True, "verbosity", "low"),
    (True, "store", True),
    (False, "service_tier", "flex"),
    (True, "echo", True),
    (False, "continue_final_message", True),  # chat only
    (False, "add_generation_prompt", True),
    (True, "stream_options.continuous_usage_stats", True),  # without include_usage
    # vLLM's, not implemented here
    (False, "priority", 5),
    (False, "logits_processors", ["my.module:Processor"]),
    (True, "kv_transfer_params", {"do_remote_decode": True}),
    (False, "vllm_xargs", {"a": 1}),
    (True, "mm_processor_kwargs", {"num_crops": 4}),
    (True, "chat_template", "{{ messages }}"),
    (True, "documents", [{"title": "a", "text": "b"}]),
    (True, "add_special_tokens", True),
    (False, "add_special_tokens", False),
    (False, "chat_template_kwargs", {"enable_thinking": False}),
    (True, "suffix", "the end"),
    # other servers' names for samplers and limits (llama.cpp's server, TGI)
    (False, "n_predict", 32),
    (True, "repeat_penalty", 1.1),
    (False, "n_probs", 3),
    (True, "typical_p", 0.5),
    (False, "tfs_z", 0.9),
    (True, "mirostat", 2),
    (False, "top_n_sigma", 1.0),
    (False, "xtc_probability", 0.5),
    (True, "dry_multiplier", 0.8),
    (False, "dynatemp_range", 0.5),
    (False, "samplers", ["top_k", "temperature"]),
    (True, "do_sample", False),
    (False, "top_n_tokens", 5),
    (False, "watermark", True),
    (False, "truncate", 100),
]


def _body(chat: bool, field: str, value) -> dict:
    body = ({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    if field.startswith("stream_options."):
        return body | {"stream": True, "stream_options": {field.split(".")[1]: value}}
    return body | {field: value}


@pytest.mark.parametrize(("chat", "field", "value"), UNSUPPORTED)
def test_a_field_this_server_does_not_implement_is_a_400_naming_it(chat, field, value):
    parse = protocol.parse_chat if chat else protocol.parse_completion
    with pytest.raises(APIError) as err:
        parse(_body(chat, field, value), STUB_MODEL)
    assert (err.value.status, err.value.param) == (400, field)
    assert err.value.message.startswith(field)


@pytest.mark.parametrize(("field", "value"), [
    ("tools", []), ("tool_choice", "none"), ("response_format", {"type": "text"}),
    ("best_of", 1), ("suffix", None), ("skip_special_tokens", True), ("modalities", ["text"]),
    ("user", "someone"), ("frobnicate", {"x": 1}),  # unknown fields stay ignored, as vLLM's
    ("reasoning_effort", None), ("verbosity", "medium"), ("store", False),
    ("service_tier", "auto"), ("stream_options", None), ("stream_options", {}),
    ("priority", 0), ("cache_salt", None), ("add_special_tokens", False),
    ("chat_template", None), ("n_predict", -1), ("repeat_penalty", 1.0), ("typical_p", 1),
    ("mirostat", 0), ("do_sample", True), ("top_n_sigma", -1), ("samplers", []),
])
def test_the_default_of_such_a_field_and_unknown_fields_are_accepted(field, value):
    req = protocol.parse_chat(_body(True, field, value), STUB_MODEL)
    assert req.params.max_tokens == protocol.CHAT_DEFAULT_MAX_TOKENS


def test_unknown_fields_are_named_for_the_log_and_known_ones_are_not():
    body = _body(True, "frobnicate", 1) | {"user": "u", "metadata": {}, "typical_p": 1,
                                           "Zeta": 2, "request_id": "r"}
    assert protocol.parse_chat(body, STUB_MODEL).ignored == ("Zeta", "frobnicate")
    assert protocol.parse_completion(_body(False, "top_k", 3), STUB_MODEL).ignored == ()


def test_chat_template_kwargs_are_checked_and_kept():
    req = protocol.parse_chat(_body(True, "chat_template_kwargs", {"enable_thinking": False}),
                              STUB_MODEL)
    assert req.template_kwargs == {"enable_thinking": False}
    assert protocol.parse_chat(_body(True, "user", "u"), STUB_MODEL).template_kwargs == {}
    for value, words in (([1], "must be an object"),
                         ({"add_generation_prompt": False, "messages": []},
                          "add_generation_prompt, messages is set by the server")):
        with pytest.raises(APIError) as err:
            protocol.parse_chat(_body(True, "chat_template_kwargs", value), STUB_MODEL)
        assert err.value.param == "chat_template_kwargs" and words in err.value.message


def test_the_template_switches_are_vllms_and_kept_where_they_differ():
    def switches(**body):
        return protocol.parse_chat(_body(True, "user", "u") | body, STUB_MODEL).template_kwargs

    assert switches() == {} and switches(add_generation_prompt=True) == {}
    assert switches(add_generation_prompt=False) == {"add_generation_prompt": False}
    prefill = switches(add_generation_prompt=False, continue_final_message=True,
                       chat_template_kwargs={"enable_thinking": False})
    assert prefill == {"enable_thinking": False, "add_generation_prompt": False,
                       "continue_final_message": True}
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"add_generation_prompt": "no"}, "add_generation_prompt")):
        with pytest.raises(APIError) as err:
            switches(**body)
        assert err.value.param == param
    assert "send add_generation_prompt: false with it" in str(
        pytest.raises(APIError, switches, continue_final_message=True).value.message)


def test_vllms_allowed_tokens_stop_strings_and_truncation_reach_the_request():
    req = protocol.parse_completion({"prompt": "Hi", "allowed_token_ids": [5, 9],
                                     "include_stop_str_in_output": True, "stop": ["."],
                                     "truncate_prompt_tokens": 3}, STUB_MODEL)
    assert req.params.allowed_token_ids == [5, 9] and req.params.include_stop_str_in_output
    assert req.truncated([1, 2, 3, 4, 5], 8) == [3, 4, 5]
    assert req.truncated([1, 2], 8) == [1, 2]
    whole = protocol.parse_completion({"prompt": "Hi", "truncate_prompt_tokens": -1},
                                      STUB_MODEL)
    assert whole.truncated(list(range(10)), 4) == [6, 7, 8, 9]  # -1: the context length
    plain = protocol.parse_completion({"prompt": "Hi"}, STUB_MODEL)
    assert plain.params.allowed_token_ids is None and plain.truncated([1, 2], 1) == [1, 2]
    with pytest.raises(APIError) as err:
        req.truncated([1], 2)  # k = 3 past a context of 2
    assert err.value.param == "truncate_prompt_tokens" and "context length (2)" in str(
        err.value.message)
    assert protocol.parse_completion({"prompt": "Hi", "bad_words": ["Paris", " Rome"]},
                                     STUB_MODEL).bad_words == ("Paris", " Rome")
    for extra, param in (({"bad_words": "Paris"}, "bad_words"),
                         ({"bad_words": ["ok", " "]}, "bad_words"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
                         ({"allowed_token_ids": "5"}, "allowed_token_ids"),
                         ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens")):
        with pytest.raises(APIError) as err:
            protocol.parse_completion({"prompt": "Hi"} | extra, STUB_MODEL)
        assert (err.value.status, err.value.param) == (400, param)


@pytest.mark.parametrize(("extra", "param"), [
    ({"top_p": 10**400}, "top_p"), ({"temperature": -(10**400)}, "temperature"),
    ({"presence_penalty": 10**309}, "presence_penalty"),
    ({"logit_bias": {"1": 10**400}}, "logit_bias")])
def test_an_integer_past_a_floats_range_is_a_400_naming_the_field(extra, param):
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"prompt": "Hi"} | extra, STUB_MODEL)
    assert (err.value.status, err.value.param) == (400, param)
    assert "is out of range, got an integer of" in err.value.message


def test_body_errors_come_before_an_unknown_models_404():
    for parse, body, param in [
        (protocol.parse_chat, {"model": "gpt-x"}, "messages"),
        (protocol.parse_completion, {"model": "gpt-x", "prompt": "Hi", "top_p": 7}, "top_p"),
        (protocol.parse_chat, {"model": "gpt-x", "tools": [{"type": "function"}],
                               "messages": [{"role": "user", "content": "Hi"}]}, "tools"),
    ]:
        with pytest.raises(APIError) as err:
            parse(body, STUB_MODEL)
        assert (err.value.status, err.value.param) == (400, param)
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"model": "gpt-x", "prompt": "Hi"}, STUB_MODEL)
    assert err.value.status == 404


def test_sampling_fields_reach_the_params():
    req = protocol.parse_completion({
        "prompt": "Hi", "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "repetition_penalty": 1.3, "logit_bias": {"42": -100, "7": 2.5}, "min_p": 0.1,
        "logprobs": 3, "echo": True}, STUB_MODEL)
    p = req.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
    assert p.logit_bias == {42: -100.0, 7: 2.5} and p.min_p == 0.1
    assert (p.logprobs, p.prompt_logprobs, req.echo) == (3, 3, True)
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "Hi"}],
                                "logprobs": True, "top_logprobs": 2}, STUB_MODEL)
    assert (chat.params.logprobs, chat.params.prompt_logprobs) == (2, None)
    plain = protocol.parse_chat({"messages": [{"role": "user", "content": "Hi"}],
                                 "logprobs": False}, STUB_MODEL)
    assert plain.params.logprobs is None


@pytest.mark.parametrize(("chat", "extra", "param"), [
    (False, {"presence_penalty": 3}, "presence_penalty"),
    (False, {"frequency_penalty": -2.5}, "frequency_penalty"),
    (False, {"repetition_penalty": 0}, "repetition_penalty"),
    (False, {"min_p": 1.5}, "min_p"),
    (False, {"logit_bias": {"5": 101}}, "logit_bias"),
    (False, {"logit_bias": {"five": 1}}, "logit_bias"),
    (False, {"logit_bias": [1, 2]}, "logit_bias"),
    (False, {"logprobs": 21}, "logprobs"),
    (False, {"logprobs": True}, "logprobs"),
    (False, {"prompt_logprobs": -1}, "prompt_logprobs"),
    (True, {"top_logprobs": 2}, "top_logprobs"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"logprobs": 1}, "logprobs"),
])
def test_bad_values_of_the_new_fields_name_them(chat, extra, param):
    body = (_body(True, "user", "x") if chat else {"prompt": "Hi"}) | extra
    with pytest.raises(APIError) as err:
        (protocol.parse_chat if chat else protocol.parse_completion)(body, STUB_MODEL)
    assert (err.value.status, err.value.param) == (400, param)


class _Entry:
    def __init__(self, token_id, logprob, rank, top):
        self.token_id, self.logprob, self.rank, self.top = token_id, logprob, rank, top


def test_logprob_shapes_are_openais_and_vllms():
    text = {1: "a", 2: "bc", 3: "d"}.__getitem__
    entries = [None, _Entry(2, -0.5, 1, ((2, -0.5), (3, -1.5))),
               _Entry(3, -float("inf"), 9, ((2, -0.1),))]
    legacy = protocol.completion_logprobs([1, 2, 3], entries, text)
    assert legacy == {"tokens": ["a", "bc", "d"], "token_logprobs": [None, -0.5, -9999.0],
                      "top_logprobs": [None, {"bc": -0.5, "d": -1.5},
                                       {"bc": -0.1, "d": -9999.0}],
                      "text_offset": [0, 1, 3]}
    chat = protocol.chat_logprobs(entries[1:2], text)["content"][0]
    assert chat == {"token": "bc", "logprob": -0.5, "bytes": [98, 99],
                    "top_logprobs": [{"token": "bc", "logprob": -0.5, "bytes": [98, 99]},
                                     {"token": "d", "logprob": -1.5, "bytes": [100]}]}
    shown = protocol.prompt_logprobs(entries[:2], text)
    assert shown == [None, {"2": {"logprob": -0.5, "rank": 1, "decoded_token": "bc"},
                            "3": {"logprob": -1.5, "rank": 2, "decoded_token": "d"}}]
    json.dumps(legacy, allow_nan=False)  # no -inf reaches the wire


class StubEngine:
    max_model_len = 2048
    loaded = None


@pytest.fixture(scope="module")
def stub_client():
    with serving(api_routes(lambda: StubEngine(), model_name=STUB_MODEL)) as url, \
            client_for(url) as c:
        yield c


@pytest.mark.parametrize(("chat", "field", "value"), [u for u in UNSUPPORTED if "." not in u[1]])
def test_the_openai_client_sees_the_400_and_its_param(stub_client, chat, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            stub_client.chat.completions.create(
                model=STUB_MODEL, messages=[{"role": "user", "content": "Hi"}],
                extra_body={field: value})
        else:
            stub_client.completions.create(model=STUB_MODEL, prompt="Hi",
                                           extra_body={field: value})
    assert err.value.param == field


# ---- a real engine ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(url):
    with client_for(url) as c:
        yield c


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax of its logits at every position of `ids`."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.model
def test_echo_and_logprobs_as_lm_eval_harness_reads_them(url, name, loaded, hf_model):
    """lm-evaluation-harness's loglikelihood request: token-id prompts in one batch,
    echo, logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1] and checks each
    against max(top_logprobs)."""
    prompts = [loaded.encode("The capital of France is Paris"),
               loaded.encode("Two plus two equals four")]
    body = {"model": name, "prompt": prompts, "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "echo": True, "seed": 1234}
    r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt and one new token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = hf_logprobs(hf_model, ids)
        want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert value in top.values() and len(top) <= 2
        new = lp["token_logprobs"][-1]
        assert new == pytest.approx(float(ref[-1].max()), abs=1e-4)  # greedy: the argmax
        assert choice["text"].startswith(loaded.decode(ids))
        assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.model
def test_chat_logprobs_and_top_logprobs_follow_the_model(client, name, loaded, hf_model):
    messages = [{"role": "user", "content": "Name a color."}]
    got = client.chat.completions.create(model=name, messages=messages, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 6
    ids = loaded.encode(messages)
    for item in content:  # transformers' greedy continuation, token by token
        row = hf_logprobs(hf_model, ids)[-1]
        top = [t.logprob for t in item.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert top == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert item.logprob == pytest.approx(top[0], abs=1e-6)  # greedy picks the best
        assert bytes(item.bytes).decode() == item.token
        ids.append(int(row.argmax()))


@pytest.mark.model
def test_streamed_logprobs_equal_the_whole_answers(url, name):
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "logprobs": 2}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S).json()
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True},
                      timeout=TIMEOUT_S) as r:
        events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    tokens, values = [], []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        if lp:
            tokens += lp["tokens"]
            values += lp["token_logprobs"]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert values == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


@pytest.mark.model
def test_a_list_of_prompts_answers_each_in_order_streamed_or_not(client, name, api_engine):
    prompts = ["The sky is", "My favourite food is", "Water boils at"]
    refs = api_engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    got = client.completions.create(model=name, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [r.text for r in refs]
    assert got.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert got.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    texts = ["", "", ""]
    finished = set()
    for chunk in client.completions.create(model=name, prompt=prompts, max_tokens=8,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == [r.text for r in refs] and finished == {0, 1, 2}


def test_n_and_best_of_reach_the_params():
    req = protocol.parse_completion({"prompt": "Hi", "n": 3, "best_of": 3}, STUB_MODEL)
    assert (req.n, req.params.n) == (3, 3)
    with pytest.raises(APIError) as err:
        protocol.parse_chat({"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                             "best_of": 4}, STUB_MODEL)
    assert err.value.param == "best_of" and "equal to n" in err.value.message


@pytest.mark.model
def test_n_choices_each_with_its_index_streamed_or_not(client, name, api_engine):
    prompt = "Once upon a time"
    seeded = [api_engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0,
                                                           seed=40 + i))[0] for i in range(3)]
    got = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=1.0,
                                    seed=40, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [r.text for r in seeded]  # choice i: seed + i
    assert got.usage.prompt_tokens == len(seeded[0].prompt_token_ids)  # the prompt once
    assert got.usage.completion_tokens == sum(len(r.token_ids) for r in seeded)
    texts, finished, usage = ["", "", ""], set(), None
    for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=8,
                                           temperature=1.0, seed=40, n=3, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == [r.text for r in seeded] and finished == {0, 1, 2}
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        got.usage.prompt_tokens, got.usage.completion_tokens)


@pytest.mark.model
def test_chat_n_choices_streamed_or_not(client, name):
    chat = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=name, messages=chat, max_tokens=6,
                                           temperature=0, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) == 1  # greedy: all the same
    single = client.chat.completions.create(model=name, messages=chat, max_tokens=6,
                                            temperature=0)
    assert whole.choices[2].message.content == single.choices[0].message.content
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    assert whole.usage.completion_tokens == 3 * single.usage.completion_tokens
    texts, reasons = ["", "", ""], {}
    for chunk in client.chat.completions.create(model=name, messages=chat, max_tokens=6,
                                                temperature=0, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == {c.index: c.finish_reason for c in whole.choices}


@pytest.mark.model
def test_n_with_a_list_of_prompts_orders_choices_prompt_major(client, name, api_engine):
    prompts = ["The sky is", "Water boils at"]
    refs = api_engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    got = client.completions.create(model=name, prompt=prompts, max_tokens=6, temperature=0,
                                    n=2, echo=True)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    want = [p + r.text for p, r in zip(prompts, refs, strict=True) for _ in range(2)]
    assert [c.text for c in got.choices] == want  # index = prompt index * n + candidate
    assert got.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert got.usage.completion_tokens == 2 * sum(len(r.token_ids) for r in refs)
    texts = [""] * 4
    for chunk in client.completions.create(model=name, prompt=prompts, max_tokens=6,
                                           temperature=0, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [r.text for r in refs for _ in range(2)]


SAMPLING = [
    {"repetition_penalty": 1.8},
    {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    {"logit_bias": {"13": 40.0}},  # a token pushed to the top
    {"frequency_penalty": 2.0, "logit_bias": {"198": -100}},
]


def _reference_text(hf_model, loaded, prompt: list[int], params: dict, n: int,
                    seed: int | None = None, temperature: float = 0.0) -> str:
    """Generate `n` tokens with transformers' logits and the reference sampling rules."""
    fields = dict(params)
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    p = SamplingParams(max_tokens=n, temperature=temperature, seed=seed, **fields)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
        processed = reference_process(logits, p, prompt, out)
        token = int(processed.argmax()) if gen is None else reference_draw(processed, gen)
        ids.append(token)
        out.append(token)
    return loaded.decode(out)


@pytest.mark.model
@pytest.mark.parametrize("params", SAMPLING, ids=lambda p: "+".join(p))
def test_penalties_and_logit_bias_choose_as_the_reference_greedy(client, name, loaded,
                                                                  hf_model, params):
    prompt = loaded.encode("List the days of the week: Monday, Tuesday,")
    got = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True} | params)
    assert got.choices[0].text == _reference_text(hf_model, loaded, prompt, params, 12)
    plain = client.completions.create(model=name, prompt=prompt, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].text != got.choices[0].text  # the parameter had an effect


@pytest.mark.model
@pytest.mark.parametrize("params", [{"min_p": 0.2}, {"min_p": 0.05, "presence_penalty": 1.0},
                                    {"repetition_penalty": 1.5, "logit_bias": {"13": 3.0}}],
                         ids=lambda p: "+".join(p))
def test_seeded_sampling_with_them_chooses_as_the_reference(client, name, loaded, hf_model,
                                                            params):
    prompt = loaded.encode("Write a word:")
    got = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.9,
                                    seed=7, extra_body={"ignore_eos": True} | params)
    want = _reference_text(hf_model, loaded, prompt, params, 8, seed=7, temperature=0.9)
    assert got.choices[0].text == want


@pytest.mark.model
def test_tokenize_and_detokenize_as_vllms_server(url, name, loaded):
    r = httpx.post(url + "/tokenize", json={"model": name, "prompt": "Hello world"},
                   timeout=TIMEOUT_S)
    assert r.status_code == 200
    out = r.json()
    assert out["tokens"] == loaded.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] > 0
    chat = [{"role": "user", "content": "Hi"}]
    r = httpx.post(url + "/tokenize", json={"messages": chat, "return_token_strs": True},
                   timeout=TIMEOUT_S).json()
    assert r["tokens"] == loaded.encode(chat) and len(r["token_strs"]) == r["count"]
    back = httpx.post(url + "/detokenize", json={"tokens": out["tokens"]}, timeout=TIMEOUT_S)
    assert back.json() == {"prompt": "Hello world"}
    for path, body, param in [("/tokenize", {"prompt": ""}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {}, "tokens"),
                              ("/detokenize", {"tokens": [1], "model": "gpt-x"}, "model")]:
        r = httpx.post(url + path, json=body, timeout=TIMEOUT_S)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


@pytest.mark.model
def test_chat_template_kwargs_reach_the_models_template(url, name, loaded, client, caplog):
    """vLLM's `chat_template_kwargs` are the template's variables, over both routes that
    apply it; a template failing on them is a 400 naming the field. (The bundled model's
    template takes none, so this swaps in one that does, for the test's length.) A field
    the server does not know is named in its log."""
    tokenizer = loaded.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if persona is defined %} as {{ persona }}{% endif %}")
    chat, kwargs = [{"role": "user", "content": "Say hello"}], {"persona": "a pirate"}
    try:
        def tokens(extra: dict) -> list[int]:
            r = httpx.post(url + "/tokenize", json={"messages": chat} | extra,
                           timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        themed = tokens({"chat_template_kwargs": kwargs})
        assert themed == loaded.encode(chat, kwargs) != tokens({})
        assert tokenizer.decode(themed) == "Say hello as a pirate"
        got = client.chat.completions.create(
            model=name, messages=chat, max_tokens=1,
            extra_body={"chat_template_kwargs": kwargs, "frobnicate": 1})
        assert got.usage.prompt_tokens == len(themed)
        assert ("/v1/chat/completions: fields ignored (unknown here): frobnicate"
                in caplog.messages)
        tokenizer.chat_template = "{{ persona.title() }}{{ messages[0]['content'] }}"
        bad = {"chat_template_kwargs": {"persona": 7}}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=name, messages=chat, max_tokens=1,
                                           extra_body=bad)
        assert err.value.param == "chat_template_kwargs"
        assert "the chat template failed" in err.value.message
        r = httpx.post(url + "/tokenize", json={"messages": chat} | bad, timeout=TIMEOUT_S)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "chat_template_kwargs")
    finally:
        tokenizer.chat_template = saved


@pytest.mark.model
def test_an_assistants_prefill_is_continued_in_place(url, name, loaded, client):
    """vLLM's `continue_final_message` with `add_generation_prompt: false`: the prompt
    ends inside the assistant's message (no end of turn, no new turn), on both routes that
    apply the template, and greedy decoding continues it as it would the same text."""
    chat = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "The colour is"}]
    prefill = {"add_generation_prompt": False, "continue_final_message": True}
    r = httpx.post(url + "/tokenize", json={"messages": chat} | prefill, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == loaded.encode(chat, prefill)
    text = loaded.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\nThe colour is"), text
    new_turn = loaded.encode(chat)  # the default: the message closed, a new turn opened
    assert len(new_turn) > len(ids) and new_turn[:len(ids)] == ids
    got = client.chat.completions.create(model=name, messages=chat, max_tokens=4,
                                         temperature=0, extra_body=prefill)
    assert got.usage.prompt_tokens == len(ids)
    same = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0)
    assert got.choices[0].message.content == same.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:  # both true, as vLLM refuses it
        client.chat.completions.create(model=name, messages=chat, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert err.value.param == "continue_final_message"


@pytest.mark.model
def test_vllms_allowed_tokens_stop_strings_and_truncation_over_http(url, name, loaded,
                                                                   client):
    """allowed_token_ids confine every token; include_stop_str_in_output keeps the stop
    string that ended the answer; truncate_prompt_tokens keeps the prompt's last k;
    bad_words bar a word; skip_special_tokens false keeps the special tokens' text."""
    ids = loaded.encode("The capital of France is Paris. The capital of Italy is")
    allowed = loaded.encode(" yes no")
    got = client.completions.create(model=name, prompt=ids, max_tokens=5, temperature=1.0,
                                    seed=3, extra_body={"allowed_token_ids": allowed,
                                                        "ignore_eos": True, "logprobs": 0})
    assert set(loaded.encode(got.choices[0].text)) <= set(allowed)
    free = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0)
    text = free.choices[0].text
    stop = text.strip()[:3]  # a stop string the greedy answer meets
    cut = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0,
                                    stop=[stop])
    kept = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0,
                                     stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == cut.choices[0].text + stop
    assert text.startswith(kept.choices[0].text)
    short = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 5})
    tail = client.completions.create(model=name, prompt=ids[-5:], max_tokens=4,
                                     temperature=0)
    assert short.usage.prompt_tokens == 5 and short.choices[0].text == tail.choices[0].text
    answer = free.choices[0].text.split()[0]  # the greedy answer's first word, barred
    barred = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"bad_words": [answer]})
    assert answer not in barred.choices[0].text.split() and barred.choices[0].text != text
    eos = loaded.tokenizer.eos_token_id
    ends = {"allowed_token_ids": [eos], "ignore_eos": True}  # two end-of-turn tokens
    bare = client.completions.create(model=name, prompt=ids, max_tokens=2, extra_body=ends)
    shown = client.completions.create(model=name, prompt=ids, max_tokens=2,
                                      extra_body=ends | {"skip_special_tokens": False})
    assert bare.choices[0].text == "" and bare.usage.completion_tokens == 2
    assert shown.choices[0].text == loaded.tokenizer.eos_token * 2
    r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": "Hi",
                   "allowed_token_ids": [10**6]}, timeout=TIMEOUT_S)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "allowed_token_ids")


@pytest.mark.model
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(url, name, loaded, client):
    """vLLM's `return_tokens_as_token_ids`: every token in the log-probabilities, top ones
    included, is "token_id:N" with the very id sampled; the answer's text is unchanged."""
    msgs = [{"role": "user", "content": "Say hi."}]
    plain = client.chat.completions.create(model=name, messages=msgs, max_tokens=4,
                                           temperature=0, logprobs=True, top_logprobs=2)
    ids = client.chat.completions.create(model=name, messages=msgs, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"return_tokens_as_token_ids": True})
    assert ids.choices[0].message.content == plain.choices[0].message.content
    got = [int(e.token.removeprefix("token_id:")) for e in ids.choices[0].logprobs.content]
    assert loaded.tokenizer.decode(got) == plain.choices[0].message.content
    assert all(t.token.startswith("token_id:") for e in ids.choices[0].logprobs.content
               for t in e.top_logprobs)
    r = httpx.post(url + "/v1/completions", json={
        "model": name, "prompt": "Hello", "max_tokens": 2, "logprobs": 1, "stream": True,
        "return_tokens_as_token_ids": True}, timeout=TIMEOUT_S)
    tokens = [t for line in r.text.split("\n\n") if line.startswith("data: {")
              for t in (json.loads(line[6:])["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert len(tokens) == 2 and all(t.startswith("token_id:") for t in tokens)


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]


@pytest.mark.model
def test_return_token_ids_gives_the_prompts_and_each_choices_ids_as_vllm(url, name, loaded):
    """vLLM's `return_token_ids`: whole, a completion's choices carry `prompt_token_ids`
    and `token_ids`, a chat's `token_ids` with the prompt's at the top level; streamed, the
    prompt's come once per choice (a chat's once, in its first chunk) and the chunks' ids
    add up to the whole answer's. The ids are the very tokens: they decode to the text."""
    prompt = "The capital of France is"
    body = {"model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2,
            "return_token_ids": True}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S).json()
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == loaded.encode(prompt)
        assert len(c["token_ids"]) == whole["usage"]["completion_tokens"] // 2
        assert loaded.tokenizer.decode(c["token_ids"]) == c["text"]
    events = _events(httpx.post(url + "/v1/completions", json=body | {"stream": True},
                                timeout=TIMEOUT_S))
    for i in range(2):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert [c["prompt_token_ids"] for c in mine if "prompt_token_ids" in c] == [
            loaded.encode(prompt)]
        assert sum((c["token_ids"] for c in mine), []) == whole["choices"][i]["token_ids"]
    msgs = [{"role": "user", "content": "Say hi."}]
    chat = {"model": name, "messages": msgs, "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    got = httpx.post(url + "/v1/chat/completions", json=chat, timeout=TIMEOUT_S).json()
    assert got["prompt_token_ids"] == loaded.encode(msgs)
    assert "prompt_token_ids" not in got["choices"][0]
    assert loaded.tokenizer.decode(got["choices"][0]["token_ids"],
                                   skip_special_tokens=True) == got["choices"][0]["message"][
                                       "content"]
    events = _events(httpx.post(url + "/v1/chat/completions", json=chat | {"stream": True},
                                timeout=TIMEOUT_S))
    assert [e.get("prompt_token_ids") for e in events][0] == loaded.encode(msgs)
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert sum((e["choices"][0].get("token_ids", []) for e in events if e["choices"]),
               []) == got["choices"][0]["token_ids"]
    plain = httpx.post(url + "/v1/completions", json=body | {"return_token_ids": False},
                       timeout=TIMEOUT_S).json()
    assert "token_ids" not in plain["choices"][0]


@pytest.mark.model
def test_a_cache_salt_shares_the_prefix_cache_only_within_its_tenant(url, name):
    """vLLM's cache_salt: the same prompt again hits the prefix cache under the same salt
    (usage.prompt_tokens_details.cached_tokens), and misses under another salt or none."""
    prompt = "Salted prefix check: " + " ".join(f"w{i}" for i in range(60))

    def cached(**salt) -> int:
        r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": prompt,
                       "max_tokens": 1} | salt, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached() > 0  # the unsalted request's own blocks
    r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": "Hi",
                   "cache_salt": ""}, timeout=TIMEOUT_S)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "cache_salt")


@pytest.mark.model
def test_continuous_usage_stats_count_the_tokens_in_every_chunk(name, client):
    """vLLM's `continuous_usage_stats`: every chunk carries the usage so far, counting up
    to the closing chunk's, over both candidates of n=2."""
    chunks = list(client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Count to five."}], n=2,
        max_tokens=6, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    made = [c.usage.completion_tokens for c in chunks]
    assert made == sorted(made) and made[0] == 0 and made[-1] == 12
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == (
        chunks[-1].usage.prompt_tokens + 12)
    assert [c.usage.completion_tokens for c in chunks if c.choices and
            c.choices[0].finish_reason][-1] == 12


@pytest.mark.model
def test_a_streamed_echo_sends_the_prompt_and_its_logprobs_first(url, name, loaded):
    ids = loaded.encode("The capital of France is")
    body = {"model": name, "prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 1, "ignore_eos": True}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S).json()
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True},
                      timeout=TIMEOUT_S) as r:
        events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    first = chunks[0]["choices"][0]
    assert first["text"] == loaded.decode(ids)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["token_logprobs"]) == len(ids)
    values = [v for c in chunks if c["choices"][0]["logprobs"]
              for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert values[1:] == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"][1:],
                                       abs=1e-6)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]
