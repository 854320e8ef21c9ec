"""batchlens: one server, two doors. `streamlit run app.py` (`make run`) serves the dashboard
(dashboard.py) and, on the same port and the same shared engine, the OpenAI-compatible API
(/v1/models, /v1/completions, /v1/chat/completions), /health and /metrics (ui/api.py), so
scripts' requests are batched together with browser users'."""

import streamlit as st
from streamlit.runtime.pages_manager import PagesManager

from ui import api

# dashboard.py lays the pages out with st.navigation. Streamlit otherwise takes the pages/
# folder beside it for its older folder mode until some session has run st.navigation, so
# a page's own URL opened first on a fresh server (a presenter's bookmark of
# /kv_cache?presenter=1) would show that page alone, without the shell or presenter mode.
PagesManager.uses_pages_directory = False

app = st.App("dashboard.py", routes=api.routes(), middleware=api.middleware(),
             lifespan=api.lifespan)
