"""Streamlit glue for the batchlens dashboard: shared engine, chrome, page parts, charts."""
