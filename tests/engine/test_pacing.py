"""The local side's pacing schedule (`engine.local.Release`), on a fake pace and clock."""

from __future__ import annotations

import pytest

from engine.local import Release


class FakePace:
    """A projected device with a fixed prefill rate and a decode time that grows with context."""

    label = "fake device"

    def prefill_seconds(self, prompt_tokens: int) -> float:
        return 0.01 * prompt_tokens

    def decode_seconds(self, context: int) -> float:
        return 0.5 + 0.001 * context


def test_first_token_waits_out_the_projected_prefill_only():
    release = Release(FakePace(), prompt_tokens=100, start=10.0)
    assert release.due(range(100, 101)) == pytest.approx(11.0)


def test_each_later_token_is_due_its_decode_time_after_the_one_before():
    release = Release(FakePace(), prompt_tokens=100, start=10.0)
    release.sent(release.due(range(100, 101)))  # the machine beat the projection: sent on time
    assert release.due(range(101, 102)) == pytest.approx(11.0 + 0.601)
    release.sent(11.601)
    # two tokens at once (a speculative step) are due both decode times later
    assert release.due(range(102, 104)) == pytest.approx(11.601 + 0.602 + 0.603)


def test_a_slow_step_is_not_paid_for_twice():
    release = Release(FakePace(), prompt_tokens=100, start=10.0)
    release.due(range(100, 101))
    release.sent(15.0)  # the real step took longer than the projected prefill
    assert release.due(range(101, 102)) == pytest.approx(15.0 + 0.601)


def test_a_token_sent_early_does_not_move_the_schedule_back():
    release = Release(FakePace(), prompt_tokens=100, start=10.0)
    release.due(range(100, 101))
    release.sent(10.5)  # stamped before `due`: the schedule, not the stamp, holds
    assert release.due(range(101, 102)) == pytest.approx(11.0 + 0.601)
