"""The hardware page's parts: pick a model, precision, hardware, context and batch, and see
the roofline projection of `measure.hardware` for it.

    controls() -> Choice --> fit()               weights + KV against device memory
                         --> decode()            tokens/s per user and in total vs batch, B*
                         --> response()          prefill + answer tokens / tokens/s
                         --> datasheet()         where the hardware's figures come from
                         --> reference_tables()  model sizes; local PC vs datacenter

No figure is written here: every number comes from `measure.hardware` (datasheets) or from
`measure.calibrate` (this machine, measured once per server process).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import streamlit as st
import torch

from engine.memory.budget import GIB
from measure import projection
from measure.calibrate import Calibration, calibrate
from measure.hardware import (
    BIG_BATCH,
    HARDWARE,
    MODELS,
    PRECISIONS,
    FitReport,
    HardwareProfile,
    ModelProfile,
    compute_bound_batch,
    decode_tokens_per_s,
    fits,
    local_vs_datacenter_table,
    max_batch,
    model_size_table,
    prefill_seconds,
    response_seconds,
    this_machine_profile,
)
from measure.units import fmt_gib, fmt_number, fmt_seconds
from ui import presenter
from ui.hardware_charts import PARTS, SERIES, decode_chart, fit_chart
from ui.palette import LOCAL

KEY_MODEL, KEY_PRECISION, KEY_HARDWARE = "hw_model", "hw_precision", "hw_hardware"
KEY_CONTEXT, KEY_BATCH, KEY_ANSWER = "hw_context", "hw_batch", "hw_answer"
DEFAULT_MODEL, DEFAULT_HARDWARE = "llama-3-8b", "rtx4090"
CONTEXTS = [2**k for k in range(8, 18)]  # 256 .. 131072 tokens
BATCHES = [2**k for k in range(11)]  # 1 .. 1024
BATCH_GRID = sorted({round(b) for b in np.geomspace(BATCHES[0], BATCHES[-1], 61)})
THIS_MACHINE = "this_machine:"  # option prefix; the device ("cpu" | "cuda") follows
CALIBRATE_S = 2.0
PRESENTER_FIT_PX = 150  # the fit chart's height in presenter mode: on the first screen
PREFILL_EFFICIENCY = inspect.signature(prefill_seconds).parameters["efficiency"].default


@dataclass(frozen=True)
class Choice:
    """What the user picked; `calibration` is set when the hardware is this machine."""

    model: ModelProfile
    precision: str
    hw: HardwareProfile
    context: int
    batch: int
    calibration: Calibration | None = None


# ---- formatting ----------------------------------------------------------------------
def _tex(value: float) -> str:
    """`fmt_number` for st.latex: `{,}` keeps a thousands comma from adding a space."""
    return fmt_number(value).replace(",", "{,}")


def gib(nbytes: float) -> float:
    return nbytes / GIB


# ---- frames (engine numbers -> DataFrames; no Streamlit) -------------------------------
def fit_frame(report: FitReport) -> pd.DataFrame:
    """Weights and KV cache in GiB, one row each, for `fit_chart`."""
    return pd.DataFrame({"part": PARTS, "gib": [gib(report.weights_bytes), gib(report.kv_bytes)]})


def decode_frame(choice: Choice) -> pd.DataFrame:
    """Decode tokens/s per user and in total over batch 1..1024, for `decode_chart`."""
    rows = []
    for batch in BATCH_GRID:
        p = decode_tokens_per_s(choice.model, choice.precision, choice.hw, batch, choice.context)
        for series, value in zip(SERIES, (p.per_user, p.total), strict=True):
            rows.append({"batch": batch, "series": series, "tokens_per_s": value,
                         "bound": p.bound})
    return pd.DataFrame(rows)


def model_size_frame(precision: str, context: int) -> pd.DataFrame:
    return pd.DataFrame(model_size_table(precision, context))


def local_vs_datacenter_frame(model_key: str, precision: str, context: int) -> pd.DataFrame:
    """`local_vs_datacenter_table` as a frame; where the big batch does not fit, its bound
    says so (a bare None would read as a missing figure)."""
    frame = pd.DataFrame(local_vs_datacenter_table(model_key, precision, context))
    frame["bound_big_batch"] = frame["bound_big_batch"].fillna("does not fit")
    return frame


# ---- this machine ----------------------------------------------------------------------
def hardware_options() -> list[str]:
    """The reference hardware, then this machine (its CPU, and its GPU where there is one)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return list(HARDWARE) + [THIS_MACHINE + d for d in devices]


