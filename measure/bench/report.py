"""The bench's report: the table, the throughput ratios, the mix's roofline floor, each
engine run's KV waste and step times; the figures saved as JSON and printed again from it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from engine.metrics import RunSummary
from engine.models.loaded import LoadedModel
from measure import hardware
from measure.bench.breakdown import StepProfile, format_profiles
from measure.bench.requests import BenchRequest
from measure.bench.runs import RunResult
from measure.calibrate import Calibration, calibrate
from measure.roofline import machine_profile, mix_floor, model_profile_key

FLOOR_ELSEWHERE = ("h100", "rtx4090")  # reference hardware the floor ratio is also shown for


def roofline_floor(loaded: LoadedModel, reqs: list[BenchRequest], concurrency: int,
                   cal: Calibration | None = None,
                   readings: Sequence[Calibration] = ()) -> dict[str, Any] | None:
    """The mix's roofline floors (`measure.roofline.mix_floor`) on this machine, as `cal`
    says (by default measured by `measure.calibrate`, about 3 s; `readings`: the
    calibrations `cal` is the best of, kept so a report shows how far they moved), and its
    ratio on reference GPUs; None for a model with no profile
    in measure/hardware.py."""
    key = model_profile_key(loaded.model.arch)
    if key is None:
        return None
    model = loaded.model
    cal = cal or calibrate(device=device_of(loaded))
    here = machine_profile(cal, model.dtype)
    lens = [len(r.prompt_ids) for r in reqs], [r.max_tokens for r in reqs]
    floor = mix_floor(*lens, concurrency, key, here)
    return {"concurrency": concurrency, "requests": len(reqs), "bandwidth_gbs": cal.bandwidth_gbs,
            "readings": [[c.bandwidth_gbs, machine_profile(c, model.dtype).peak_tflops]
                         for c in readings],
            "tflops": here.peak_tflops, "dtype": str(model.dtype).removeprefix("torch."),
            "batched_s": floor.batched_s, "sequential_s": floor.sequential_s,
            "output_tokens": floor.output_tokens, "ratio": floor.ratio,
            "elsewhere": {hardware.get_hardware(k).name: mix_floor(*lens, concurrency, key, k).ratio
                          for k in FLOOR_ELSEWHERE}}


def _readings(floor: dict[str, Any]) -> str:
    """", best of N ..." for a floor from several calibrations, with what each read (a
    machine whose speed moves between them shows it here); "" for one."""
    if len(got := floor.get("readings") or []) > 1:
        gbs = " and ".join(f"{g:.1f}" for g, _ in got)
        tflops = " and ".join(f"{t:.2f}" for _, t in got)
        return (f", best of {len(got)}, before and after the runs, which read {gbs} GB/s "
                f"and {tflops} TFLOPS")
    if (n := floor.get("measurements", 1)) > 1:  # a JSON saved before readings were kept
        return f", best of {n}, before and after the runs"
    return ""


def device_of(loaded: LoadedModel) -> str:
    """"cuda" or "cpu": the device `measure.calibrate` measures for this model."""
    return "cuda" if loaded.model.device.type == "cuda" else "cpu"


def floor_lines(floor: dict[str, Any], results: list[RunResult]) -> list[str]:
    """The floor as printed, with how close the measured runs came to it."""
    f, tput = floor, {r.name: r.summary.throughput for r in results if r.summary}
    eng, loc = f"engine@{f['concurrency']}", f"local@{f['requests']}"
    best = {eng: f["output_tokens"] / f["batched_s"], loc: f["output_tokens"] / f["sequential_s"]}
    lines = [f"roofline floor of this mix here ({f['bandwidth_gbs']:.1f} GB/s, "
             f"{f['tflops']:.2f} TFLOPS {f['dtype']}, measured by measure.calibrate"
             + _readings(f) + "; no "
             f"overheads, no attention FLOPs): {eng} >= {f['batched_s']:.1f} s "
             f"({best[eng]:.0f} tok/s), {loc} >= {f['sequential_s']:.1f} s ({best[loc]:.0f} "
             f"tok/s): batching alone can buy {f['ratio']:.1f}x on this machine"]
    if got := [f"{n} at {tput[n] / best[n]:.0%}" for n in best if n in tput]:
        lines.append("measured speed as a share of the floor's: " + ", ".join(got))
    lines.append("the same mix's floor ratio elsewhere: "
                 + ", ".join(f"{name} {r:.1f}x" for name, r in f["elsewhere"].items()))
    return lines


def format_table(results: list[RunResult], others: bool = True,
                 note: str = "others: CPU share other processes used") -> str:
    """A fixed-width table: tok/s, TTFT and TPOT p50/p99 (ms), and (`others`) the CPU share
    other processes used, per run; `note` ends the footnote."""
    head = (f"{'run':<14}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'tokens':>8}{'wall s':>8}" + (f"{'others':>8}" if others else ""))
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.summary
        if s is None:
            lines.append(f"{r.name:<14}n/a: {r.na}")
            continue
        ms = [v * 1000 for v in (s.ttft_p50, s.ttft_p99, s.tpot_p50, s.tpot_p99)]
        lines.append(f"{r.name:<14}{s.throughput:>9.1f}" + "".join(f"{v:>10.0f}" for v in ms)
                     + f"{s.output_tokens:>8}{s.wall_time:>8.1f}"
                     + (f"{r.extra.get('others_cpu', math.nan):>8.0%}" if others else ""))
    lines.append(f"(ms; all requests arrive at t=0; {note})")
    return "\n".join(lines)


def ratios(results: list[RunResult]) -> dict[str, float]:
    """Throughput ratios: top-concurrency engine vs HF static / continuous; engine@1 vs batch 1."""
    tput = {r.name: r.summary.throughput for r in results if r.summary}
    engines = [n for n in tput if n.startswith("engine@")]
    top = max(engines, key=lambda n: int(n.split("@")[1]), default=None)
    local = f"local@{top.split('@')[1]}" if top else None
    pairs = [(top, "hf_static"), (top, "hf_continuous"), ("engine@1", "hf_batch1"),
             (top, local), ("engine@1", "local@1")]
    return {f"{a} / {b}": tput[a] / tput[b] for a, b in pairs if a in tput and b in tput}


def report(results: list[RunResult], floor: dict[str, Any] | None = None) -> str:
    """The table, the throughput ratios, the roofline floor and each engine run's KV waste
    and step times, as printed."""
    out = [format_table(results)]
    if rat := ratios(results):
        out.append("throughput ratios: " + ", ".join(f"{k} = {v:.2f}x" for k, v in rat.items()))
    if floor:
        out += floor_lines(floor, results)
    for r in results:
        if "kv_waste" in r.extra:
            w = r.extra["kv_waste"]
            out.append(f"{r.name}: reserved-but-unused KV slots "
                       f"{f'{w:.1%}' if isinstance(w, float) else w} over {r.extra['steps']} "
                       f"steps, {r.extra['preemptions']} preemptions, "
                       f"{r.extra['cached_prompt_tokens']} prompt tokens from the prefix cache")
        if t := r.extra.get("time"):
            line = (f"{r.name}: steps with prompt tokens {t['prefill_s']:.1f} s "
                    f"({t['prefill_tokens']:,} prompt tokens); decode-only steps "
                    f"{t['decode_s']:.1f} s ({t['decode_steps']} steps, "
                    f"{t['decode_tokens']:,} tokens)")
            if "fixed_ms" in t:
                line += (f", each ~{t['fixed_ms']:.1f} ms + {t['per_seq_ms']:.2f} ms per "
                         "sequence")
            out.append(line)
        if prof := r.extra.get("profile"):
            out += format_profiles([StepProfile(**p) for p in prof])
    return "\n".join(out)


def report_saved(paths: list[str]) -> str:
    """The table and ratios of runs saved by `--json` (later files add or replace runs)."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    runs: dict[str, dict[str, Any]] = {}
    for doc in docs:
        runs.update(doc["runs"])
    results = []
    for name, r in runs.items():
        extra = {k: v for k, v in r.items() if k not in ("summary", "na")}
        summary = RunSummary(**r["summary"]) if r["summary"] else None
        results.append(RunResult(name, summary, r["na"], extra))
    d = docs[0]
    head = (f"model {d['model']} on {d['device']}, dtype {d['dtype']}, {d['threads']} threads; "
            f"{d['requests']} requests (seed {d['seed']}); from {', '.join(paths)}")
    return head + "\n\n" + report(results, next((d["floor"] for d in docs if d.get("floor")), None))


def save_json(path: str, run_info: dict[str, Any], results: list[RunResult],
              floor: dict[str, Any] | None, complete: bool) -> None:
    """Write the figures so far; called after every run, so a killed bench keeps them.

    `run_info`: model, device, dtype, threads, requests, seed (what `report_saved` heads
    its table with)."""
    doc = {**run_info, "complete": complete,
           "runs": {r.name: {"summary": r.summary.as_dict() if r.summary else None,
                             "na": r.na, **r.extra} for r in results},
           "ratios": ratios(results), "floor": floor}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
