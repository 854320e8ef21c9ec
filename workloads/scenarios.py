"""Scripted scenarios: fixed prompts, settings and seeds, so a run gives the same text
every time. Presenter mode plays the arena ones; the KV cache page plays the cache ones on
an engine of its own, built from `Scenario.engine_config`.

`run_scenario` submits a scenario's users to any engine (or the local PC) and reports
what the KV cache did for it: prefix-cache hit rate, preemptions, TTFT. A shared system
prompt meets a warm cache in production, since earlier traffic sent it: `warmup` sends it
once first (not counted), and with `stagger=True` each user arrives when the one before has
its first token (users arriving in the same step would all miss: no block is cached until
its prefill step ends).

`python -m workloads.scenarios shared_prefix` runs one with prefix caching on and off and
prints the figures side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.config import EngineConfig, SamplingParams
from engine.outputs import RequestHandle, RequestOutput
from engine.serving import ServingSide
from workloads.prompts import Chat, chat

SYSTEM_PROMPT = (
    "You are the help desk assistant of Northwind Rail, a regional train company. Follow "
    "these rules in every answer. Be brief and friendly, and answer in at most three "
    "sentences. Tickets can be bought at stations, on the website and in the mobile app; "
    "a ticket bought on the train costs five euros more. Children under six travel free, "
    "children from six to fifteen pay half price, and students with a valid card get a "
    "quarter off every ticket. A day pass costs twenty euros and is valid on all regional "
    "trains until four in the morning of the next day. Bicycles travel free outside the "
    "morning and evening rush hours, from seven to nine and from four to seven, when they "
    "need a bicycle ticket of three euros. Dogs travel free when they are small enough to "
    "sit on a lap; larger dogs need a child ticket and a leash. Refunds are given for "
    "unused tickets up to one day before travel, minus a fee of two euros. When a train is "
    "more than thirty minutes late, passengers receive a quarter of the ticket price back, "
    "and half of it after sixty minutes. Lost items are kept for thirty days at the central "
    "station. Station staff help travellers who need assistance with steps, ramps or heavy "
    "luggage when they are told one day ahead. Never invent timetables: send people to the journey planner for times. If a "
    "question is not about trains, tickets or stations, say politely that you can only help "
    "with travel on Northwind Rail."
)
QUESTIONS = (
    "Can my dog come on the train?",
    "How much is a day pass?",
    "Do children pay?",
    "Can I take my bike at eight?",
    "My train was an hour late.",
    "Where are lost umbrellas kept?",
    "Can I get a refund today?",
    "Is a student discount offered?",
)
SHORT = ("Say hi.", "Name a color.", "Count to three.", "Name a fruit.", "Say yes.",
         "Name a day.", "Say thanks.", "Name an animal.")
EDIT_PARAGRAPHS = (  # typos on purpose: the answer copies the paragraph, fixing a few words
    "Our town libary opens at nine in the morning and closes at six in the evening. "
    "Children can borow up to five books at a time, and adults up to ten. Books must be "
    "returned within three weeks, or a small fine is charged for every day they are late. "
    "The reading room on the first floor is quiet, and the cafe next to it serves tea and "
    "cake untill five.",
    "The old lighthouse stands on a rocky hill above the harbour. It was bilt more than two "
    "hundred years ago to guide fishing boats home through the fog. Today it is a small "
    "museum, and visiters can climb the narrow stairs to the lamp room at the top, where "
    "the view over the sea and the islands is wonderfull on a clear day.",
    "To make a simple bread, mix flour, water, salt and a little yeast in a large bowl. "
    "Knead the dough for ten minutes untill it is smooth, then leave it to rise in a warm "
    "place for one hour. Shape it into a loaf, let it rise again, and bake it in a hot "
    "oven for about fourty minutes, until the crust is golden and sounds hollow.",
    "Every spring the river floods the low feilds near the village. The farmers have "
    "learned to plant their crops later in the year, after the water has gone down. The "
    "floods are not only a problem: they leave behind a layer of rich soil, which makes "
    "the feilds some of the most fertile in the whole region.",
    "The school football team trains twice a week, on Tuesday and Thursday afternoons. "
    "New players are always welcome, and no experiance is needed. Please bring sports "
    "shoes, a bottle of water and a warm jacket, because the feild can be cold and windy "
    "in winter. The season ends with a big match against the team from the next town.",
    "Bees visit thousands of flowers every day to collect nectar and polen. While they "
    "fly from one flower to the next, they carry polen with them, which helps the plants "
    "to make seeds and fruit. Without bees, many of the fruits and vegetables we eat "
    "would be much harder to grow, so protecting them is importent for everyone.",
    "The train to the coast leaves from platform four at ten past eight every morning. "
    "The journey takes about two hours, and there is a small cafe on board that sells "
    "coffee, sandwiches and fresh fruit. On sunny weekends the train is often full, so it "
    "is a good idea to buy your ticket the day befor and to arrive early.",
    "Our neighbour has a small garden full of tomatos, beans and herbs. Every summer she "
    "shares her harvest with the whole street, and in return the children help her to "
    "water the plants when she is away on holiday. Last year the tomatos were so big that "
    "she won a prize at the village show.",
)
EDIT_ASK = "Copy this paragraph exactly, but fix the spelling mistakes:\n\n"
LONG_TOPIC = (
    "Write a long, detailed story about a lighthouse keeper on a stormy island, his "
    "daily routine, the ships he guides and the letters he writes home. "
)


@dataclass(frozen=True)
class Scenario:
    """One scripted workload: who sends what, with which settings."""

    key: str
    title: str
    shows: str  # one sentence: what to look at
    prompts: tuple[Chat, ...]  # one per user, in arrival order
    max_tokens: int
    seed: int = 0
    stagger: bool = False  # each user arrives when the one before has its first token
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    emulation: tuple[str, str, str] | None = None  # local pacing: (hardware, model, precision)
    warmup: Chat | None = None  # sent first (1 token, not in the result): earlier traffic
    n: int = 1  # answers per user (parallel sampling)
    temperature: float = 0.0  # above 0 the seeds pick the answers (the same every run)

    @property
    def num_users(self) -> int:
        return len(self.prompts)

    def params(self, user: int = 0) -> SamplingParams:
        """Greedy unless the scenario sets a temperature, EOS honoured; user u seeded
        seed + u (its candidate i then seed + u + i), so a sampled scenario repeats."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                              seed=self.seed + user, n=self.n)

    def engine_config(self, base: EngineConfig | None = None, **changes: Any) -> EngineConfig:
        """`base` (default settings if None) with this scenario's fields, then `changes`."""
        return replace(base or EngineConfig(), **{**self.engine, **changes})