def hardware_label(key: str) -> str:
    if key.startswith(THIS_MACHINE):
        return f"This machine ({key.removeprefix(THIS_MACHINE).upper()}, measured)"
    return HARDWARE[key].name


@st.cache_resource(show_spinner="Measuring this machine: memory bandwidth and matmul FLOP/s "
                                "(a few seconds, once per server process)...")
def this_machine(device: str) -> tuple[HardwareProfile, Calibration]:
    """This machine's profile from `calibrate`, measured once per server process."""
    calibration = calibrate(seconds=CALIBRATE_S, device=device)
    return this_machine_profile(calibration), calibration


def _resolve(key: str) -> tuple[HardwareProfile, Calibration | None]:
    if key.startswith(THIS_MACHINE):
        return this_machine(key.removeprefix(THIS_MACHINE))
    return HARDWARE[key], None


# ---- the page's parts ------------------------------------------------------------------
def intro() -> None:
    st.header("Hardware: does it fit, and how fast can it go?")
    st.caption("Roofline projections from vendor datasheets: ceilings that real engines reach "
               "a fraction of. Decode reads every weight once per step, so it is bound by "
               "memory bandwidth until the batch reaches B*, and by compute beyond it.")


def controls() -> Choice:
    """Model, precision, hardware, context length and batch."""
    models, hardware = list(MODELS), hardware_options()
    with st.container(border=True):
        a, b, c = st.columns([2, 1.4, 2])
        model = a.selectbox("Model", models, index=_index(models, DEFAULT_MODEL), key=KEY_MODEL,
                            format_func=lambda k: MODELS[k].name)
        precision = b.radio("Weights precision", list(PRECISIONS), key=KEY_PRECISION,
                            horizontal=True)
        hw_key = c.selectbox("Hardware", hardware, index=_index(hardware, DEFAULT_HARDWARE),
                             key=KEY_HARDWARE, format_func=hardware_label)
        d, e = st.columns(2)
        context = d.select_slider("Context length (tokens per user)", CONTEXTS, value=2048,
                                  key=KEY_CONTEXT)
        batch = e.select_slider("Batch (concurrent users)", BATCHES, value=1, key=KEY_BATCH)
    hw, calibration = _resolve(hw_key)
    choice = Choice(MODELS[model], precision, hw, int(context), int(batch), calibration)
    if choice.context > choice.model.context:
        st.warning(f"{choice.model.name} was trained for {choice.model.context:,} tokens of "
                   f"context; {choice.context:,} is projected anyway.")
    return choice


def _index(options: list[str], preferred: str) -> int:
    return options.index(preferred) if preferred in options else 0


def fit(choice: Choice) -> None:
    """Weights + KV cache of `batch` sequences against device memory, and the verdict."""
    m, hw = choice.model, choice.hw
    report = fits(m, choice.precision, hw, choice.context, choice.batch)
    st.subheader("Does it fit?")
    # two a row beside the sidebar: three in half a laptop screen cut "14,557" at 1280 px
    a, b, c = presenter.metric_columns(3, 2)
    a.metric(f"Fits in {fmt_gib(hw.memory_gb)} GiB", "Yes" if report.fits else "No",
             delta=f"{gib(report.headroom_bytes):+,.1f} GiB")
    b.metric("Needs (GiB)", fmt_number(gib(report.total_bytes)),
             help="Weights plus the KV cache of every sequence in the batch")
    c.metric("Max batch", f"{max_batch(m, choice.precision, hw, choice.context):,}",
             help="Most sequences of this context whose KV cache fits beside the weights")
    st.altair_chart(fit_chart(fit_frame(report), hw.memory_gb, hw.name), width="stretch",
                    height=presenter.figure_height(PRESENTER_FIT_PX))
    what = (f"{m.name} at {choice.precision} with {choice.batch} × {choice.context:,} tokens "
            f"of KV cache")
    if report.fits:
        st.success(f"Fits: {what} takes {gib(report.total_bytes):,.1f} of "
                   f"{fmt_gib(hw.memory_gb)} GiB.")
        return
    p = decode_tokens_per_s(m, choice.precision, hw, choice.batch, choice.context)
    bound = "Offload-bound" if p.bound == "offload" else f"{p.bound.capitalize()}-bound"
    st.error(f"Does not fit: {what} needs {gib(report.total_bytes):,.1f} GiB; {hw.name} "
             f"has {fmt_gib(hw.memory_gb)}. {bound}: {p.note}.")


