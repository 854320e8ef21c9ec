"""engine.detokenizer without a model: deltas add up to the full decode, a character split
over several tokens waits until it is whole, and a stop string cuts the text."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer

EOS = 0


class FakeTokenizer:
    """Stand-in for a SentencePiece/byte-fallback tokenizer (unit tests only).

    Token ids index `pieces`: "▁" is a space, "<0xNN>" one raw byte, id 0 the special EOS.
    As Llama's tokenizer does, a decode drops the space at the start of its first piece, so
    decoding tokens one at a time would lose the spaces between words; bytes that end in an
    incomplete UTF-8 character decode to U+FFFD.
    """

    def __init__(self) -> None:
        self.pieces = ["</s>"]
        self.calls: list[int] = []  # how many ids each decode was given

    def encode(self, *pieces: str) -> list[int]:
        ids = []
        for p in pieces:
            if p not in self.pieces:
                self.pieces.append(p)
            ids.append(self.pieces.index(p))
        return ids

    def encode_bytes(self, text: str) -> list[int]:
        return self.encode(*(f"<0x{b:02X}>" for b in text.encode()))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        out = b""
        for i in ids:
            piece = self.pieces[i]
            if i == EOS:
                out += b"" if skip_special_tokens else piece.encode()
            elif piece.startswith("<0x"):
                out += bytes([int(piece[3:5], 16)])
            else:
                out += piece.replace("▁", " ").encode()
        text = out.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text


@pytest.fixture
def tok() -> FakeTokenizer:
    return FakeTokenizer()


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Every delta handed out while adding `ids` one at a time, then the final one."""
    out = []
    for i in ids:
        detok.add(i)
        out.append(detok.delta())
    out.append(detok.delta(final=True))
    return out


def test_deltas_join_to_the_full_decode_spaces_included(tok) -> None:
    ids = tok.encode("▁Hello", ",", "▁wor", "ld", "!", "▁How", "▁are", "▁you", "?")
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids) == "Hello, world! How are you?"
    assert deltas[:3] == ["Hello", ",", " wor"]  # text comes out token by token


def test_each_decode_sees_a_short_window_not_the_whole_text(tok) -> None:
    ids = tok.encode(*(["▁one", "▁two", "▁three"] * 40))
    detok = IncrementalDetokenizer(tok)
    tok.calls.clear()
    deltas = stream(detok, ids)
    window = max(tok.calls)
    assert "".join(deltas) == tok.decode(ids)
    assert window <= 2  # the previous token for context, and the new one


@pytest.mark.parametrize("char", ["한", "😀"])
def test_a_character_split_over_byte_tokens_waits_until_it_is_whole(tok, char) -> None:
    ids = tok.encode("▁say") + tok.encode_bytes(char) + tok.encode("▁ok")
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    n = len(char.encode())
    assert n > 1 and deltas[1:n] == [""] * (n - 1)  # nothing while the bytes are partial
    assert deltas[n] == char
    assert not any("\ufffd" in d for d in deltas) and "\ufffd" not in detok.text
    assert "".join(deltas) == detok.text == "say" + char + " ok"


def test_special_tokens_add_no_text(tok) -> None:
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, tok.encode("▁Hi", "!") + [EOS])
    assert deltas == ["Hi", "!", "", ""] and detok.text == "Hi!"


def test_special_tokens_keep_their_text_when_not_skipped(tok) -> None:
    detok = IncrementalDetokenizer(tok, skip_special=False)
    deltas = stream(detok, tok.encode("▁Hi", "!") + [EOS])
    assert deltas == ["Hi", "!", "</s>", ""] and detok.text == "Hi!</s>"


def test_a_stop_string_over_several_tokens_cuts_the_text_and_is_never_handed_out(tok) -> None:
    ids = tok.encode("▁The", "▁end", "EN", "D", "▁more")
    detok = IncrementalDetokenizer(tok, stop=["END"])
    deltas = []
    for i in ids:
        detok.add(i)
        deltas.append(detok.delta())
        if detok.stopped:
            break
    assert detok.stopped and len(deltas) == 4  # stopped at the token completing "END"
    assert detok.text == "The end"
    assert "".join(deltas) == "The end" and "E" not in "".join(deltas)


def test_text_that_only_begins_like_a_stop_string_is_handed_out_in_the_end(tok) -> None:
    detok = IncrementalDetokenizer(tok, stop=["END"])
    deltas = stream(detok, tok.encode("▁ab", "EN", "X"))
    assert not detok.stopped
    # the last len("END") - 1 characters wait until they cannot begin "END"
    assert deltas == ["", "ab", "E", "NX"] and detok.text == "abENX"


def test_the_earliest_stop_string_wins_and_text_after_it_in_the_token_is_dropped(tok) -> None:
    detok = IncrementalDetokenizer(tok, stop=["world", "lo"])
    deltas = stream(detok, tok.encode("▁hello▁world▁again"))
    assert detok.stopped and detok.text == "hel" and "".join(deltas) == "hel"


def test_include_stop_keeps_the_earliest_stop_string_and_drops_what_follows(tok) -> None:
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it,
    handed out whole when it stops."""
    detok = IncrementalDetokenizer(tok, stop=["world", "lo"], include_stop=True)
    deltas = stream(detok, tok.encode("▁hello▁world▁again"))
    assert detok.stopped and detok.text == "hello" and "".join(deltas) == "hello"


def test_a_stop_string_in_the_first_token_leaves_no_text(tok) -> None:
    detok = IncrementalDetokenizer(tok, stop=["\n"])
    detok.add(tok.encode("\n")[0])
    assert detok.stopped and detok.text == "" and detok.delta() == ""


def test_the_rust_decode_stream_gives_the_python_paths_deltas(tokenizer_dir) -> None:
    """A fast tokenizer detokenizes through `tokenizers`' DecodeStream, one call a token;
    its deltas equal the two-decode Python path's, Korean, emoji and specials included."""
    from engine.models import loader

    tok = loader.load_tokenizer(tokenizer_dir)
    text = "Hello, world! 한국어 텍스트 😀 and   spaces\n\nThe end."
    ids = [1] + tok(text, add_special_tokens=False)["input_ids"] + [2, 0, 300, 60000 % 49152]
    fast = IncrementalDetokenizer(tok, stop=["end."])
    slow = IncrementalDetokenizer(tok, stop=["end."])
    slow._stream = None  # force the Python path
    assert fast._stream is not None
    deltas = {}
    for name, detok in (("fast", fast), ("slow", slow)):
        out = []
        for i in ids:
            detok.add(i)
            out.append(detok.delta())
            if detok.stopped:
                break
        deltas[name] = out + [detok.delta(final=True)]
    assert deltas["fast"] == deltas["slow"]
    assert fast.stopped and fast.text == slow.text == "Hello, world! 한국어 텍스트 😀 and   spaces\n\nThe "
    unstopped = [IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)]
    unstopped[1]._stream = None
    assert stream(unstopped[0], ids) == stream(unstopped[1], ids)
