"""AppTest of a shared instance and of what no visitor can break: locked settings, pools
sized against memory, rebuilds that let other sessions' races finish, one run per session,
the admin's caps, inputs that say what is out of range, and a stopped race's panel."""

from __future__ import annotations

import dataclasses
import time

import pytest
from apptest import keyed, new_app, run_until, wait_idle
from streamlit import config
from streamlit.testing.v1 import AppTest

from engine import SamplingParams
from ui import arena, settings, shared, sweep_view

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_engine")]
HOSTED = {"hosted": True}
ADMIN = {"hosted": True, "admin_password": "s3cret"}


def sidebar_input(at: AppTest, label: str):
    return next(n for n in at.sidebar.number_input if n.label == label)


def side_caption(at: AppTest, side: str) -> str:
    return " ".join(c.value for c in keyed(at, f"side-{side}").caption)


def test_hosted_without_an_admin_password_the_settings_cannot_be_changed():
    at = new_app(secrets=HOSTED)
    engine = shared.shared_engine().engine
    assert all(n.disabled for n in at.sidebar.number_input)
    assert at.sidebar.button[0].disabled
    assert at.sidebar.info and at.sidebar.info[0].value == settings.LOCKED
    assert not at.sidebar.text_input  # no password field: there is nothing to unlock
    at.run()
    assert not at.exception and shared.shared_engine().engine is engine
    # an uncaught exception would show a generic line, no type, message or traceback
    assert config.get_option("client.showErrorDetails") == "none"
    new_app()  # a local instance (the repository's config) shows everything again
    assert config.get_option("client.showErrorDetails") == "full"


def test_hosted_an_admin_gets_a_one_line_refusal_for_an_oversized_pool():
    at = new_app(secrets=ADMIN)
    engine = shared.shared_engine().engine
    sidebar_input(at, "KV pool (blocks)").set_value(10_000_000)
    at.sidebar.text_input[0].input("wrong")
    at.sidebar.button[0].click().run()
    assert "admin password" in at.sidebar.error[0].value
    at.sidebar.text_input[0].input("s3cret")
    at.sidebar.button[0].click().run()
    assert not at.exception
    error = at.sidebar.error[0].value
    assert error.startswith("Not applied: num_kv_blocks: a pool of 10,000,000 blocks")
    assert "of RAM free for it" in error and "the largest pool that fits is" in error
    assert "\n" not in error and "Traceback" not in error and "/" not in error.split("(")[0]
    assert shared.shared_engine().engine is engine  # nothing was built


def test_a_new_block_size_keeps_the_pools_memory():
    at = new_app()
    old = shared.shared_engine().engine
    assert "GiB" in " ".join(c.value for c in at.sidebar.caption)  # the pool in GiB
    sidebar_input(at, "Block size (tokens)").set_value(old.kv.block_size * 2)
    at.sidebar.button[0].click().run()
    new = shared.shared_engine().engine
    assert new.kv.block_size == old.kv.block_size * 2
    assert new.kv.num_blocks == old.kv.num_blocks // 2
    assert "the same memory" in at.sidebar.success[0].value
    assert shared.shared_engine().wait_drained(timeout=60)


@pytest.fixture
def patient_slot(monkeypatch):
    """The arena's races outlive a minute without a page refresh: alice's tab waits while
    the admin's (in the same test) works, as two real tabs would refresh each other."""
    monkeypatch.setattr(arena, "SLOT", dataclasses.replace(arena.SLOT, heartbeat_s=600.0))


@pytest.mark.usefixtures("patient_slot")
def test_a_rebuild_lets_another_sessions_race_finish_on_the_old_engine():
    alice, admin = new_app(), new_app(secrets=ADMIN)
    alice.number_input(key="arena_users").set_value(3)
    alice.number_input(key="arena_max_tokens").set_value(48)
    alice.button(key="arena_run").click().run()
    race = alice.session_state[arena.SLOT.key]
    old = shared.shared_engine().engine
    run_until(alice, lambda a: race.snapshot().sides["datacenter"].total_tokens > 0)
    sidebar_input(admin, "Max concurrent sequences").set_value(8)
    admin.sidebar.text_input[0].input("s3cret")
    admin.sidebar.button[0].click().run()
    assert shared.shared_engine().engine is not old  # new requests go to the new engine
    run_until(alice, lambda a: bool(a.success) or bool(a.error) or bool(a.warning))
    assert not alice.error and not alice.warning, (alice.error, alice.warning)
    assert race.snapshot().sides["datacenter"].users_finished == 3
    assert shared.shared_engine().wait_drained(timeout=60)
    assert old.runner is None  # shut down and released once drained


