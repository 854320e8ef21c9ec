"""AppTest of the shell: navigation over pages/, the shared engine, its settings, status."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from apptest import APP, new_app, run_until, wait_idle
from streamlit.testing.v1 import AppTest

from ui import arena, settings, shared

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_engine")]
ROOT = Path(APP).parent
STRIP = re.compile(r"running: (\d+) · waiting: (\d+) · yours: (\d+)")


def sidebar_input(at: AppTest, label: str):
    return next(n for n in at.sidebar.number_input if n.label == label)


def strip_counts(at: AppTest) -> tuple[int, int, int] | None:
    """(running, waiting, yours) from the status strip, or None if it is not drawn."""
    m = STRIP.search(at.caption[0].value) if at.caption else None
    return tuple(map(int, m.groups())) if m else None


def test_a_page_dropped_into_pages_joins_the_menu_after_arena(tmp_path):
    shutil.copy(APP, tmp_path / "dashboard.py")
    shutil.copytree(ROOT / "pages", tmp_path / "pages")
    (tmp_path / "pages" / "zz_extra.py").write_text('import streamlit as st\nst.header("Extra")\n')
    at = AppTest.from_file(str(tmp_path / "dashboard.py"), default_timeout=120).run()
    assert not at.exception
    assert at.header[0].value.startswith("Arena")  # arena is the default page
    at.switch_page("pages/zz_extra.py").run()
    assert not at.exception and at.header[0].value == "Extra"


def test_the_status_strip_shows_other_sessions_requests():
    alice, bob = new_app(), new_app()
    alice.number_input(key="arena_users").set_value(3)
    alice.number_input(key="arena_max_tokens").set_value(300)
    alice.button(key="arena_run").click().run()
    race = alice.session_state[arena.SLOT.key]
    run_until(bob, lambda a: strip_counts(a) not in (None, (0, 0, 0)))
    running, waiting, yours = strip_counts(bob)
    # alice's requests in flight (up to 3: an answer may end early at EOS): none of them bob's
    assert 0 < running + waiting <= 3 and yours == 0, bob.caption[0].value
    run_until(alice, lambda a: (strip_counts(a) or (0, 0, 0))[2] > 0)
    running, waiting, yours = strip_counts(alice)
    assert running + waiting == yours <= 3, alice.caption[0].value
    race.stop()
    assert race.join(timeout=60)


def test_apply_rebuilds_the_shared_engine_on_the_same_weights():
    at = new_app()
    holder = shared.shared_engine()
    old, loaded = holder.engine, holder.loaded
    sidebar_input(at, "Block size (tokens)").set_value(32)
    sidebar_input(at, "KV pool (blocks)").set_value(256)
    next(c for c in at.sidebar.checkbox if c.label.startswith("Speculative")).check()
    at.sidebar.button[0].click().run()
    assert not at.exception
    new = holder.engine
    assert new is not old and new.loaded is loaded  # no reload of the weights
    assert new.kv.block_size == 32 and new.kv.num_blocks == 256
    assert old.speculation is None and new.config.speculative == "ngram"
    assert at.sidebar.success and "256 blocks of 32 tokens" in at.sidebar.success[0].value
    with pytest.raises(RuntimeError):  # the old engine is shut down
        old.submit("hello")


def test_impossible_settings_show_a_readable_error_and_keep_the_engine():
    at = new_app()
    engine = shared.shared_engine().engine
    sidebar_input(at, "Block size (tokens)").set_value(1)
    sidebar_input(at, "KV pool (blocks)").set_value(1)
    at.sidebar.button[0].click().run()
    assert at.sidebar.error and "num_kv_blocks" in at.sidebar.error[0].value
    assert shared.shared_engine().engine is engine


def test_with_an_admin_password_only_the_admin_can_apply():
    at = new_app(secrets={"admin_password": "s3cret"})
    engine = shared.shared_engine().engine
    sidebar_input(at, "Max concurrent sequences").set_value(8)
    at.sidebar.button[0].click().run()
    assert "admin password" in at.sidebar.error[0].value
    assert shared.shared_engine().engine is engine
    at.sidebar.text_input[0].input("s3cret")
    at.sidebar.button[0].click().run()
    assert shared.shared_engine().engine.config.max_num_seqs == 8
    wait_idle(shared.shared_engine().engine)


def test_admin_password_is_none_without_secrets():
    assert settings.admin_password() is None
