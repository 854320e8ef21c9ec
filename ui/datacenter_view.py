"""The Datacenter page's parts: pick a model, a datacenter system, TP × PP and the link, and
see the projection of `measure.projection` (measured kernels) beside our roofline.

    controls() -> Choice --> fit()          weights + KV per GPU; or why it cannot run
                         --> decode()       tokens/s per user and in total vs batch
                         --> breakdown()    where a step's time goes (GEMM, attention, comm)
                         --> ttft()         prefill of the prompt: measured and ideal
                         --> links()        the same all-reduces on other links
                         --> local()        the same model on a local PC (roofline)
                         --> capacity()     users -> replicas at the SLO; the cost table
    scenario()                              the presenter's "70B on 8 GPUs"; in presenter
                                            mode a bar of its four layouts, the clicker's
                                            steps, which set the controls
    figure_columns()                        decode() and breakdown() side by side in
                                            presenter mode, one under the other otherwise

No figure is written here: every number comes from `measure.projection`,
`measure.capacity`, `measure.interconnect` or `measure.hardware`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from measure import capacity as cap
from measure import hardware, interconnect
from measure import projection as P
from measure.units import fmt_count, fmt_number, fmt_seconds
from ui import clicker, presenter
from ui.datacenter_charts import (
    BATCH_DOMAIN,
    KINDS,
    SERIES,
    breakdown_chart,
    decode_chart,
    local_chart,
    scenario_chart,
)

K = "dc_"  # widget key prefix
KEY_MODEL, KEY_SYSTEM, KEY_BACKEND = K + "model", K + "system", K + "backend"
KEY_TP, KEY_PP, KEY_DTYPE, KEY_LINK = K + "tp", K + "pp", K + "dtype", K + "link"
KEY_CONTEXT, KEY_BATCH, KEY_PROMPT = K + "context", K + "batch", K + "prompt"
KEY_SCENARIO = K + "scenario"
KEY_STAGE = K + "stage"  # presenter mode: the scenario's layout last set from its bar
PRESENTER_CHART_PX = 290  # the decode and step-time charts' height (title, legend and axes
# included) in presenter mode: both beside each other on the first screen
DEFAULTS = {KEY_MODEL: "llama-3.1-70b", KEY_SYSTEM: "h100_sxm", KEY_BACKEND: "trtllm",
            KEY_TP: 8, KEY_PP: 1, KEY_DTYPE: "bf16", KEY_LINK: "", KEY_CONTEXT: 2048,
            KEY_BATCH: 64, KEY_PROMPT: 2048}
CONTEXTS = [2**k for k in range(8, 16)]  # 256 .. 32768
BATCHES = [2**k for k in range(11)]  # 1 .. 1024
BATCH_GRID = sorted({round(2 ** (k / 4)) for k in range(0, 41)})  # 1 .. 1024
LOCAL_KEYS = ["rtx4090", "m2_max", "laptop_cpu"]
OWN_LINK = ""  # the link option meaning "the system's own interconnect (measured)"
PRESET = cap.Demand()  # the seed's example: 1,000 connected, 200 active, 20 tokens/s each
GIB = 2**30


@dataclass(frozen=True)
class Choice:
    layout: P.Layout
    context: int
    batch: int
    prompt: int

    @property
    def verdict(self) -> P.Feasibility:
        return P.check(self.layout, self.context, self.batch)

    @property
    def runs(self) -> bool:
        """The layout can run at all (its batch may still not fit)."""
        return P.check(self.layout, self.context, 1).ok


def intro() -> None:
    st.header("Datacenter: many GPUs, one model")
    if presenter.is_on():  # the scenario bar's caption says what the page shows
        return
    st.caption("Tensor parallelism splits each layer's matrices over GPUs, which then sum "
               "their partial results (an all-reduce) twice a layer; pipeline parallelism "
               "splits the layers. Numbers from NVIDIA's measured kernel data "
               "(aiconfigurator-core), with our roofline as the ideal beside them.")


# ---- controls ------------------------------------------------------------------------
def _defaults() -> None:
    for key, value in DEFAULTS.items():
        st.session_state.setdefault(key, value)


def _model_label(key: str) -> str:
    m = P.get_model(key)
    return m.name if m.measured else f"{m.name} (roofline only)"


def _link_label(key: str) -> str:
    if key == OWN_LINK:
        return "the system's own (measured)"
    twin = P.MEASURED_ON.get(key)
    how = f"measured on {P.get_system(twin).name}" if twin else "ring formula"
    return f"{interconnect.LINKS[key].name} ({how})"


def controls(where=None) -> Choice:
    """Model, system, engine, TP × PP, dtype, link, context, batch and prompt length, in a
    bordered box, or in `where` (presenter mode: the scenario bar's Settings popover)."""
    _defaults()
    systems = list(P.systems())
    with where if where is not None else st.container(border=True):
        a, b, c = st.columns([1.6, 1.8, 1.4])
        model = a.selectbox("Model", list(P.models()), key=KEY_MODEL, format_func=_model_label)
        system = b.selectbox("Datacenter system", systems, key=KEY_SYSTEM,
                             format_func=lambda k: P.get_system(k).name)
        backend = c.radio("Engine", list(P.BACKENDS), key=KEY_BACKEND, horizontal=True,
                          format_func=P.BACKENDS.get)
        d, e, f, g = st.columns([1.3, 1, 1, 2])
        tp = d.radio("Tensor parallel (TP)", P.TP_SIZES, key=KEY_TP, horizontal=True)
        pp = e.radio("Pipeline parallel (PP)", P.PP_SIZES, key=KEY_PP, horizontal=True)
        dtype = f.radio("Weights and KV", P.DTYPES, key=KEY_DTYPE, horizontal=True)
        link = g.selectbox("Link between the TP GPUs", [OWN_LINK, *interconnect.LINKS],
                           key=KEY_LINK, format_func=_link_label)
        h, i, j = st.columns(3)
        context = h.select_slider("Context (tokens per user)", CONTEXTS, key=KEY_CONTEXT)
        batch = i.select_slider("Batch (concurrent users)", BATCHES, key=KEY_BATCH)
        prompt = j.select_slider("Prompt (tokens) for TTFT", CONTEXTS, key=KEY_PROMPT)
    layout = P.Layout(model, system, backend, int(tp), int(pp), dtype, link or None)
    return Choice(layout, int(context), int(batch), int(prompt))


# ---- memory --------------------------------------------------------------------------
def fit(choice: Choice) -> None:
    """The verdict in one line, then weights and KV per GPU and a replica's KV capacity."""
    layout, on = choice.layout, presenter.is_on()
    if not on:  # presenter mode: the verdict line only, so the figures are on one screen
        st.subheader("Does it fit per GPU?")
        st.caption(P.source_note(layout))
    verdict, box = choice.verdict, st.container(key="dc-verdict")
    if not choice.runs:
        box.error(verdict.reason)
        return
    mem, s = P.memory(layout), P.get_system(layout.system)
    if verdict.ok and on:  # one line on a projector: the chart titles name the layout
        box.success(f"Fits: {layout.gpus}× {s.name} hold {mem.weights_bytes / GIB:,.1f} GiB "
                    f"of weights per GPU of {s.memory_bytes / GIB:,.0f}, and KV cache for "
                    f"{choice.batch} × {choice.context:,} tokens.")
    elif verdict.ok:
        box.success(f"Fits: {layout.label()} holds {mem.weights_bytes / GIB:,.1f} GiB of "
                    f"weights per GPU of {s.memory_bytes / GIB:,.0f}, and KV cache for "
                    f"{choice.batch} × {choice.context:,} tokens.")
    else:
        box.error(verdict.reason)
    if on:
        return
    a, b, c, d = st.columns(4)
    a.metric("Weights per GPU (GiB)", fmt_number(mem.weights_bytes / GIB))
    b.metric("KV cache per GPU (GiB)", fmt_number(mem.kv_bytes / GIB),
             help="What the engine may use for KV cache after weights, activations and "
                  "runtime buffers")
    c.metric("KV capacity (tokens)", fmt_count(mem.kv_tokens),
             help=f"Tokens of KV cache the whole replica holds: {mem.kv_tokens:,}")
    d.metric(f"Max batch at {choice.context:,} tokens",
             f"{P.max_batch(layout, choice.context):,}")


# ---- decode ------------------------------------------------------------------------
@dataclass(frozen=True)
class FigureSlots:
    """Where decode() and breakdown() draw: in presenter mode the decode figures in a row
    across the page (`numbers`) above the two charts side by side, so all of them are on
    the first screen of a 1280x720 projector; otherwise one under the other, as written."""

    numbers: object | None  # a container; None: decode() draws its figures in `speed`
    speed: object
    step: object


def figure_columns() -> FigureSlots:
    if presenter.is_on():
        numbers = st.container(key="dc-decode-metrics")
        return FigureSlots(numbers, *st.columns(2, gap="medium"))
    return FigureSlots(None, st.container(), st.container())


def _short(layout: P.Layout) -> str:
    """A chart's title in presenter mode: the parallelism and link (the verdict line above
    names the model and system)."""
    link = f" over {interconnect.LINKS[layout.link].name}" if layout.link else ""
    pp = f", PP={layout.pp}" if layout.pp > 1 else ""
    return f"TP={layout.tp}{pp}{link}"


def _usable(choice: Choice) -> list[int]:
    top = P.max_batch(choice.layout, choice.context)
    return [b for b in BATCH_GRID if b <= top]


def decode_frame(choice: Choice) -> pd.DataFrame:
    """Per user and total tokens/s over the batches that fit: measured and ideal."""
    rows = []
    for batch in _usable(choice):
        measured = P.decode_step_seconds(choice.layout, batch, choice.context)
        ideal = P.ideal_decode_step(choice.layout, batch, choice.context).seconds
        for kind, step in zip(KINDS, (measured, ideal), strict=True):
            if kind == KINDS[0] and not choice.layout.measured:
                continue  # roofline only: the ideal line is the whole answer
            for series, value in zip(SERIES, (1 / step, batch / step), strict=True):
                rows.append({"batch": batch, "series": series, "kind": kind,
                             "tokens_per_s": value})
    return pd.DataFrame(rows, columns=["batch", "series", "kind", "tokens_per_s"])


def decode(choice: Choice, numbers=None) -> pd.DataFrame | None:
    """Tokens/s at the chosen batch and over every batch that fits; the frame is returned
    for the local PC chart's axes. `numbers`: where the figures go (presenter mode: a row
    above the charts, the subheader left to the chart's title), else here."""
    if numbers is None:
        st.subheader("Decode speed vs batch")
        numbers = st.container(key="dc-decode-metrics")
    if not choice.runs:
        st.info("Pick a layout that runs to see its speed.")
        return None
    layout, ctx = choice.layout, choice.context
    batch = min(choice.batch, max(1, P.max_batch(layout, ctx)))
    step = P.decode_step(layout, batch, ctx)
    ideal = P.ideal_decode_step(layout, batch, ctx)
    a, b, c, d = numbers.columns(4)
    a.metric(f"Tokens/s per user (batch {batch})", fmt_number(1 / step.seconds))
    b.metric(f"Tokens/s total (batch {batch})", fmt_number(batch / step.seconds))
    c.metric("Decode step", fmt_seconds(step.seconds),
             delta=f"ideal {fmt_seconds(ideal.seconds)}", delta_color="off")
    d.metric("Communication share", f"{step.communication_share:.0%}",
             help="Of the decode step: the tensor-parallel all-reduces and the pipeline hops")
    df = decode_frame(choice)
    title = (f"Decode tokens/s vs batch, {_short(layout)}" if presenter.is_on()
             else f"{layout.label()}, {ctx:,}-token context")
    st.container(key="dc-decode-chart").altair_chart(
        decode_chart(df, title), width="stretch",
        height=presenter.figure_height(PRESENTER_CHART_PX))
    clipped = "" if batch == choice.batch else (
        f" Batch {choice.batch} does not fit this replica's KV cache: shown at {batch}.")
    st.caption("Per user = 1 / step; total = batch / step. Solid: the package's measured "
               "kernels; dashed: our roofline (datasheet bandwidth and FLOPs, ring "
               "all-reduces), a ceiling." + clipped)
    return df


# ---- where the time goes -------------------------------------------------------------
def breakdown_frame(choice: Choice) -> pd.DataFrame:
    """GEMM / attention / communication / other of a decode step at batch 1 and at the
    chosen batch, and of the prompt's prefill; measured and ideal."""
    layout, ctx = choice.layout, choice.context
    batch = min(choice.batch, max(1, P.max_batch(layout, ctx)))
    steps = [(f"decode, batch 1 — {k}", f(1)) for k, f in (
        ("measured", lambda b: P.decode_step(layout, b, ctx)),
        ("ideal", lambda b: P.ideal_decode_step(layout, b, ctx)))]
    steps += [(f"decode, batch {batch} — {k}", f(batch)) for k, f in (
        ("measured", lambda b: P.decode_step(layout, b, ctx)),
        ("ideal", lambda b: P.ideal_decode_step(layout, b, ctx)))]
    if not layout.measured:
        steps = [s for s in steps if s[0].endswith("ideal")]
    rows = [{"step": label, "part": part, "ms": seconds * 1e3, "order": i}
            for i, (label, step) in enumerate(steps)
            for part, seconds in step.parts().items()]
    return pd.DataFrame(rows)


def breakdown(choice: Choice) -> None:
    on = presenter.is_on()
    if not on:  # presenter mode: the chart's title says it, beside the decode chart
        st.subheader("Where a decode step's time goes")
    if not choice.runs:
        return
    title = (f"Where the step's time goes, {_short(choice.layout)}" if on
             else choice.layout.label())
    st.container(key="dc-breakdown-chart").altair_chart(
        breakdown_chart(breakdown_frame(choice), title), width="stretch",
        height=presenter.figure_height(PRESENTER_CHART_PX))
    st.caption("Communication: the tensor-parallel all-reduces (two per layer) and the "
               "pipeline hops. Other: norms, activations, embedding. The roofline counts "
               "weights as GEMM and the KV read as attention.")


def ttft(choice: Choice) -> None:
    """Prefill of the prompt, and the first token after it."""
    st.subheader("Time to first token")
    if not choice.runs:
        return
    layout = choice.layout
    pre, ideal = P.prefill(layout, choice.prompt), P.ideal_prefill(layout, choice.prompt)
    first = pre.seconds + P.decode_step_seconds(layout, 1, choice.prompt)
    a, b, c = st.columns(3)
    a.metric(f"Prefill of {choice.prompt:,} tokens", fmt_seconds(pre.seconds),
             delta=f"ideal {fmt_seconds(ideal.seconds)}", delta_color="off")
    b.metric("TTFT (alone)", fmt_seconds(first), help="Prefill, then one decode step")
    c.metric("All-reduces in the prefill", f"{pre.communication_share:.0%}")
    st.caption("Alone on the replica; under load a prompt also waits for the step in "
               "flight and shares the GPUs with other prompts.")


# ---- links ---------------------------------------------------------------------------
def links_frame(choice: Choice) -> pd.DataFrame:
    """The layout's all-reduces per decode step (at the chosen batch) and per prefill, had
    they run on each link; a pipeline hop over it."""
    layout, p = choice.layout, P.get_model(choice.layout.model).profile
    batch = min(choice.batch, max(1, P.max_batch(layout, choice.context)))
    rows = []
    for link in interconnect.LINKS.values():
        decode_ar = interconnect.tensor_parallel_seconds(batch, p.hidden_size, p.layers,
                                                         layout.tp, link)
        prefill_ar = interconnect.tensor_parallel_seconds(choice.prompt, p.hidden_size,
                                                          p.layers, layout.tp, link)
        hop = interconnect.pipeline_hop_seconds(
            interconnect.activation_bytes(batch, p.hidden_size), link)
        rows.append({"link": link.name, "scope": link.scope,
                     "bandwidth_gbs": link.bandwidth_gbs,
                     "decode_allreduce_ms": decode_ar * 1e3,
                     "prefill_allreduce_ms": prefill_ar * 1e3, "pp_hop_us": hop * 1e6,
                     "source": link.source})
    return pd.DataFrame(rows)


def links(choice: Choice) -> None:
    st.subheader("The same all-reduces on other links")
    if not choice.runs:
        return
    layout = choice.layout
    st.caption(f"TP={layout.tp}: {2 * P.get_model(layout.model).profile.layers} all-reduces a "
               "step, each 2(p−1)/p × batch × hidden × 2 bytes ÷ link bandwidth + one hop's "
               "latency; a pipeline hop is batch × hidden × 2 bytes ÷ bandwidth + latency. "
               "The formula is a floor: the package's measured all-reduces take 1–4× it on "
               "NVLink and up to 28× on 8 PCIe GPUs (docs/datacenter.md).")
    st.dataframe(links_frame(choice), hide_index=True, width="stretch", column_config={
        "link": "Link", "scope": "Between",
        "bandwidth_gbs": st.column_config.NumberColumn("GB/s each way", format="%.1f"),
        "decode_allreduce_ms": st.column_config.NumberColumn(
            f"All-reduces per decode step (ms, batch {min(choice.batch, 1024)})",
            format="%.2f"),
        "prefill_allreduce_ms": st.column_config.NumberColumn(
            f"All-reduces per prefill (ms, {choice.prompt:,} tokens)", format="%.1f"),
        "pp_hop_us": st.column_config.NumberColumn("One pipeline hop (µs)", format="%.1f"),
        "source": "Source"})
    if layout.pp > 1:
        bubbles = ", ".join(f"{m} micro-batch{'es' * (m > 1)}: "
                            f"{interconnect.pipeline_bubble(layout.pp, m):.0%}"
                            for m in (1, layout.pp, 4 * layout.pp))
        st.caption(f"PP={layout.pp}: a prefill split into m micro-batches leaves the stages "
                   f"idle (p−1)/(m+p−1) of the time — {bubbles}. Decode keeps {layout.pp} "
                   f"micro-batches in flight, so a batch of at least {layout.pp} has no "
                   "bubble; one sequence leaves all but one stage idle.")
    s = P.get_system(layout.system)
    nodes = f"{layout.nodes} nodes of {s.gpus_per_node}" if layout.nodes > 1 else "one node"
    st.caption(f"This layout spans {nodes}; between nodes its pipeline hops go over "
               f"{interconnect.LINKS[s.node_link].name}. Pick a link above to run its "
               "communication there: the same GPUs over PCIe take the all-reduces the package "
               "measured on PCIe GPUs; InfiniBand, which it has no data for, the formula.")


# ---- local PCs -----------------------------------------------------------------------
def local_frame(choice: Choice) -> pd.DataFrame:
    """Per-user tokens/s of the same model on each local PC over batch, by the roofline."""
    m = P.get_model(choice.layout.model).profile
    precision = "int8" if choice.layout.dtype == "fp8" else "fp16"
    rows = []
    for key in LOCAL_KEYS:
        hw = hardware.HARDWARE[key]
        for batch in BATCH_GRID:
            p = hardware.decode_tokens_per_s(m, precision, hw, batch, choice.context)
            rows.append({"batch": batch, "device": hw.name, "tokens_per_s": p.per_user,
                         "bound": p.bound})
    return pd.DataFrame(rows)


def local(choice: Choice, datacenter: pd.DataFrame | None) -> None:
    st.subheader("The same model on a local PC")
    df = local_frame(choice)
    values = list(df["tokens_per_s"])
    if datacenter is not None and len(datacenter):
        values += list(datacenter["tokens_per_s"])
    y_domain = [min(values) * 0.8, max(values) * 1.25]
    st.altair_chart(local_chart(df, y_domain), width="stretch")
    one = df[df["batch"] == BATCH_DOMAIN[0]]
    said = "; ".join(f"{r.device}: {fmt_number(r.tokens_per_s)} tokens/s ({r.bound}-bound)"
                     for r in one.itertuples())
    st.caption(f"Batch 1, {choice.context:,}-token context — {said}. The datacenter chart's "
               "y axis, for comparison. A PC that cannot hold the weights streams the rest "
               "over its offload link (PCIe or SSD) every token.")


# ---- capacity and the cost table ---------------------------------------------------
def _demand_inputs(prompt: int) -> tuple[cap.Demand, cap.Slo]:
    for key, value in (("connected", PRESET.connected), ("active", PRESET.active),
                       ("rate", PRESET.tokens_per_s_each), ("ttft", 2.0), ("tpot", 50)):
        st.session_state.setdefault(K + key, value)
    if st.button("Seed example: 1,000 connected, 200 active, 20 tokens/s each",
                 key=K + "preset"):
        st.session_state.update({K + "connected": PRESET.connected,
                                 K + "active": PRESET.active,
                                 K + "rate": PRESET.tokens_per_s_each})
    a, b, c, d, e = st.columns(5)
    connected = a.number_input("Connected users", 1, 10_000_000, step=100, key=K + "connected")
    active = b.number_input("Generating at once", 0, 10_000_000, step=10, key=K + "active")
    rate = c.number_input("Tokens/s each", 1.0, 200.0, step=1.0, key=K + "rate")
    ttft_s = d.number_input("TTFT target (s)", 0.1, 60.0, step=0.5, key=K + "ttft")
    tpot_ms = e.number_input("TPOT target (ms)", 1, 1000, step=5, key=K + "tpot")
    if active > connected:
        st.warning(f"{active:,} generating is more than {connected:,} connected: using "
                   f"{connected:,}.")
        active = connected
    return (cap.Demand(int(connected), int(active), float(rate), prompt_tokens=prompt),
            cap.Slo(float(ttft_s), float(tpot_ms) / 1e3))


def fmt_latency(seconds: float) -> str:
    """A latency in a fifth of a laptop screen: whole ms under a second ("67 ms", where
    "67.4 ms" overflows at 1280 px), then s, min or h."""
    return f"{seconds * 1e3:,.0f} ms" if seconds < 1 else fmt_seconds(seconds)


def capacity(choice: Choice) -> tuple[cap.CapacityPlan, cap.Demand]:
    """Users -> tokens/s needed -> replicas of the chosen layout at the SLO."""
    st.subheader("How many GPUs for your users?")
    demand, slo = _demand_inputs(choice.prompt)
    st.markdown(f"**{demand.active:,} users × {fmt_number(demand.tokens_per_s_each)} "
                f"tokens/s = {fmt_number(demand.tokens_per_s)} tokens/s needed** "
                f"(of {demand.connected:,} connected; prompts of {demand.prompt_tokens:,} "
                f"tokens, answers of {demand.output_tokens:,}).")
    layout = choice.layout
    result = cap.plan(layout, demand, slo)
    if not result.ok:
        st.error(result.reason)
        return result, demand
    a, b, c, d, e = st.columns(5)
    a.metric("Replicas", f"{result.replicas:,}",
             help=f"Each {layout.gpus} GPU{'s' * (layout.gpus > 1)}: TP={layout.tp} × "
                  f"PP={layout.pp}")
    b.metric("GPUs", f"{result.gpus:,}")
    c.metric("Batch per replica", f"{result.batch:,}", help="Users each replica serves at once")
    # TTFT and TPOT apart: as one figure ("113 ms / 30 ms") they overflow a column beside
    # the sidebar; each sits under its target's field above
    d.metric("TTFT", fmt_latency(result.ttft_s), help="Time to first token")
    e.metric("TPOT", fmt_latency(result.tpot_s), help="Time per output token")
    st.caption(f"The fewest replicas whose batch of users each get a token every "
               f"{result.tpot_s * 1e3:,.1f} ms (target {slo.tpot_s * 1e3:,.0f} ms) with "
               f"their prompts' prefills taking {result.prefill_share:.0%} of each "
               "replica's time: our bisection over the package's measured step times, "
               "not its aggregated-serving search. As local PCs the same users need "
               f"{demand.connected:,} PCs, one each, and none is shared.")
    return result, demand


def _price_input(choice: Choice) -> float:
    system = choice.layout.system
    price, source = cap.GPU_HOUR_USD[system]
    key = K + "price_" + system
    st.session_state.setdefault(key, price)
    value = st.number_input(f"{P.get_system(system).name}: USD per GPU-hour", 0.0, 1000.0,
                            step=0.1, key=key, help=f"Default: {source}")
    st.caption(f"Default price ${price:.2f}: {source}.")
    return float(value)


def cost_frame(choice: Choice, result: cap.CapacityPlan, price: float,
               demand: cap.Demand) -> pd.DataFrame:
    """The seed's table: the datacenter at the batch the SLO allows, and each local PC at
    batch 1."""
    rows = []
    layout, ctx = choice.layout, demand.context
    if result.ok and result.batch:
        s = P.get_system(layout.system)
        step = P.decode_step_seconds(layout, result.batch, ctx)
        one = P.decode_step_seconds(layout, 1, ctx)
        rows.append({
            "device": f"{layout.gpus}× {s.name} (TP={layout.tp}, PP={layout.pp})",
            "memory_gib": layout.gpus * s.memory_bytes / GIB,
            "bandwidth_gbs": layout.gpus * s.bandwidth_gbs,
            "link": interconnect.LINKS[layout.tp_link].name,
            "requests": result.batch, "batch_efficiency": result.batch * one / step,
            "usd_per_m_tokens": cap.cost_per_million_tokens(price, layout.gpus,
                                                            result.batch / step),
            "joules_per_token": cap.energy_per_token_j(s.power_w * layout.gpus, step,
                                                       result.batch),
            "source": f"{s.source}; price: {cap.GPU_HOUR_USD[layout.system][1]}"})
    m = P.get_model(layout.model).profile
    for key in LOCAL_KEYS:
        lp = cap.local_plan(m, key, demand)
        rows.append({"device": lp.hardware.name, "memory_gib": lp.hardware.memory_gb,
                     "bandwidth_gbs": lp.hardware.bandwidth_gbs,
                     "link": f"offload {lp.hardware.offload_bandwidth_gbs:g} GB/s",
                     "requests": 1, "batch_efficiency": 1.0, "usd_per_m_tokens": None,
                     "joules_per_token": lp.energy_per_token_j,
                     "source": f"{lp.hardware.source}; power: {cap.LOCAL_POWER_W[key][1]}"})
    return pd.DataFrame(rows)


def cost_table(choice: Choice, planned: tuple[cap.CapacityPlan, cap.Demand]) -> None:
    """The seed's table, for the local PCs and the datacenter at the batch the SLO allows."""
    st.subheader("Local PC vs datacenter: cost and energy per token")
    result, demand = planned
    price = _price_input(choice)
    st.dataframe(cost_frame(choice, result, price, demand), hide_index=True, width="stretch",
                 column_config={
                     "device": "Device",
                     "memory_gib": st.column_config.NumberColumn("Memory (GiB)", format="%.0f"),
                     "bandwidth_gbs": st.column_config.NumberColumn("Bandwidth (GB/s)",
                                                                    format="%.0f"),
                     "link": "Link",
                     "requests": st.column_config.NumberColumn("Requests at once"),
                     "batch_efficiency": st.column_config.NumberColumn(
                         "Batch efficiency (× batch 1)", format="%.1f"),
                     "usd_per_m_tokens": st.column_config.NumberColumn(
                         "USD per million output tokens", format="$%.2f"),
                     "joules_per_token": st.column_config.NumberColumn(
                         "Energy per token (J)", format="%.2f"),
                     "source": "Sources"})
    st.caption("Batch efficiency: tokens/s in total at that batch over tokens/s at batch 1. "
               "Energy per token = board power × step time ÷ tokens per step (the board's "
               "maximum power: the package's kernels carry no energy for these models). A "
               "PC is owned, not rented: no hourly price.")


# ---- the presenter's scenario --------------------------------------------------------
SCENARIO_MODEL, SCENARIO_SYSTEM, SCENARIO_CONTEXT, SCENARIO_BATCH = (
    "llama-3.1-70b", "h100_sxm", 2048, 64)
SCENARIO_STEPS = [  # (label, tp, link)
    ("TP=1: one H100", 1, None),
    ("TP=2: two H100s over NVLink", 2, None),
    ("TP=8: eight H100s over NVLink", 8, None),
    ("TP=8: the same eight over PCIe 5.0", 8, "pcie5"),
]


def scenario_frame() -> pd.DataFrame:
    """Llama-3.1-70B bf16 on H100s, context 2048: whether each layout fits, its speed at
    batch 1 and at the largest batch up to 64 that fits, and the all-reduces' share."""
    rows = []
    for order, (label, tp, link) in enumerate(SCENARIO_STEPS):
        layout = P.Layout(SCENARIO_MODEL, SCENARIO_SYSTEM, "trtllm", tp=tp, link=link)
        verdict = P.check(layout, SCENARIO_CONTEXT, 1)
        row = {"step": label, "order": order, "fits": verdict.ok, "reason": verdict.reason,
               "batch": 0, "per_user": 0.0, "tokens_per_s": 0.0, "comm_share": 0.0}
        if verdict.ok:
            batch = min(SCENARIO_BATCH, P.max_batch(layout, SCENARIO_CONTEXT))
            step = P.decode_step(layout, batch, SCENARIO_CONTEXT)
            row |= {"batch": batch,
                    "per_user": 1 / P.decode_step_seconds(layout, 1, SCENARIO_CONTEXT),
                    "tokens_per_s": batch / step.seconds,
                    "comm_share": step.communication_share}
        rows.append(row)
    return pd.DataFrame(rows)


def scenario_lines(df: pd.DataFrame) -> list[str]:
    """One sentence per step, the same every run."""
    out = []
    for r in df.itertuples():
        if not r.fits:
            out.append(f"**{r.step}** — {r.reason}")
        else:
            out.append(f"**{r.step}** — fits; {fmt_number(r.per_user)} tokens/s per user "
                       f"alone, {fmt_number(r.tokens_per_s)} tokens/s in total at batch "
                       f"{r.batch}, all-reduces {r.comm_share:.0%} of each step.")
    return out


def scenario():
    """"70B on 8 GPUs": a button that plays the four layouts; in presenter mode the bar of
    `presenter_bar()` instead, whose Settings popover it returns for `controls()`."""
    if presenter.is_on():
        return presenter_bar()
    st.session_state.setdefault(KEY_SCENARIO, False)
    if st.button("70B on 8 GPUs", key=K + "scenario_button", type="secondary",
                 help=SCENARIO_HELP):
        st.session_state[KEY_SCENARIO] = True
    if not st.session_state[KEY_SCENARIO]:
        return None
    with st.container(border=True, key="dc-scenario"):
        st.markdown(f"**Scenario: {SCENARIO_TITLE}**")
        df = scenario_frame()
        for line in scenario_lines(df):
            st.markdown(line)
        st.altair_chart(scenario_chart(df), width="stretch")
        label, tp, link = SCENARIO_STEPS[-1]
        st.caption(f"{label}: " + P.source_note(
            P.Layout(SCENARIO_MODEL, SCENARIO_SYSTEM, "trtllm", tp=tp, link=link)))
    return None


SCENARIO_TITLE = (f"Llama-3.1-70B bf16 on H100 SXM, {SCENARIO_CONTEXT:,}-token context, "
                  "TensorRT-LLM kernels")
SCENARIO_HELP = "Scripted: Llama-3.1-70B on H100s, TP=1, 2 and 8, NVLink vs PCIe"
STAGES = tuple(f"tp{tp}{'-' + link if link else ''}" for _, tp, link in SCENARIO_STEPS)
STAGE_BUTTONS = ("TP=1: one H100", "TP=2: NVLink", "TP=8: NVLink", "TP=8: PCIe 5.0")


def stage_settings(stage: str) -> dict[str, object]:
    """The controls' values (by widget key) that show one layout of the scenario."""
    _, tp, link = SCENARIO_STEPS[STAGES.index(stage)]
    return {KEY_MODEL: SCENARIO_MODEL, KEY_SYSTEM: SCENARIO_SYSTEM, KEY_BACKEND: "trtllm",
            KEY_TP: tp, KEY_PP: 1, KEY_DTYPE: "bf16", KEY_LINK: link or OWN_LINK,
            KEY_CONTEXT: SCENARIO_CONTEXT, KEY_BATCH: SCENARIO_BATCH}


def current_stage() -> str | None:
    """The stage last set from the bar, while the controls still show it (None once the
    presenter changes a setting by hand)."""
    ss = st.session_state
    stage = ss.get(KEY_STAGE)
    if stage not in STAGES:
        return None
    shown = all(ss.get(k) == v for k, v in stage_settings(stage).items())
    return stage if shown else None


def presenter_bar():
    """Presenter mode: "70B on 8 GPUs" (its first layout) and one button per layout, in
    the row style of the other pages' bars, and a Settings popover at the row's end (the
    container returned); the clicker steps through the layouts. A stage sets the controls
    (before they are drawn), so the verdict, the decode chart and the step-time bar below
    show that layout."""
    ss = st.session_state
    st.caption(f"70B on 8 GPUs: Llama-3.1-70B bf16, H100 SXM, {SCENARIO_CONTEXT:,}-token "
               f"context, batch {SCENARIO_BATCH}. Clicker: PageDown or → the next layout, "
               "PageUp or ← the previous one.")
    current = current_stage()
    chosen = clicker.pick(STAGES, current, clicker.step())
    first, *cells, settings = st.columns([1.15] + [1] * len(STAGES) + [0.8],
                                         vertical_alignment="center")
    if first.button("70B on 8 GPUs", key=K + "scenario_button", width="stretch",
                    help=SCENARIO_HELP, type="primary" if current is None else "secondary"):
        chosen = STAGES[0]
    for col, stage, title in zip(cells, STAGES, STAGE_BUTTONS, strict=True):
        if col.button(title, key=f"{K}stage_{stage}", width="stretch",
                      type="primary" if stage == current else "secondary"):
            chosen = stage
    if chosen is not None:
        ss[KEY_STAGE] = chosen
        ss.update(stage_settings(chosen))
        st.rerun()
    return settings.popover("Settings", width="stretch",
                            help="Model, system, TP × PP, link, context, batch")


def sources() -> None:
    """Where every datasheet number and price comes from."""
    with st.expander("Sources"):
        lines = [f"- **{s.name}**: {s.source}" for s in P.systems().values()]
        lines += [f"- **{link.name}**: {link.source}" for link in interconnect.LINKS.values()]
        lines += [f"- **{P.get_system(k).name} price** ${v:.2f}/GPU-hour: {src}"
                  for k, (v, src) in cap.GPU_HOUR_USD.items()]
        lines += [f"- **{hardware.HARDWARE[k].name} power** {w:g} W: {src}"
                  for k, (w, src) in cap.LOCAL_POWER_W.items()]
        st.markdown("\n".join(lines))
