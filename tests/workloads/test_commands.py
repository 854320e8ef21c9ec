"""`batchlens race` and `batchlens sweep` refuse bad flags with a usage error before they
load a model."""

from __future__ import annotations

import pytest

from workloads import race, sweep


@pytest.mark.parametrize(("command", "argv", "words"), [
    ("race", ["--users", "0"], "--users must be in [1, 256], got 0"),
    ("race", ["--users", "100000"], "--users must be in [1, 256], got 100000"),
    ("race", ["--max-tokens", "-3"], "--max-tokens: max_tokens must be >= 1, got -3"),
    ("race", ["--prompt", "  "], "--prompt must not be empty"),
    ("sweep", ["--prompt", " "], "--prompt must not be empty"),
    ("sweep", ["--users", "0,4"], "users: each must be an integer in [1, 256], got 0"),
    ("sweep", ["--max-tokens", "0"], "max_tokens: must be an integer >= 1, got 0"),
])
def test_bad_flags_are_a_usage_error(capsys, command, argv, words):
    main = {"race": race.main, "sweep": sweep.main}[command]
    with pytest.raises(SystemExit) as exc:
        main(argv, prog=f"batchlens {command}")
    assert exc.value.code == 2
    assert f"batchlens {command}: error: {words}" in capsys.readouterr().err