def decode(choice: Choice) -> None:
    """Decode tokens/s at the chosen batch, and over batch 1..1024 with B* marked."""
    h = choice.hw
    p = decode_tokens_per_s(choice.model, choice.precision, h, choice.batch, choice.context)
    b_star = compute_bound_batch(h)
    st.subheader("Decode speed vs batch")
    a, b, c, d = st.columns(4)
    a.metric("Tokens/s per user", fmt_number(p.per_user))
    b.metric(f"Tokens/s total at batch {choice.batch}", fmt_number(p.total))
    c.metric("Bound by", p.bound)
    d.metric("Compute-bound batch B*", fmt_number(b_star))
    st.altair_chart(decode_chart(decode_frame(choice), b_star), width="stretch")
    st.latex(r"t_\text{step} = \max\left(\frac{\text{streamed weights} + \text{KV}}"
             r"{\text{bandwidth}},\;\frac{2 \times \text{matmul params} \times B}"
             r"{\text{peak FLOP/s}}\right)")
    st.latex(r"B^* \approx \frac{\text{peak FLOP/s}}{\text{bandwidth}} = "
             rf"\frac{{{_tex(h.peak_tflops)}\,\text{{TFLOPS}}}}"
             rf"{{{_tex(h.bandwidth_gbs)}\,\text{{GB/s}}}} \approx {_tex(b_star)}")
    offload = ("" if p.bound == "offload" else f" Past device memory, the rest would stream "
               f"over the {h.offload_bandwidth_gbs:g} GB/s offload link every step (shaded).")
    st.caption(f"Per user = 1 / t_step; total = B / t_step. At batch {choice.batch}: "
               f"{p.note}.{offload}")


def response(choice: Choice) -> None:
    """Time to a whole answer: prefill of the context, then the answer at decode speed."""
    st.subheader("Time to an answer")
    answer = int(st.slider("Answer length (output tokens)", 16, 4096, 512, 16, key=KEY_ANSWER))
    m, prec, h, ctx = choice.model, choice.precision, choice.hw, choice.context
    prefill = prefill_seconds(m, prec, h, ctx)
    mean_context = ctx + answer // 2  # the answer's tokens see, on average, half of it
    rate = decode_tokens_per_s(m, prec, h, choice.batch, mean_context).per_user
    total = response_seconds(m, prec, h, ctx, answer, choice.batch)
    assert math.isclose(prefill + answer / rate, total), (prefill, answer, rate, total)
    a, b, c = presenter.metric_columns(3, 2)  # three a row cut "347 ms" at 1366 px
    a.metric("Prefill (TTFT)", fmt_seconds(prefill), help="Time to first token")
    b.metric("Tokens/s each", fmt_number(rate),
             help="Per user, at the mean context while answering")
    c.metric("Response", fmt_seconds(total), help="Prefill + answer tokens / tokens/s")
    st.latex(r"\begin{aligned} t_\text{response} &= t_\text{prefill} + \frac{\text{output "
             r"tokens}}{\text{tokens/s}} \\ "
             rf"&= {_tex(prefill)}\,\text{{s}} + "
             rf"\frac{{{answer}}}{{{_tex(rate)}}} = {_tex(total)}\,\text{{s}} \end{{aligned}}")
    st.caption(f"Prefill of the {ctx:,}-token prompt = 2 × matmul params × prompt tokens / "
               f"(peak FLOP/s × {PREFILL_EFFICIENCY:g}), with the LM head for the last token "
               "only, and at least one read of the weights. "
               f"Tokens/s is at the mean context while answering ({mean_context:,} tokens), "
               f"batch {choice.batch}.")


def datasheet(choice: Choice) -> None:
    """The chosen hardware's figures and their source; measured figures for this machine."""
    h, cal = choice.hw, choice.calibration
    st.caption(f"**{h.name}**: {fmt_gib(h.memory_gb)} GiB, {fmt_number(h.bandwidth_gbs)} "
               f"GB/s memory bandwidth, {fmt_number(h.peak_tflops)} TFLOPS dense bf16/fp16, "
               f"{fmt_number(h.offload_bandwidth_gbs)} GB/s offload link. Source: {h.source}.")
    if h.kind == "node":
        node_note(choice)
    if cal is None:
        return
    a, b, c = st.columns(3)
    a.metric("Measured bandwidth (GB/s)", fmt_number(cal.bandwidth_gbs))
    b.metric("Measured matmul (TFLOPS)", fmt_number(cal.tflops))
    c.metric("Free memory (GiB)", fmt_number(cal.memory_available_gb))
    by_dtype = ", ".join(f"{k} {v:.3g}" for k, v in cal.tflops_by_dtype.items())
    link = ("measured host-to-device copy" if cal.offload_bandwidth_gbs is not None
            else "assumed: spill to disk")
    st.caption(f"Measured on {cal.device_name} in {cal.seconds:.1f} s: matmul TFLOPS by dtype: {by_dtype}; {cal.memory_available_gb:.1f} of "
               f"{cal.memory_gb:.1f} GiB free; offload link {h.offload_bandwidth_gbs:g} GB/s "
               f"({link}). Measured once per server process; a race running at the same "
               f"moment lowers these figures.")


