"""Beam search (vLLM's `use_beam_search`): the search against an exhaustive one on a
small stand-in model, the fields it refuses, then the bundled model over HTTP against a
beam search on transformers' own logits."""

from __future__ import annotations

import itertools
import math
import threading

import httpx
import pytest
import torch
from http_server import serving
from polling import wait_for

from engine import Engine, EngineConfig
from engine.outputs import RequestOutput
from engine.sequence import TokenLogprob
from server import beam, protocol
from server.errors import APIError
from server.routes import api_routes

MODEL = "stub-model"
END = 0  # the stand-in's end-of-text token
VOCAB = (0, 1, 2)


def stand_in_logprobs(tokens: list[int]) -> dict[int, float]:
    """A fixed next-token distribution over VOCAB for every sequence: no model."""
    weights = [(7 * len(tokens) + 3 * sum(tokens) + 5 * t) % 11 + 1 for t in VOCAB]
    total = sum(weights)
    return {t: math.log(w / total) for t, w in zip(VOCAB, weights, strict=True)}


class FakeEngine:
    """Stands in for `Engine.submit_many`: every request finished at once, its token's top
    log-probabilities from `stand_in_logprobs`."""

    def __init__(self) -> None:
        self.steps = 0

    def submit_many(self, prompts, params) -> list[FinishedHandle]:
        self.steps += 1
        handles = []
        for prompt, p in zip(prompts, params, strict=True):
            top = sorted(stand_in_logprobs(prompt).items(), key=lambda kv: -kv[1])[:p.logprobs]
            handles.append(FinishedHandle(RequestOutput(
                request_id="r", prompt_token_ids=list(prompt), token_ids=[top[0][0]], text="",
                finish_reason="length", metrics=None,
                logprobs=[TokenLogprob(top[0][0], top[0][1], 1, tuple(top))])))
        return handles


class FinishedHandle:
    """What `beam.search` reads of a `RequestHandle`: its result."""

    def __init__(self, out: RequestOutput) -> None:
        self.out = out

    def result(self) -> RequestOutput:
        return self.out


def exhaustive(prompt: list[int], max_tokens: int, penalty: float) -> list[beam.Beam]:
    """Every continuation: those ended by END, and those of max_tokens tokens."""
    found = []
    for n in range(1, max_tokens + 1):
        for seq in itertools.product(VOCAB, repeat=n):
            if END in seq[:-1] or (n < max_tokens and seq[-1] != END):
                continue
            logprob = sum(stand_in_logprobs(prompt + list(seq[:i]))[t] for i, t in enumerate(seq))
            found.append(beam.Beam(seq, logprob, finished=seq[-1] == END))
    return sorted(found, key=lambda b: b.score(len(prompt), penalty), reverse=True)


@pytest.mark.parametrize("penalty", [0.0, 1.0, 2.0])
def test_a_beam_wide_enough_for_every_path_is_the_exhaustive_search(penalty):
    prompt, engine = [1, 2, 1], FakeEngine()
    got = beam.search(engine.submit_many, prompt, width=9, max_tokens=2,
                      length_penalty=penalty, end_ids=frozenset({END}))
    want = exhaustive(prompt, 2, penalty)[:9]
    assert [(b.token_ids, b.finished) for b in got] == [(b.token_ids, b.finished) for b in want]
    assert [round(b.logprob, 9) for b in got] == [round(b.logprob, 9) for b in want]
    assert engine.steps == 2


def test_a_narrow_beam_keeps_the_best_of_each_step_and_ignore_eos_runs_on():
    prompt, engine = [2], FakeEngine()
    got = beam.search(engine.submit_many, prompt, width=1, max_tokens=4)  # no end tokens
    tokens: list[int] = []
    for _ in range(4):  # width 1 with no end token: greedy on the stand-in
        probs = stand_in_logprobs(prompt + tokens)
        tokens.append(max(probs, key=probs.get))
    assert [b.token_ids for b in got] == [tuple(tokens)] and not got[0].finished


def test_a_search_stops_between_steps_once_cancelled():
    gone = threading.Event()
    gone.set()
    with pytest.raises(beam.Cancelled):
        beam.search(FakeEngine().submit_many, [1], width=2, max_tokens=3, cancelled=gone)
    with pytest.raises(ValueError, match=r"beam width \(n\) must be in \[1, 10\]"):
        beam.search(FakeEngine().submit_many, [1], width=11, max_tokens=3)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"length_penalty": 2}, "length_penalty", "needs beam search"),
    ({"use_beam_search": True, "n": 11}, "n", "at most 10 beams"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p", "beam search does not take it"),
    ({"use_beam_search": True, "stop": ["."]}, "stop", "beam search does not take it"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs", "beam search does not take it"),
    ({"use_beam_search": True, "bad_words": ["x"]}, "bad_words", "beam search does not take"),
    ({"use_beam_search": True, "response_format": {"type": "json_object"}},
     "response_format", "beam search does not take it"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature",
     "temperature does not change"),
    ({"use_beam_search": "yes"}, "use_beam_search", "use_beam_search must be"),
])
def test_what_beam_search_cannot_honour_is_a_400_naming_it(body, param, words):
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"prompt": "Hi"} | body, MODEL)
    assert (err.value.status, err.value.param) == (400, param)
    assert words in err.value.message, err.value.message


