"""`batchlens fleet`'s flags: a named scenario is a whole run, other flags describe one."""

from __future__ import annotations

import pytest

from fleet.cli import build_parser, scenario_from_args
from fleet.scenarios import SCENARIOS


def scenario_for(*argv: str):
    ap = build_parser("batchlens fleet")
    return scenario_from_args(ap.parse_args(list(argv)), ap)


def test_a_named_scenario_runs_as_named():
    assert scenario_for("--scenario", "speed").name == SCENARIOS["speed"]().name


def test_a_flag_a_named_scenario_would_ignore_is_refused():
    with pytest.raises(ValueError, match="--scenario speed sets the whole run: drop "
                                         "--hours, --replicas, or drop --scenario"):
        scenario_for("--scenario", "speed", "--hours", "2", "--replicas", "3")


def test_flags_without_a_trace_describe_the_run_instead_of_the_day():
    scenario = scenario_for("--hours", "0.5", "--replicas", "3", "--router", "round_robin",
                            "--tokens-per-s", "200")
    assert (scenario.name, scenario.config.router, scenario.config.replicas) == (
        "custom", "round_robin", 3)
    assert scenario.trace.duration_s == pytest.approx(1800)
    with pytest.raises(ValueError, match="hours"):
        scenario_for("--hours", "-2")
