"""What a structured output costs a batch: the same requests answered plain, under a JSON
schema, as any JSON object and as one of three choices, by one engine on the bundled model.

`--users` requests arrive together (each its own prompt, so no prefix is shared), greedy,
`--max-tokens` tokens each with EOS ignored, so every run makes the same number of tokens
and only the grammar's masks differ (an answer whose grammar is complete goes on unmasked
past its end, as `ignore_eos` asks). Each run is timed `--rounds` times after a warm-up
that loads xgrammar and compiles the specs; the best round is printed, in output tokens/s
and against the plain run.

    PYTHONPATH=. python scripts/structured_bench.py [--users 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

from engine import Engine, EngineConfig, SamplingParams
from engine.config import StructuredOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
KINDS = {
    "plain": None,
    "JSON schema": StructuredOutput("json", json.dumps(SCHEMA)),
    "any JSON object": StructuredOutput("json_object"),
    "choice of 3": StructuredOutput("choice", ("yes", "no", "maybe")),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON."}]
               for i in range(args.users)]
    with Engine(EngineConfig(max_num_seqs=max(args.users, 1))) as engine:
        stats = engine.stats()
        print(f"{stats.model} on {stats.device} ({stats.dtype}); {args.users} users x "
              f"{args.max_tokens} tokens, greedy, EOS ignored; best of {args.rounds}")
        for so in KINDS.values():  # warm-up: xgrammar loads, every spec compiles
            engine.generate(prompts[:2], SamplingParams(max_tokens=2, structured=so))
        plain = None
        for label, so in KINDS.items():
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, structured=so)
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                best = min(best, time.perf_counter() - start)
            rate = sum(len(o.token_ids) for o in outs) / best
            plain = plain or rate
            print(f"  {label:16s} {rate:8,.0f} output tokens/s  {rate / plain:6.2f}x plain")


if __name__ == "__main__":
    main()
