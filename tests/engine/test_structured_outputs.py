"""Structured outputs in the engine: float32 greedy answers under a grammar equal a plain
reference (transformers' logits, a fresh xgrammar matcher per token, the argmax of what
it allows), on both sides and through speculative decoding, chunked prefill, preemption
and parallel sampling; a grammar matcher rolls back to any history it is asked for."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from engine import Engine, EngineConfig, SamplingParams
from engine.config import StructuredOutput
from engine.grammar import Grammars, Matcher, _allow_only, choice_grammar, mask_rows

pytestmark = pytest.mark.model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CASES = {
    "json": (StructuredOutput("json", json.dumps(SCHEMA)), ASK),
    "regex": (StructuredOutput("regex", PHONE),
              [{"role": "user", "content": "Give me a phone number."}]),
    "choice": (StructuredOutput("choice", ("Paris", "Rome", "Berlin")),
               [{"role": "user", "content": "What is the capital of Italy?"}]),
}
MAX_NEW = 40
# n-grams from one token up, so JSON's repeated punctuation gets drafts (some rejected)
SPEC = dict(speculative="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
            prompt_lookup_max=3)


def reference_greedy(hf_model, loaded, prompt_ids: list[int], so: StructuredOutput) -> list[int]:
    """Greedy decoding under `so` the plain way: each token, the full forward in
    transformers and a matcher built afresh from the whole output so far."""
    grammars = Grammars(loaded.tokenizer, loaded.model.arch.vocab_size, loaded.eos_token_ids)
    compiled = grammars.compile(so)
    out: list[int] = []
    for _ in range(MAX_NEW):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt_ids + out])).logits[0, -1].float()[None]
        matcher = xgr.GrammarMatcher(compiled)
        for t in out:
            assert matcher.accept_token(t)
        bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
        token = int(logits.argmax())
        out.append(token)
        if token in loaded.eos_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def references(loaded, hf_model) -> dict[str, list[int]]:
    return {k: reference_greedy(hf_model, loaded, loaded.encode(msgs), so)
            for k, (so, msgs) in CASES.items()}


def _run(loaded, config: EngineConfig, n: int = 1) -> tuple[dict, object]:
    with Engine(config, loaded=loaded) as engine:
        outs = engine.generate([msgs for _, msgs in CASES.values()],
                               [SamplingParams(max_tokens=MAX_NEW, structured=so, n=n)
                                for so, _ in CASES.values()])
        return dict(zip(CASES, outs, strict=True)), engine.stats()


def test_greedy_answers_follow_their_grammar_and_equal_the_reference(loaded, references):
    outs, stats = _run(loaded, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64))
    for kind, out in outs.items():
        assert out.token_ids == references[kind], kind
        assert out.finish_reason == "stop", (kind, out.text)
    person = json.loads(outs["json"].text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(PHONE, outs["regex"].text)
    assert outs["choice"].text in CASES["choice"][0].spec
    assert stats.kv.used_blocks == 0


@pytest.mark.parametrize(("case", "cfg"), [
    ("speculation and preemption", dict(block_size=8, num_kv_blocks=14, **SPEC)),
    ("speculation and chunked prefill", dict(max_num_batched_tokens=16, num_kv_blocks=64,
                                             **SPEC)),
])
def test_drafts_rollbacks_and_recomputes_keep_the_same_answers(loaded, references, case,
                                                               cfg):
    outs, stats = _run(loaded, EngineConfig(device="cpu", dtype="float32", **cfg))
    assert {k: o.token_ids for k, o in outs.items()} == references
    spec = stats.spec_decode
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0  # accepted and rolled back
    assert stats.kv.used_blocks == 0
    if "preemption" in case:
        assert stats.num_preemptions > 0


def test_every_greedy_candidate_and_the_local_pc_give_the_same_answer(loaded, references):
    outs, _ = _run(loaded, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64), n=3)
    for kind, out in outs.items():
        assert [c.token_ids for c in out.candidates] == [references[kind]] * 3
    from engine.local import LocalPC

    with LocalPC(loaded, n_ctx=512) as local:
        so, msgs = CASES["json"]
        got = local.generate([msgs], SamplingParams(max_tokens=MAX_NEW, structured=so))[0]
    assert got.token_ids == references["json"]


def test_sampled_candidates_each_follow_the_schema(loaded):
    so, msgs = CASES["json"]
    with Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64),
                loaded=loaded) as engine:
        out = engine.generate([msgs], SamplingParams(max_tokens=80, temperature=1.0, seed=3,
                                                     n=4, structured=so))[0]
    texts = [c.text for c in out.candidates]
    assert len(set(texts)) > 1, texts
    for c in out.candidates:
        if c.finish_reason == "stop":
            person = json.loads(c.text)
            assert set(person) == {"name", "age"}, c.text
        else:  # cut by max_tokens: still a prefix the grammar allows
            assert Matcher(_grammars(loaded).compile(so)).follow(c.token_ids)


def _grammars(loaded) -> Grammars:
    return Grammars(loaded.tokenizer, loaded.model.arch.vocab_size, loaded.eos_token_ids)


def test_a_spec_that_does_not_compile_is_refused_before_it_runs(loaded):
    with Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64),
                loaded=loaded) as engine:
        for so, words in ((StructuredOutput("regex", "(a"), "regular expression"),
                          (StructuredOutput("json", '{"type": "objec"}'), "JSON schema"),
                          (StructuredOutput("grammar", "root ::= nope"), "grammar")):
            with pytest.raises(ValueError, match=f"^structured: the {words} does not compile"):
                engine.submit("Hi", SamplingParams(structured=so))
        assert engine.generate(["Hi"], SamplingParams(max_tokens=2))[0].token_ids
        assert engine.stats().kv.used_blocks == 0


# ---- the matcher alone, on the bundled tokenizer ------------------------------------------
def _mask(matcher: Matcher, vocab: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    assert matcher.fill(bitmask, 0)
    return bitmask


def test_a_matcher_rolls_back_to_any_history_it_is_asked_for(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tok)
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    compiled = grammars.compile(StructuredOutput("json", json.dumps(SCHEMA)))
    one = tok.encode('{"name": "Ann", "age": 4', add_special_tokens=False)
    other = tok.encode('{"name": "Bob", "age": 71', add_special_tokens=False)
    m = Matcher(compiled)
    assert m.follow(one) and m.accepted == one
    assert m.follow(other) and m.accepted == other  # rolled back to '{"name": "' and on
    fresh = Matcher(compiled)
    assert fresh.follow(other)
    assert torch.equal(_mask(m, vocab), _mask(fresh, vocab))
    bad = other + tok.encode("]", add_special_tokens=False)
    assert not m.follow(bad) and m.accepted == other  # refused: stays at the last it took
    assert m.follow(one[:3]) and torch.equal(_mask(m, vocab),
                                             _mask(_fresh(compiled, one[:3]), vocab))


def _fresh(compiled, history: list[int]) -> Matcher:
    m = Matcher(compiled)
    assert m.follow(history)
    return m


def test_choices_are_escaped_literals(tokenizer_dir):
    assert choice_grammar(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiled = Grammars(tok, len(tok), [tok.eos_token_id]).compile(
        StructuredOutput("choice", ('say "hi"', "a\\b")))
    assert Matcher(compiled).follow(tok.encode('say "hi"', add_special_tokens=False))
    assert not Matcher(compiled).follow(tok.encode("say hi", add_special_tokens=False))


def test_a_grammar_that_allows_nothing_is_refused_and_a_dead_end_ends_the_answer(
        tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    with pytest.raises(ValueError, match="^structured: the grammar allows no answer"):
        grammars.compile(StructuredOutput("grammar", "root ::= root"))
    # a row whose mask would bar every token (a matcher whose fill bars all, by hand)
    # allows only the end of text instead
    compiled = grammars.compile(StructuredOutput("regex", "ab"))
    m = Matcher(compiled)
    logits = torch.zeros(1, len(tok))
    m._matcher.fill_next_token_bitmask = lambda bitmask, row: bitmask[row].zero_()
    mask_rows(logits, [m], [[]])
    assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [tok.eos_token_id]
    for t in (31, 63, 5):  # the sign bit of an int32 word, and a low one
        row = torch.full((len(tok) // 32 + 1,), -1, dtype=torch.int32)
        _allow_only(row, [t])
        x = torch.zeros(1, len(tok))
        xgr.apply_token_bitmask_inplace(x, row[None], vocab_size=len(tok))
        assert (x[0] > float("-inf")).nonzero().flatten().tolist() == [t]


def test_the_compiled_grammars_kept_are_the_latest_few(tokenizer_dir, monkeypatch):
    import engine.grammar as grammar

    monkeypatch.setattr(grammar, "CACHED_GRAMMARS", 3)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    specs = [StructuredOutput("regex", f"a{{{i}}}") for i in range(1, 6)]
    compiled = [grammars.compile(so) for so in specs]
    assert list(grammars._cache) == specs[2:]
    assert grammars.compile(specs[2]) is compiled[2]  # kept, and now the latest
    grammars.compile(specs[0])
    assert list(grammars._cache) == [specs[4], specs[2], specs[0]]  # the oldest went
