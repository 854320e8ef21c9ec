"""The one streaming client (server.stream_client) that the remote side and the load
generator share: its event decoder, its record of a stream and its request body."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from measure.bench.serve import LoadRequest, request_body
from server import stream_client
from server.stream_client import SSEDecoder, StreamRecord


def decode(*reads: bytes) -> list[tuple[str, str]]:
    dec = SSEDecoder()
    out = [event for raw in reads for event in dec.feed(raw)]
    return out + dec.close()


def test_events_split_anywhere_across_reads_come_out_whole():
    wire = (b'data: {"a": 1}\n\nevent: error\ndata: {"error": "x"}\n\n: a comment\n'
            b"id: 7\nretry: 10\ndata: [DONE]\n\n")
    want = [("message", '{"a": 1}'), ("error", '{"error": "x"}'), ("message", "[DONE]")]
    assert decode(wire) == want
    for cut in range(1, len(wire)):  # every split of the bytes between two reads
        assert decode(wire[:cut], wire[cut:]) == want
    assert decode(*(wire[i:i + 1] for i in range(len(wire)))) == want  # a byte per read


def test_crlf_cr_multiline_data_and_utf8_split_across_reads():
    assert decode(b"data: a\r\ndata: b\r\n\r\ndata: c\r\rdata: d\n\n") == [
        ("message", "a\nb"), ("message", "c"), ("message", "d")]
    text = "données ☕".encode()
    assert decode(b"data: " + text[:8], text[8:] + b"\n\n") == [("message", "données ☕")]
    assert decode(b"data: x\r", b"\ndata: y\r\n\r\n") == [("message", "x\ny")]


def test_an_unterminated_last_event_is_given_at_the_end_and_nothing_else_is_invented():
    assert decode(b"data: tail") == [("message", "tail")]
    assert decode(b"event: error\n\n", b"\n\n") == []  # no data: no event
    assert decode(b"") == []


def test_a_record_counts_tokens_from_usage_never_fewer_than_chunks():
    rec = StreamRecord(chunk_times=[1.0, 2.0], texts=["a", "b"])
    assert (rec.text, rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == ("ab", 2, 0, 0)
    assert rec.token_times() == [1.0, 2.0]
    rec.usage = {"completion_tokens": 4, "prompt_tokens": 9,
                 "prompt_tokens_details": {"cached_tokens": 3}}
    assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == (4, 9, 3)
    assert rec.token_times() == [1.0, 2.0, 2.0, 2.0]  # the last chunk stands for the rest
    rec.usage = {"completion_tokens": 1}
    assert rec.output_tokens == 2
    assert StreamRecord(usage={"completion_tokens": 3}).token_times() == []


@pytest.mark.parametrize("endpoint,prompt", [("chat", "Hi there"),
                                             ("completions", (5, 6, 7))])
def test_the_load_generator_builds_the_remote_sides_body(endpoint, prompt):
    sent = stream_client.request_body("m", endpoint, prompt if isinstance(prompt, str) else list(prompt),
                     SamplingParams(max_tokens=9, ignore_eos=True))
    assert request_body("m", LoadRequest(prompt, 9), endpoint, True, 0.0) == sent
    assert sent["stream_options"] == {"include_usage": True} and sent["ignore_eos"] is True
    with pytest.raises(ValueError, match="prompt: the chat API takes text"):
        request_body("m", LoadRequest((1, 2), 9), "chat", False, 0.0)


def test_every_sampling_field_that_is_set_goes_out_and_none_is_dropped():
    p = SamplingParams(max_tokens=9, presence_penalty=0.5, frequency_penalty=-1.0,
                       repetition_penalty=1.2, logit_bias={13: -100.0}, min_p=0.1)
    sent = stream_client.request_body("m", "chat", "Hi", p)
    assert {k: sent[k] for k in ("presence_penalty", "frequency_penalty",
                                 "repetition_penalty", "logit_bias", "min_p")} == {
        "presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.2,
        "logit_bias": {"13": -100.0}, "min_p": 0.1}
    plain = stream_client.request_body("m", "chat", "Hi", SamplingParams(max_tokens=9))
    assert not {"presence_penalty", "repetition_penalty", "logit_bias", "min_p"} & set(plain)
    for field, value in [("n", 2), ("logprobs", 0), ("prompt_logprobs", 1)]:
        with pytest.raises(ValueError, match=rf"^{field}: a remote endpoint"):
            stream_client.request_body("m", "chat", "Hi", SamplingParams(**{field: value}))
