"""Datacenter: a model on many GPUs. Tensor and pipeline parallelism, the link between the
GPUs, memory per GPU, speed against batch, where a step's time goes, how many GPUs a set
of users needs and what a token costs, from NVIDIA's measured kernel data
(measure/projection.py), with our roofline beside it and for the local PCs."""

from ui import datacenter_view as view

view.intro()

# The presenter's scripted scenario: "70B on 8 GPUs" (TP=1, 2, 8; NVLink vs PCIe). In
# presenter mode a bar of its layouts, which the clicker steps through, and a Settings
# popover at its end.
settings = view.scenario()

# Model, system, engine, TP × PP, dtype, link, context, batch, prompt (in presenter mode
# inside the bar's Settings popover).
choice = view.controls(settings)

# Memory per GPU and the verdict (or the one-line reason the layout cannot run).
view.fit(choice)

# Decode tokens/s per user and in total vs batch: measured beside the roofline; where a
# step's time goes (side by side in presenter mode). Then the prompt's prefill and TTFT.
slots = view.figure_columns()
with slots.speed:
    curves = view.decode(choice, slots.numbers)
with slots.step:
    view.breakdown(choice)
view.ttft(choice)

# The same all-reduces on NVLink, PCIe and InfiniBand.
view.links(choice)

# The same model on local PCs, on the same axes.
view.local(choice, curves)

# Users -> tokens/s needed -> replicas and GPUs at the SLO; then cost and energy per token.
planned = view.capacity(choice)
view.cost_table(choice, planned)

view.sources()
