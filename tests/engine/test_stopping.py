"""engine.outputs.append_token without a model: which token ends a request, and why.

Finish reasons, as vLLM's: "stop" for EOS, a stop token id or a stop string; "length" for
max_tokens or the context limit. (SamplingParams has no min_tokens: not tested.)
"""

from __future__ import annotations

import pytest

from engine.config import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.metrics import RequestMetrics
from engine.outputs import append_token, make_output
from engine.sequence import Sequence

EOS = 2
EOS_IDS = frozenset({EOS})
PROMPT = [1, 10, 11, 12]


class FakeTokenizer:
    """Stand-in tokenizer (unit tests only): token i >= 3 is the letter chr(ord('a') + i - 3),
    ids 0-2 are special tokens and decode to nothing."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i - 3) for i in ids if i >= 3)


def tok(letter: str) -> int:
    return ord(letter) - ord("a") + 3


def request(**params) -> tuple[Sequence, IncrementalDetokenizer]:
    p = SamplingParams(**params)
    seq = Sequence("r0", list(PROMPT), p, RequestMetrics(arrival_time=0.0))
    return seq, IncrementalDetokenizer(FakeTokenizer(), p.stop)


def feed(seq: Sequence, detok: IncrementalDetokenizer, tokens: list[int],
         max_model_len: int = 1000) -> list[str | None]:
    """The finish reason after each token, stopping at the first one."""
    reasons: list[str | None] = []
    for t, token in enumerate(tokens, start=1):
        reasons.append(append_token(seq, token, float(t), detok, EOS_IDS, max_model_len))
        if reasons[-1]:
            break
    return reasons


def test_every_token_is_recorded_with_its_time_and_text() -> None:
    seq, detok = request()
    assert feed(seq, detok, [tok("h"), tok("i")]) == [None, None]
    assert seq.output_token_ids == [tok("h"), tok("i")]
    assert seq.metrics.token_times == [1.0, 2.0]
    assert detok.text == "hi"


def test_eos_stops_and_adds_no_text() -> None:
    seq, detok = request()
    assert feed(seq, detok, [tok("o"), tok("k"), EOS, tok("x")]) == [None, None, "stop"]
    assert seq.output_token_ids == [tok("o"), tok("k"), EOS]  # EOS counts as output
    assert detok.text == "ok" and len(seq.metrics.token_times) == 3


def test_ignore_eos_runs_on_to_max_tokens() -> None:
    seq, detok = request(ignore_eos=True, max_tokens=4)
    assert feed(seq, detok, [EOS, tok("a"), EOS, tok("b"), tok("c")]) == [
        None, None, None, "length"]
    assert seq.output_token_ids == [EOS, tok("a"), EOS, tok("b")]
    assert detok.text == "ab"


def test_a_stop_token_id_stops_even_with_ignore_eos() -> None:
    seq, detok = request(ignore_eos=True, stop_token_ids=[tok("z")])
    assert feed(seq, detok, [tok("a"), tok("z"), tok("b")]) == [None, "stop"]
    assert detok.text == "a"


def test_max_tokens_ends_with_length_at_exactly_that_many_tokens() -> None:
    seq, detok = request(max_tokens=3)
    assert feed(seq, detok, [tok("a")] * 10) == [None, None, "length"]
    assert len(seq.output_token_ids) == 3


def test_eos_on_the_last_allowed_token_is_a_stop_not_a_length() -> None:
    seq, detok = request(max_tokens=2)
    assert feed(seq, detok, [tok("a"), EOS]) == [None, "stop"]


def test_a_stop_string_stops_and_is_cut_from_the_text() -> None:
    seq, detok = request(stop=["cd"])
    assert feed(seq, detok, [tok(c) for c in "abcdef"]) == [None, None, None, "stop"]
    assert detok.text == "ab"
    assert len(seq.output_token_ids) == 4  # the tokens stay; only the text is cut


def test_the_context_limit_ends_with_length_before_max_tokens() -> None:
    seq, detok = request(max_tokens=100)
    limit = len(PROMPT) + 3
    assert feed(seq, detok, [tok("a")] * 10, max_model_len=limit) == [None, None, "length"]
    assert seq.num_tokens == limit


def test_the_output_of_a_finished_request_is_a_copy_with_its_reason() -> None:
    seq, detok = request(stop=["b"])
    assert feed(seq, detok, [tok("a"), tok("b")]) == [None, "stop"]
    seq.num_cached_tokens, seq.num_preemptions = 16, 1
    out = make_output(seq, detok, "stop")
    seq.output_token_ids.append(tok("c"))  # the engine's state moves on; the output does not
    assert out.request_id == "r0" and out.prompt_token_ids == PROMPT
    assert out.token_ids == [tok("a"), tok("b")] and out.text == "a"
    assert out.finish_reason == "stop" and out.error is None
    assert out.metrics is seq.metrics and out.metrics.token_times == [1.0, 2.0]
    assert (out.num_cached_tokens, out.num_preemptions) == (16, 1)
    failed = make_output(seq, detok, "error", error="device lost")
    assert failed.finish_reason == "error" and failed.error == "device lost"



def test_min_tokens_holds_off_eos_and_stop_ids_until_reached() -> None:
    """vLLM's min_tokens: EOS and stop token ids count only after that many tokens."""
    seq, detok = request(max_tokens=8, min_tokens=2, stop_token_ids=[tok("z")])
    assert feed(seq, detok, [EOS, tok("z"), EOS]) == [None, None, "stop"]


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