def _users(texts: tuple[str, ...], n: int, system: str | None = None) -> tuple[Chat, ...]:
    return tuple(chat(texts[i % len(texts)], system) for i in range(n))


SCENARIOS: dict[str, Scenario] = {s.key: s for s in (
    # presenter mode: the arena
    Scenario("one_user", "One user", "Alone, the local PC is about as fast as the datacenter: "
             "batching only pays when many users share a step.",
             _users(("Explain in a few sentences why the sky is blue.",), 1), 64),
    Scenario("many_users", "32 users", "32 users at once: the datacenter answers them all in "
             "one batch while the local PC serves them one by one.",
             _users(QUESTIONS + SHORT, 32), 32),
    Scenario("edit_paragraph", "Edit a paragraph: speculative decoding",
             "The answer copies most of the prompt: drafts looked up in it are mostly "
             "right, so one user gets several tokens per step; at 32 users the spare "
             "compute that paid for checking drafts is already in use.",
             _users(tuple(EDIT_ASK + p for p in EDIT_PARAGRAPHS), 32), 160),
    Scenario("laptop_70b", "A 70B model on a laptop (projected)", "The local side is paced to "
             "a 70B model in 4-bit on a laptop: it does not fit memory and streams weights.",
             _users(("Explain in a few sentences why the sky is blue.",), 1), 16,
             emulation=("laptop_cpu", "llama-2-70b", "int4")),
    # KV cache page (and presenter mode's "shared system prompt")
    Scenario("shared_prefix", "8 users sharing a 300-token system prompt",
             "After the first user, every prompt's system part is read from cached blocks: "
             "the prefix-cache hit rate climbs and TTFT drops.",
             _users(QUESTIONS, 8, SYSTEM_PROMPT), 24, stagger=True,
             engine={"enable_prefix_caching": True, "block_size": 16, "num_kv_blocks": 512},
             warmup=chat("Hello.", SYSTEM_PROMPT)),
    Scenario("small_pool", "Long contexts in a small pool",
             "Six long requests need more blocks than the pool has: the newest are preempted "
             "(their blocks freed) and recomputed later.",
             _users(tuple(LONG_TOPIC * 6 + f"Chapter {i}." for i in range(1, 7)), 6), 96,
             engine={"block_size": 16, "num_kv_blocks": 64, "enable_prefix_caching": False}),
    Scenario("many_short", "Many short requests",
             "Forty tiny requests: each leaves its last block partly empty, so a large block "
             "size wastes a bigger share of the pool.",
             _users(SHORT, 40), 8,
             engine={"block_size": 16, "num_kv_blocks": 256, "enable_prefix_caching": False}),
    Scenario("parallel_answers", "4 answers to one long prompt",
             "One user asks for 4 answers: the prompt is computed once and its blocks are "
             "shared (ref count 4); each answer adds only blocks of its own, where the local "
             "PC would hold the prompt 4 times.",
             (chat("A traveller asks: I am going with my bike and my dog, what do I pay? "
                   "Write a short reply.", SYSTEM_PROMPT),), 40, seed=7, n=4,
             temperature=0.8,
             engine={"block_size": 16, "num_kv_blocks": 128, "enable_prefix_caching": False}),
)}