def test_a_chats_forced_tool_call_cannot_be_beam_searched():
    tool = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(APIError) as err:
        protocol.parse_chat({"messages": [{"role": "user", "content": "Hi"}],
                             "use_beam_search": True, "tools": [tool],
                             "tool_choice": "required"}, MODEL)
    assert err.value.param == "tool_choice"
    req = protocol.parse_chat({"messages": [{"role": "user", "content": "Hi"}], "n": 3,
                               "use_beam_search": True, "length_penalty": 0.5}, MODEL)
    assert req.beam_search and req.length_penalty == 0.5 and req.params.n == 3


# ---- the bundled model over HTTP ---------------------------------------------------------
def hf_beam_search(hf_model, prompt: list[int], width: int, max_tokens: int,
                   penalty: float, end_ids: frozenset[int]) -> list[tuple[int, ...]]:
    """The same search written plainly on transformers' float32 logits."""
    beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    finished: list[tuple[tuple[int, ...], float]] = []

    def score(item) -> float:
        tokens, logprob = item
        length = len(prompt) + len(tokens) - (1 if tokens and tokens[-1] in end_ids else 0)
        return logprob / length ** penalty

    for _ in range(max_tokens):
        grown = []
        for tokens, logprob in beams:
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + list(tokens)])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                child = (tokens + (t,), logprob + lp)
                (finished if t in end_ids else grown).append(child)
        beams = sorted(grown, key=score, reverse=True)[:width]
    return [t for t, _ in sorted(finished + beams, key=score, reverse=True)[:width]]


@pytest.mark.model
def test_the_served_beams_are_transformers_beams(url, name, loaded, hf_model, api_engine):
    prompt = "The three primary colors are"
    ids = loaded.encode(prompt)
    for penalty in (1.0, 0.0):
        r = httpx.post(f"{url}/v1/completions", json={
            "model": name, "prompt": prompt, "max_tokens": 6, "n": 3, "return_token_ids": True,
            "use_beam_search": True, "length_penalty": penalty}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        want = hf_beam_search(hf_model, ids, 3, 6, penalty, loaded.eos_token_ids)
        got = [c["text"] for c in body["choices"]]
        assert got == [loaded.decode(list(t)) for t in want]
        assert [tuple(c["token_ids"]) for c in body["choices"]] == want
        assert body["choices"][0]["prompt_token_ids"] == ids
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == sum(len(t) for t in want)
    assert api_engine.stats(steps_after=None).kv.used_blocks == 0


@pytest.mark.model
def test_a_streamed_search_sends_the_same_beams_whole(client, name):
    """As vLLM's server streams it: the search ends first, then each beam in one chunk."""
    kwargs = dict(model=name, prompt="The capital of France is", max_tokens=5, n=3,
                  extra_body={"use_beam_search": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={
        "include_usage": True}, **kwargs))
    texts, reasons = {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert [reasons[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Name a fruit."}], n=2,
        max_tokens=8, stream=True, extra_body={"use_beam_search": True})
    said = {}
    for chunk in chat:
        for choice in chunk.choices:
            said[choice.index] = said.get(choice.index, "") + (choice.delta.content or "")
    assert len(said) == 2 and all(said.values())


@pytest.mark.model
def test_a_chat_is_beam_searched_through_the_official_client(client, name):
    got = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Name a fruit."}], n=2,
        max_tokens=10, extra_body={"use_beam_search": True})
    assert len(got.choices) == 2 and all(c.message.content for c in got.choices)
    assert got.choices[0].message.content != got.choices[1].message.content
    assert {c.finish_reason for c in got.choices} <= {"stop", "length"}


@pytest.mark.model
def test_a_client_gone_mid_search_stops_it_and_frees_every_block(url, name, api_engine):
    def stats():
        return api_engine.stats(steps_after=None)

    before = stats().num_steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={
            "model": name, "prompt": "Tell me a long story.", "max_tokens": 2000, "n": 4,
            "use_beam_search": True, "ignore_eos": True}, timeout=1.5)
    assert stats().num_steps > before  # it was searching when the client left
    seen = [-1]

    def stopped() -> bool:
        """No engine step over the last 25 polls: a search steps every few ms."""
        seen.append(stats().num_steps)
        return len(seen) > 25 and len(set(seen[-25:])) == 1

    wait_for(stopped, 60, "the beam search went on after its client left")
    assert stats().num_running == 0 and stats().kv.used_blocks == 0


@pytest.mark.model
def test_an_engine_shut_down_mid_search_is_a_503(loaded):
    """The search's step requests end cancelled (or the engine refuses the next step):
    the client gets a 503 naming the engine, not a 500."""
    engine = Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128),
                    loaded=loaded)
    try:
        with serving(api_routes(lambda: engine, model_name=loaded.name)) as url:
            answer: dict = {}

            def ask() -> None:
                answer["r"] = httpx.post(f"{url}/v1/completions", json={
                    "prompt": "Tell me a long story.", "max_tokens": 2000, "n": 4,
                    "use_beam_search": True, "ignore_eos": True}, timeout=60)

            asking = threading.Thread(target=ask)
            asking.start()
            wait_for(lambda: engine.stats(steps_after=None).num_steps > 3, 30,
                     "the search never stepped")
            engine.shutdown()
            asking.join(60)
        r = answer["r"]
        assert r.status_code == 503, r.text
        assert "not serving" in r.json()["error"]["message"] or "cancelled" in (
            r.json()["error"]["message"])
    finally:
        engine.shutdown()
