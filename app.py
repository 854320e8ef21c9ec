"""batchlens: one server, two doors. `streamlit run app.py` (`make run`) serves the dashboard
(dashboard.py) and, on the same port and the same shared engine, the OpenAI-compatible API
(/v1/models, /v1/completions, /v1/chat/completions), /health and /metrics (ui/api.py), so
scripts' requests are batched together with browser users'."""

import streamlit as st

from ui import api

app = st.App("dashboard.py", routes=api.routes(), lifespan=api.lifespan)