# the KV cache page plays these
KV_SCENARIOS = ("shared_prefix", "small_pool", "many_short", "parallel_answers")


def get(key: str) -> Scenario:
    if key not in SCENARIOS:
        raise ValueError(f"scenario: unknown {key!r} (known: {', '.join(SCENARIOS)})")
    return SCENARIOS[key]


@dataclass(frozen=True)
class ScenarioResult:
    """What a scenario run produced and what the KV cache did for it."""

    outputs: list[RequestOutput]
    prompt_tokens: int
    cached_tokens: int
    preemptions: int
    stopped: bool = False

    @property
    def texts(self) -> list[str]:
        return [o.text for o in self.outputs]

    @property
    def hit_rate(self) -> float:
        """Prompt tokens read from the prefix cache / all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_p50(self) -> float | None:
        vals = [o.metrics.ttft for o in self.outputs if o.metrics.ttft is not None]
        return statistics.median(vals) if vals else None


def run_scenario(
    server: ServingSide, scenario: Scenario, *, stop: threading.Event | None = None,
    on_submit: Callable[[int, RequestHandle], None] | None = None,
    prefix: str = "scenario",
) -> ScenarioResult:
    """Submit every user of `scenario` to `server`, wait for all, return the result.

    `stop` set: cancels what is left. `on_submit(user, handle)` is called per user.
    Raises `ValueError` (nothing submitted) when a prompt cannot fit."""
    stop = stop or threading.Event()
    if scenario.warmup is not None:
        server.submit(list(scenario.warmup), SamplingParams(max_tokens=1),
                      request_id=f"{prefix}-warmup").result()
    before = _preemptions(server)
    handles: list[RequestHandle] = []
    if scenario.stagger:
        for i, prompt in enumerate(scenario.prompts):
            if stop.is_set():
                break
            h = server.submit(list(prompt), scenario.params(i), request_id=f"{prefix}-{i}")
            handles.append(h)
            if on_submit:
                on_submit(i, h)
            while not h.wait_first_token(0.1) and not stop.is_set():
                pass
    else:
        handles = server.submit_many([list(p) for p in scenario.prompts],
                                     [scenario.params(i) for i in range(scenario.num_users)],
                                     [f"{prefix}-{i}" for i in range(scenario.num_users)])
        for i, h in enumerate(handles):
            if on_submit:
                on_submit(i, h)
    outputs = []
    for h in handles:
        while not h.done:
            if stop.wait(0.05):
                for other in handles:
                    other.cancel()
        outputs.append(h.result())
    return ScenarioResult(
        outputs=outputs,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        cached_tokens=sum(o.num_cached_tokens for o in outputs),
        preemptions=_preemptions(server) - before,
        stopped=stop.is_set(),
    )


def _preemptions(server: ServingSide) -> int:
    return server.stats(steps_after=None).num_preemptions


def main(argv: list[str] | None = None, prog: str = "python -m workloads.scenarios") -> int:
    """Run a scenario with prefix caching on, then off, and print both."""
    from engine.engine import Engine
    from engine.models.loaded import LoadedModel

    ap = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    ap.add_argument("scenario", nargs="?", default="shared_prefix", choices=list(SCENARIOS))
    ap.add_argument("--model", help="local HF folder or .gguf (default: the bundled model)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    a = ap.parse_args(argv)
    sc = get(a.scenario)
    loaded = LoadedModel.load(a.model, a.device, a.dtype)
    print(f"{sc.title}: {sc.num_users} users, max_tokens {sc.max_tokens}, "
          f"{'staggered' if sc.stagger else 'all at once'}; {loaded.name} on "
          f"{loaded.model.device}, {str(loaded.model.dtype).removeprefix('torch.')}")
    print(f"{'prefix caching':<16}{'hit rate':>10}{'TTFT p50 ms':>13}{'preempted':>11}")
    ttft = {}
    for on in (True, False):
        with Engine(sc.engine_config(enable_prefix_caching=on), loaded=loaded) as eng:
            eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
            res = run_scenario(eng, sc)
        ttft[on] = res.ttft_p50
        print(f"{'on' if on else 'off':<16}{res.hit_rate:>10.1%}"
              f"{(res.ttft_p50 or 0) * 1e3:>13.0f}{res.preemptions:>11}")
    if ttft[True] and ttft[False]:
        print(f"median TTFT without / with prefix caching: {ttft[False] / ttft[True]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
