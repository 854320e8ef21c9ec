"""Fleet: a day of a service on a simulated clock. Demand against capacity, replicas added
after their cold start, TTFT and TPOT through the day, the queue, GPU-hours, cost per
million tokens and energy per token, and the same users each on a local PC."""

from ui import fleet_view as view

view.intro()

# The presenter's scripted day: 1,000 connected users, 200 active, 20 tokens/s each (in
# presenter mode with a Settings popover beside it, which holds the form).
day, settings = view.scenario()

# Trace, layout, router, autoscaler, local PC; Run.
params = view.controls(settings)

# Progress, then the figures, the four charts and the local PCs beside them.
view.results(params, day)

view.how_simulated()
