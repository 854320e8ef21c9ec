"""Incremental detokenization and stop strings.

Decoding only a short window of recent tokens each time keeps the cost per token flat;
text ending in an incomplete UTF-8 character (U+FFFD) is held back until the next token
completes it, so Korean or emoji stream cleanly.

A fast (Rust) Hugging Face tokenizer runs that same algorithm in one call per token
(`tokenizers.decoders.DecodeStream`, ~1 us instead of two Python-wrapped decodes, ~6 us):
the engine detokenizes every running request each step, so this is on the step's
critical path. Other tokenizers take the Python path below.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # an older `tokenizers`: the Python path only
    DecodeStream = None


def _rust_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a fast tokenizer whose decode adds nothing to it
    (no clean-up of spaces), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or backend is None or not hasattr(backend, "id_to_token"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None,
                 include_stop: bool = False, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self.stop = stop or []
        self.include_stop = include_stop  # the stop string that ends the text stays in it
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._emitted = 0
        self.stopped = False
        self._backend = _rust_backend(tokenizer)
        self.skip_special = skip_special  # special tokens (an end of turn) add no text
        self._stream = (DecodeStream(skip_special_tokens=skip_special) if self._backend
                        else None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> None:
        """Append one token; update `text`; set `stopped` when a stop string appears."""
        self.token_ids.append(token_id)
        if self._stream is not None:
            new = self._stream.step(self._backend, token_id)
            if new:
                self.text += new
                if self.stop:
                    self._check_stop(len(new))
            return
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.text += new
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            if self.stop:
                self._check_stop(len(new))

    def _check_stop(self, new_len: int) -> None:
        start = max(len(self.text) - new_len - self._hold, 0)
        cut, found = -1, ""
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (cut == -1 or i < cut):
                cut, found = i, s
        if cut != -1:
            self.text = self.text[: cut + len(found) if self.include_stop else cut]
            self.stopped = True

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out; keeps back a possible partial stop string."""
        if not self._hold:  # no stop strings longer than one character: all of it
            out = self.text[self._emitted :]
            self._emitted = len(self.text)
            return out
        end = len(self.text) if (final or self.stopped) else max(len(self.text) - self._hold, 0)
        end = max(end, self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
