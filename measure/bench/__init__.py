"""The bench: this engine against transformers and the local PC on one request mix.

requests (the mix) -> runs (one function per run kind) -> report (table, ratios, roofline
floor, JSON); cli parses the flags and runs them in turn (`python -m measure.bench`).
"""