@pytest.mark.usefixtures("patient_slot")
def test_a_rebuild_past_the_drain_limit_tells_the_race_in_plain_words(monkeypatch):
    monkeypatch.setattr(shared, "DRAIN_S", 0.5)
    alice, admin = new_app(), new_app(secrets=ADMIN)
    alice.number_input(key="arena_users").set_value(3)
    alice.number_input(key="arena_max_tokens").set_value(1000)
    alice.button(key="arena_run").click().run()
    race = alice.session_state[arena.SLOT.key]
    run_until(alice, lambda a: race.snapshot().sides["datacenter"].total_tokens > 0)
    admin.sidebar.text_input[0].input("s3cret")
    admin.sidebar.button[0].click().run()
    run_until(alice, lambda a: bool(a.warning) or bool(a.error))
    assert not alice.error and not alice.exception
    assert alice.warning[0].value == ("The admin changed the engine settings; this race was "
                                      "stopped.")
    assert shared.shared_engine().wait_drained(timeout=60)


def test_one_run_at_a_time_per_browser_session():
    at = new_app()
    at.number_input(key="arena_users").set_value(2)
    at.number_input(key="arena_max_tokens").set_value(400)
    at.button(key="arena_run").click().run()
    race = at.session_state[arena.SLOT.key]
    at.switch_page("pages/sweep.py").run()
    at.button(key="sweep_run_button").click().run()
    assert sweep_view.SLOT.key not in at.session_state
    assert any("one run at a time per browser session, and your race is still running"
               in e.value for e in at.error)
    race.stop()
    assert race.join(timeout=60)
    wait_idle(shared.shared_engine().engine)


def test_the_admins_caps_and_a_full_queue_refuse_a_race_by_name():
    at = new_app(secrets={"max_race_users": 4, "max_race_tokens": 1000})
    at.button(key="arena_run").click().run()  # 8 users by default
    assert "users: this instance allows at most 4 users per race, got 8" in at.error[0].value
    at.number_input(key="arena_users").set_value(4)
    at.number_input(key="arena_max_tokens").set_value(500).run()
    at.button(key="arena_run").click().run()
    assert "4 users x 500 = 2,000 tokens, over this instance's cap of 1,000" in (
        at.error[0].value)
    busy = new_app(secrets={"max_waiting": 0})
    busy.button(key="arena_run").click().run()
    assert busy.error[0].value.startswith("Not started: busy: 0 waiting")
    assert arena.SLOT.key not in busy.session_state


def test_an_out_of_range_number_says_so_and_disables_run():
    at = new_app()
    at.number_input(key="arena_users").set_value(100).run()
    assert any("Users: 100 is out of range; enter a whole number from 1 to 64" in e.value
               for e in at.error)
    assert at.button(key="arena_run").disabled
    at.number_input(key="arena_users").set_value(64).run()
    assert not at.error and not at.button(key="arena_run").disabled


def test_a_stopped_race_says_stopped_and_how_many_users_finished():
    at = new_app()
    at.number_input(key="arena_users").set_value(4)
    at.number_input(key="arena_max_tokens").set_value(400)
    at.button(key="arena_run").click().run()
    race = at.session_state[arena.SLOT.key]
    run_until(at, lambda a: race.snapshot().sides["datacenter"].total_tokens > 8)
    at.button(key="arena_stop").click().run()
    engine = shared.shared_engine().engine
    assert engine.stats().kv.used_blocks == 0  # Stop returns once the blocks are free
    run_until(at, lambda a: bool(a.warning))
    done = race.snapshot().sides["datacenter"].users_finished  # answers ended by EOS
    assert done < 4
    assert side_caption(at, "datacenter") == f"Stopped: {done} of 4 users finished."
    assert at.warning[0].value.startswith(f"Stopped: {done} of 4 users finished on the "
                                          "datacenter")


def test_a_dead_engine_loop_says_engine_stopped_and_the_admin_restarts_it():
    at = new_app(secrets=ADMIN)
    engine = shared.shared_engine().engine
    core = engine.core

    def die():
        raise RuntimeError("injected loop failure")

    core.schedule = die  # the loop fails outside a model step: it stops
    engine.submit("Hi", SamplingParams(max_tokens=2))
    deadline = time.monotonic() + 20
    while engine.stopped_reason is None:
        assert time.monotonic() < deadline, "the loop did not stop"
        time.sleep(0.05)
    del core.schedule  # the cause is gone; a restart builds a fresh core anyway
    at.run()
    errors = " ".join(e.value for e in at.sidebar.error)
    assert "Engine stopped" in errors
    assert not at.exception
    at.sidebar.text_input(key="restart-password").set_value("wrong")
    at.sidebar.button(key="restart-engine").click().run()
    assert engine.stopped_reason is not None
    assert "Only an admin" in " ".join(e.value for e in at.sidebar.error)
    at.sidebar.text_input(key="restart-password").set_value("s3cret")
    at.sidebar.button(key="restart-engine").click().run()
    assert engine.stopped_reason is None and shared.shared_engine().engine is engine
    out = engine.submit("Hi", SamplingParams(max_tokens=2)).result(timeout=60)
    assert out.error is None and len(out.token_ids) >= 1
    assert not any(b.key == "restart-engine" for b in at.sidebar.button)
