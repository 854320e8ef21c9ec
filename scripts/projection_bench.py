"""How long the Datacenter page's estimates take, and how long the page takes to open
beside the Hardware page.

    PYTHONPATH=. python scripts/projection_bench.py [--json out.json]

1. Pages (AppTest, in this process, run first): the Hardware and the Datacenter page,
   each opened cold (the first run in the process: the Datacenter page compiles its
   default layout and loads the H100 tables) and again as a new session (warm: what a
   page switch costs once the process has served it once).
2. Estimates (measure.projection): for each layout, the first call (compiles the package's
   engine; the first layout of a system also loads its tables), then every later estimate
   with arguments not seen before (so no cache answers), per kind of estimate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [  # (model, system, backend, tp, pp, dtype, link)
    ("llama-3.1-70b", "h100_sxm", "trtllm", 8, 1, "bf16", None),
    ("llama-3.1-70b", "h100_sxm", "trtllm", 4, 2, "bf16", None),
    ("llama-3.1-70b", "h100_sxm", "trtllm", 8, 1, "bf16", "pcie5"),
    ("llama-3.1-8b", "h200_sxm", "vllm", 1, 1, "fp8", None),
    ("qwen3-32b", "b200_sxm", "sglang", 2, 1, "bf16", None),
    ("llama-3.1-405b", "gb200", "trtllm", 8, 2, "fp8", None),
    ("llama-2-70b", "h100_sxm", "trtllm", 4, 1, "bf16", None),  # roofline fallback
]


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def later_estimates(layout, i: int, batch: int, ctx: int) -> dict[str, float]:
    """One call of each kind of estimate, with arguments no earlier call used."""
    from measure import capacity as cap
    from measure import projection as P

    demand = cap.Demand(prompt_tokens=ctx + 11 + i)
    return {
        "decode_step_seconds": timed(lambda: P.decode_step_seconds(layout, batch, ctx)),
        "decode_step (per-op)": timed(lambda: P.decode_step(layout, batch, ctx)),
        "prefill_seconds": timed(lambda: P.prefill_seconds(layout, ctx + i)),
        "prefill (per-op)": timed(lambda: P.prefill(layout, ctx + 7 + i)),
        "ideal_decode_step": timed(lambda: P.ideal_decode_step(layout, batch + 1, ctx)),
        "capacity plan": timed(lambda: cap.plan(layout, demand, cap.Slo())),
    }


def estimates() -> dict:
    from measure import projection as P

    out: dict = {"import_s": timed(lambda: (P.models(), P.systems())), "layouts": []}
    later: dict[str, list[float]] = {}
    for model, system, backend, tp, pp, dtype, link in LAYOUTS:
        layout = P.Layout(model, system, backend, tp, pp, dtype, link)
        first = timed(lambda layout=layout: (P.memory(layout),
                                             P.decode_step_seconds(layout, 1, 2048),
                                             P.decode_step(layout, 1, 2048),
                                             P.prefill(layout, 2048),
                                             P.prefill_seconds(layout, 2048)))
        out["layouts"].append({"layout": layout.label(), "first_s": first})
        for i, (batch, ctx) in enumerate([(3, 1000), (17, 1500), (61, 3000), (200, 700)]):
            for kind, seconds in later_estimates(layout, i, batch, ctx).items():
                later.setdefault(kind, []).append(seconds)
    out["later_ms"] = {k: {"median": statistics.median(v) * 1e3, "max": max(v) * 1e3,
                           "n": len(v)} for k, v in later.items()}
    return out


def pages() -> dict:
    """Each page opened cold (first in this process), then warm (a new session)."""
    from streamlit.testing.v1 import AppTest

    out: dict = {}
    for run in ("cold_s", "warm_s"):
        for name in ("hardware", "datacenter"):
            t = time.perf_counter()
            at = AppTest.from_file(str(ROOT / "pages" / f"{name}.py"), default_timeout=300).run()
            out.setdefault(name, {})[run] = time.perf_counter() - t
            assert not at.exception, at.exception
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    import torch  # noqa: F401  (the app has it loaded before any page runs)
    torch_s = time.perf_counter() - t
    opened = pages()  # first: the Datacenter page's first visit compiles its default layout
    result = {"torch_import_s": torch_s, "pages": opened, "estimates": estimates()}
    est = result["estimates"]
    print(f"catalogue (models, systems): {est['import_s'] * 1e3:.0f} ms")
    for row in est["layouts"]:
        print(f"first estimate  {row['first_s'] * 1e3:8.1f} ms  {row['layout']}")
    for kind, v in est["later_ms"].items():
        print(f"later {kind:22s} median {v['median']:7.3f} ms  max {v['max']:7.3f} ms "
              f"(n={v['n']})")
    for name, v in result["pages"].items():
        print(f"page {name:10s} cold {v['cold_s']:6.2f} s  warm {v['warm_s']:6.2f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
