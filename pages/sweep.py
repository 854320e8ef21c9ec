"""Sweep: 1 to 64 users (or Poisson arrival rates) on both sides, one after the other, with
total and per-user tokens/s, TTFT and end-to-end latency, goodput and this machine's
roofline."""

from ui import sweep_view as view

view.intro()

# Load (users or arrival rates), max tokens, prompts; Run and Stop.
view.controls()

# Progress, the four charts, goodput under SLOs, connected vs active users, every point + CSV.
view.live()

view.how_measured()
