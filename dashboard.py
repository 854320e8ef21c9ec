"""batchlens: the dashboard script (app.py serves it). Navigation over pages/, and the
shared chrome: page config, the one-line claim, the shared engine (loaded once), its
sidebar settings (hidden in presenter mode; the admin's on a shared instance, see
ui/hosting.py), the presenter-mode switch and the status strip (in presenter mode, one plain
header line instead of the title)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from ui import hosting, presenter, settings, shared, status

HERE = Path(__file__).resolve().parent
# Menu order and labels of known pages; only files that exist in pages/ are shown, and any
# other page file dropped into pages/ is appended after these.
PAGES: dict[str, tuple[str, str]] = {
    "arena": ("Arena", ":material/sports_score:"),
    "sweep": ("Sweep", ":material/stacked_line_chart:"),
    "kv_cache": ("KV cache", ":material/grid_view:"),
    "hardware": ("Hardware", ":material/memory:"),
    "datacenter": ("Datacenter", ":material/dns:"),
    "fleet": ("Fleet", ":material/hub:"),
}


def page_list() -> list[st.Page]:
    """st.Page objects for the files in pages/, arena first and the default."""
    stems = sorted(p.stem for p in (HERE / "pages").glob("*.py") if not p.stem.startswith("_"))
    ordered = [s for s in PAGES if s in stems] + [s for s in stems if s not in PAGES]
    out = []
    for i, stem in enumerate(ordered):
        title, icon = PAGES.get(stem, (stem.replace("_", " ").capitalize(), ":material/article:"))
        out.append(st.Page(HERE / "pages" / f"{stem}.py", title=title, icon=icon,
                           url_path=stem, default=i == 0))
    return out


hosting.protect_errors()  # first: a shared instance never shows a traceback
# A presenter's screen is the page: the sidebar starts collapsed and the pages are linked
# from the top bar instead.
wanted = presenter.wanted()
st.set_page_config(page_title="batchlens", page_icon=":material/speed:", layout="wide",
                   initial_sidebar_state="collapsed" if wanted else "auto")
page = st.navigation(page_list(), position="top" if wanted else "sidebar")
holder = shared.shared_engine()
presenting = presenter.sync_from_url()  # before the toggle widget: it may set its state
presenter.toggle()
presenter.apply_style()
if not presenting:  # a projector's page hides the engine settings
    st.title("A local PC serves one user at a time; a datacenter batches everyone.")
    settings.engine_settings(holder)
status.status_strip()
page.run()
