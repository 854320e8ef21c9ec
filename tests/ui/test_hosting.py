"""A shared instance: when this server is one, the admin's caps, and number inputs that say
why a value cannot be used (no model, no browser)."""

from __future__ import annotations

import pytest
from streamlit import config

from engine import ServingStats
from ui import hosting
from ui.hosting import Caps
from ui.inputs import range_error


@pytest.fixture
def secrets(monkeypatch):
    """The secrets `ui.hosting` reads, as a dict the test fills."""
    values: dict = {}
    monkeypatch.setattr(hosting, "_secret", values.get)
    monkeypatch.delenv("BATCHLENS_HOSTED", raising=False)
    monkeypatch.delenv("BATCHLENS_MAX_WAITING", raising=False)
    return values


@pytest.fixture
def address():
    """Set Streamlit's `server.address` for one test."""
    before = config.get_option("server.address")
    yield lambda value: config.set_option("server.address", value)
    config.set_option("server.address", before)


def test_loopback_is_local_and_any_other_bind_address_is_hosted(secrets, address):
    for local in ("localhost", "127.0.0.1", "::1"):
        address(local)
        assert not hosting.is_hosted(), local
    for shared in ("0.0.0.0", "::", "10.0.0.5", None):  # None: Streamlit binds every address
        address(shared)
        assert hosting.is_hosted(), shared


def test_the_secret_or_the_environment_make_a_loopback_server_hosted(secrets, address,
                                                                      monkeypatch):
    address("localhost")
    secrets["hosted"] = True
    assert hosting.is_hosted()
    secrets.clear()
    monkeypatch.setenv("BATCHLENS_HOSTED", "1")
    assert hosting.is_hosted()


def test_the_repositorys_config_binds_loopback():
    """`make run` (and AppTest, from the repository root) is a local instance."""
    assert config.get_option("server.address") == "localhost"
    assert config.get_option("server.fileWatcherType") == "none"


def test_caps_come_from_secrets_with_the_apis_default_queue(secrets):
    assert hosting.caps() == Caps(None, None, 256)
    secrets.update(max_race_users=16, max_race_tokens="4096", max_waiting=0)
    assert hosting.caps() == Caps(16, 4096, 0)
    secrets["max_race_users"] = "many"
    with pytest.raises(ValueError, match="max_race_users must be a whole number"):
        hosting.caps()
    secrets["max_race_users"] = 0
    with pytest.raises(ValueError, match="max_race_users must be >= 1"):
        hosting.caps()


def test_a_run_over_a_cap_is_refused_naming_the_cap():
    caps = Caps(max_users=16, max_tokens=4096)
    caps.check(16, 256)  # 4,096 tokens: at the cap
    with pytest.raises(ValueError, match=r"at most 16 users per race, got 32"):
        caps.check(32, 64)
    with pytest.raises(ValueError, match=r"8 users x 1,024 = 8,192 tokens, over this "
                                         r"instance's cap of 4,096 per race"):
        caps.check(8, 1024)
    with pytest.raises(ValueError, match="at most 1 user per sweep point"):
        Caps(max_users=1).check(2, 1, "sweep point")


class FakeQueue:
    """Stand-in engine (tests only): `waiting` requests in its queue."""

    def __init__(self, waiting: int) -> None:
        self.waiting = waiting

    def stats(self, steps_after=None):
        return ServingStats("fake", "cpu", "float32", "", 0, self.waiting, (), (), 0, 0, 0, 0, 0)


def test_a_full_queue_refuses_new_runs_with_the_apis_wording():
    Caps(max_waiting=10).check_queue(FakeQueue(9))
    with pytest.raises(ValueError, match=r"^busy: 10 waiting"):
        Caps(max_waiting=10).check_queue(FakeQueue(10))


@pytest.mark.parametrize("value, message", [
    (8, None), (1, None), (64, None),
    (0, "Users: 0 is out of range; enter a whole number from 1 to 64"),
    (100, "Users: 100 is out of range; enter a whole number from 1 to 64"),
    (-3, "Users: -3 is out of range"),
    (2.5, "Users: 2.5 is out of range"),
    (None, "Users: enter a whole number from 1 to 64"),
])
def test_an_out_of_range_number_gets_a_message(value, message):
    got = range_error("Users", value, 1, 64)
    assert got == message if message is None else got.startswith(message)


@pytest.mark.parametrize(("value", "message"), [
    (0.25, "Tokens/s: 0.25 is out of range; enter a number from 0.5 to 1,000"),
    (5000.0, "Tokens/s: 5,000 is out of range; enter a number from 0.5 to 1,000"),
    (2.5, None),
])
def test_an_out_of_range_fraction_gets_a_message(value, message):
    assert range_error("Tokens/s", value, 0.5, 1000.0, whole=False) == message
