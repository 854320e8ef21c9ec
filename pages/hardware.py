"""Hardware: does a model fit, how fast can it decode, and how long does an answer take,
on a PC and in a datacenter. Every number is a roofline projection from measure/hardware.py
(vendor datasheets) or a measurement of this machine (measure/calibrate.py)."""

import streamlit as st

from ui import hardware_view as view

view.intro()

# Model, precision, hardware (this machine included, measured), context length, batch.
choice = view.controls()
view.datasheet(choice)

# Memory: weights + KV cache against the device, and the verdict.
# Time: prefill of the context, then the answer at decode speed.
memory, time = st.columns(2, gap="large")
with memory:
    view.fit(choice)
with time:
    view.response(choice)

# Decode tokens/s per user and in total over batch 1..1024, with B* marked.
view.decode(choice)

# The product's two reference tables: model sizes, and local PC vs datacenter.
view.reference_tables(choice)