# The Datacenter page's model with the same shapes as a `measure.hardware` model.
MEASURED_TWIN = {"llama-3-8b": "llama-3.1-8b", "llama-3-70b": "llama-3.1-70b",
                 "llama-3.1-405b": "llama-3.1-405b"}


def node_note(choice: Choice) -> None:
    """The ×8 node adds up eight GPUs as if their all-reduces were free: set it beside the
    measured 8-GPU tensor-parallel step where the package has the model."""
    twin = MEASURED_TWIN.get(choice.model.key)
    if twin is None or choice.precision != "fp16":
        st.info("This node adds up 8 GPUs as if the all-reduces after every layer were "
                "free. The Datacenter page projects tensor parallelism on measured kernels.")
        return
    layout = projection.Layout(twin, "h100_sxm", "trtllm", tp=8)
    if not projection.check(layout, choice.context, choice.batch).ok:
        st.info(f"This node adds up 8 GPUs as if the all-reduces were free; "
                f"{projection.check(layout, choice.context, choice.batch).reason}")
        return
    step = projection.decode_step(layout, choice.batch, choice.context)
    ideal = decode_tokens_per_s(choice.model, "fp16", choice.hw, choice.batch,
                                choice.context).total
    st.info(f"This node adds up 8 GPUs as if the all-reduces after every layer were free: "
            f"{fmt_number(ideal)} tokens/s at batch {choice.batch}. On NVIDIA's measured "
            f"kernels (TensorRT-LLM, TP=8, the Datacenter page) it is "
            f"{fmt_number(choice.batch / step.seconds)} tokens/s, the all-reduces taking "
            f"{step.communication_share:.0%} of each step.")


def reference_tables(choice: Choice) -> None:
    """The product's two reference tables, straight from `measure.hardware`."""
    prec, ctx = choice.precision, choice.context
    st.subheader("Reference tables")
    st.markdown(f"**Model size and where it fits**: {prec} weights plus the KV cache of one "
                f"{ctx:,}-token sequence.")
    st.dataframe(model_size_frame(prec, ctx), hide_index=True, width="stretch",
                 column_order=["model", "params", "precision", "weights_gb", "fp16_weights_gb",
                               "difficulty", "fits_on"],
                 column_config={
                     "model": "Model",
                     "params": st.column_config.NumberColumn("Parameters", format="compact"),
                     "precision": "Precision",
                     "weights_gb": st.column_config.NumberColumn("Weights (GB)", format="%.1f"),
                     "fp16_weights_gb": st.column_config.NumberColumn("FP16 weights (GB)",
                                                                      format="%.1f"),
                     "difficulty": "Running it locally",
                     "fits_on": st.column_config.ListColumn("Fits on", width="large"),
                 })
    st.markdown(f"**Local PC vs datacenter**: {choice.model.name}, {prec}, {ctx:,}-token "
                f"context; tokens/s per user at batch 1, and in total at batch {BIG_BATCH} "
                f"where that fits.")
    st.dataframe(local_vs_datacenter_frame(choice.model.key, prec, ctx), hide_index=True,
                 width="stretch",
                 column_order=["hardware", "local", "fits", "tokens_per_s_user", "bound",
                               "total_tokens_per_s_big_batch", "bound_big_batch", "max_batch",
                               "source"],
                 column_config={
                     "hardware": "Hardware",
                     "local": st.column_config.CheckboxColumn(LOCAL),
                     "fits": st.column_config.CheckboxColumn("Fits"),
                     "tokens_per_s_user": st.column_config.NumberColumn(
                         "Tokens/s per user (batch 1)", format="%.1f"),
                     "bound": "Bound (batch 1)",
                     "total_tokens_per_s_big_batch": st.column_config.NumberColumn(
                         f"Total tokens/s (batch {BIG_BATCH})", format="%.0f"),
                     "bound_big_batch": f"Bound (batch {BIG_BATCH})",
                     "max_batch": st.column_config.NumberColumn("Max batch at this context"),
                     "source": "Datasheet",
                 })
