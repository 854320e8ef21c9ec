"""Presenter mode's words and the clicker's steps: no model, no browser."""

from __future__ import annotations

import dataclasses

from test_status_line import stats

from measure.hardware import Emulation
from ui.arena import EMPTY, headline_sentence, ratio_sentence, summary_sentence
from ui.clicker import NEXT, PREVIOUS, pick
from ui.status import where_line
from workloads.race import SideView

KEYS = ("one_user", "many_users", "shared_prefix")


def test_the_clicker_steps_through_the_scenarios_and_stops_at_either_end():
    assert pick(KEYS, None, NEXT) == "one_user"  # nothing played yet: the first
    assert pick(KEYS, None, PREVIOUS) is None
    assert pick(KEYS, "one_user", NEXT) == "many_users"
    assert pick(KEYS, "many_users", PREVIOUS) == "one_user"
    assert pick(KEYS, "shared_prefix", NEXT) is None  # no wrap-around to the start
    assert pick(KEYS, "one_user", PREVIOUS) is None
    assert pick(KEYS, "many_users", None) is None  # no key pressed
    assert pick(KEYS, "gone", NEXT) == "one_user"  # a scenario of another page
    assert pick((), None, NEXT) is None


def side(name: str, *, users: int, done: int, finished: bool, elapsed: float,
         tps: float | None) -> SideView:
    return SideView(name, users, True, finished, elapsed, "", None, None, 0, tps, done, None)


def snapshot(local: SideView, dc: SideView, phase: str, ratio: float | None):
    return dataclasses.replace(EMPTY, phase=phase, sides={"local": local, "datacenter": dc},
                               finished=phase in ("done", "stopped"), ratio=ratio)


def test_the_headline_says_when_the_last_user_had_an_answer():
    dc = side("datacenter", users=32, done=32, finished=True, elapsed=9.04, tps=139.3)
    local = side("local", users=32, done=5, finished=False, elapsed=3.46, tps=16.0)
    running = snapshot(local, dc, "local", None)
    assert headline_sentence(dc, running) == "The last of 32 users had an answer after **9.0 s**."
    assert headline_sentence(local, running) == (
        "5 of 32 users had an answer after **3.5 s**...")
    one = side("local", users=1, done=1, finished=True, elapsed=2.0, tps=20.0)
    assert headline_sentence(one, snapshot(one, one, "done", 1.0)).startswith(
        "The one user had an answer")
    stopped = snapshot(local, dc, "stopped", None)
    assert headline_sentence(dc, stopped).startswith("Stopped: 32 of 32 users finished")


def test_the_ratio_sentence_names_users_speed_and_totals():
    dc = side("datacenter", users=32, done=32, finished=True, elapsed=9.0, tps=139.3)
    local = side("local", users=32, done=32, finished=True, elapsed=57.0, tps=16.2)
    assert ratio_sentence(snapshot(local, dc, "done", 8.6)) == (
        "The datacenter served 32 users 8.6x faster than the local PC (139 against 16 "
        "tokens/s in total).")
    slow = ratio_sentence(snapshot(local, dc, "done", 0.8))
    assert "at 0.8x the speed of the local PC" in slow
    for level in (0.96, 1.0, 1.04):  # a ratio that reads 1.0x says so in words
        assert "served 32 users about as fast as the local PC (" in ratio_sentence(
            snapshot(local, dc, "done", level))
    assert "1.1x faster than" in ratio_sentence(snapshot(local, dc, "done", 1.06))


def test_a_paced_race_s_sentences_say_the_local_speed_is_another_model_s_projection():
    dc = side("datacenter", users=1, done=1, finished=True, elapsed=0.6, tps=105.0)
    local = side("local", users=1, done=1, finished=True, elapsed=16.0, tps=1.0)
    snap = snapshot(local, dc, "done", 105.0)
    note = Emulation("laptop_cpu", "llama-2-70b", "int4").label
    for sentence in (ratio_sentence(snap, note), summary_sentence(snap, note)):
        assert "105.0x" in sentence
        assert sentence.endswith(
            " The local PC ran at the projected pace of Llama-2-70B int4 on Laptop CPU "
            "(DDR5-5600, 32 GB); the datacenter ran its own model at its real speed.")
    assert ratio_sentence(snap).endswith("in total).")  # unpaced: no word of a pace
    assert summary_sentence(snap).endswith("serving one user at a time.")


def test_the_header_line_says_what_runs_where_in_plain_words():
    cpu = stats("bfloat16", "bfloat16: decode steps 2.6x as fast as float32 here")
    line = where_line(cpu, 0)
    assert line == ("**Datacenter:** this machine's CPU, batching · **Local PC:** the same "
                    "CPU, one user at a time")
    assert "bfloat16" not in line and "KV" not in line  # the details are in the tooltip
    assert where_line(cpu, 3).endswith("now serving 3 requests")
    gpu = dataclasses.replace(cpu, device="cuda:0")
    assert "this machine's GPU, batching · **Local PC:** this machine's CPU" in where_line(
        gpu, 0)
