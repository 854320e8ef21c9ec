"""Finished fleet runs on disk: computed once per key and code version, read back equal."""

from __future__ import annotations

from fleet import store


def fake_run(calls: list[int]):
    def compute():
        calls.append(1)
        return ({"requests": 3, "ttft_p50": 0.25, "layout": "x"},
                {"replicas": [{"t": 0.0, "n": 1}, {"t": 60.0, "n": 2}]})
    return compute


def test_a_run_is_computed_once_and_read_back_equal(tmp_path):
    calls: list[int] = []
    first = store.stored_run("day", fake_run(calls), tmp_path)
    second = store.stored_run("day", fake_run(calls), tmp_path)
    assert calls == [1]
    assert second == first
    assert store.run_path("day", tmp_path).is_file()


def test_another_key_or_another_code_version_is_computed_anew(tmp_path, monkeypatch):
    calls: list[int] = []
    store.stored_run("day", fake_run(calls), tmp_path)
    store.stored_run("hour", fake_run(calls), tmp_path)
    assert len(calls) == 2
    monkeypatch.setattr(store, "code_version", lambda: "changed")
    store.stored_run("day", fake_run(calls), tmp_path)
    assert len(calls) == 3


def test_a_damaged_file_is_recomputed_and_replaced(tmp_path):
    calls: list[int] = []
    path = store.run_path("day", tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"summary": {"requ')  # half a file
    summary, _ = store.stored_run("day", fake_run(calls), tmp_path)
    assert calls == [1] and summary["requests"] == 3
    assert store.stored_run("day", fake_run(calls), tmp_path)[0] == summary
    assert calls == [1]


def test_the_code_version_follows_the_simulations_source():
    version = store.code_version()
    assert len(version) == 16 and version == store.code_version()
    assert any(p.name == "sim.py" for p in store.HERE.glob("*.py"))
