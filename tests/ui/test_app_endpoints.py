"""Remote endpoints on the arena page: offered by name only (from secrets), a race whose
datacenter is a second batchlens API server on 127.0.0.1 (its own state charted over time
when it exports /metrics), an endpoint that does not answer, times out or streams garbage,
and no way to reach an address the admin did not configure."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from apptest import keyed, metrics, new_app, run_until, wait_idle
from http_server import serving
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import Engine, EngineConfig
from server.metrics import ServerMetrics
from server.remote_metrics import NOT_EXPORTED
from server.routes import api_routes
from ui import arena, endpoints, shared

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_engine")]

KEY = "endpoint-secret-key"
NAME = "team vLLM"


@pytest.fixture(scope="module")
def remote(loaded):
    """A second server on 127.0.0.1 with its own engine and an API key: (its /v1 URL, engine)."""
    with Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256),
                loaded=loaded) as eng, \
            serving(api_routes(lambda: eng, model_name=eng.loaded.name, api_key=KEY)) as url:
        yield f"{url}/v1", eng


@pytest.fixture(scope="module")
def remote_with_metrics(remote):
    """The same engine behind a second server that also exports /metrics: its /v1 URL."""
    _, eng = remote
    with serving(api_routes(lambda: eng, model_name=eng.loaded.name, api_key=KEY,
                            metrics=ServerMetrics(lambda: eng))) as url:
        yield f"{url}/v1"


STALL_S = 10.0  # the longest the stalling endpoint keeps a request (it ends when we go)


def misbehaving() -> list[Route]:
    """An endpoint that lists its model, then, under /stall, answers a generation with
    nothing at all, and under /garbage, streams an event that is not JSON."""
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def stall(request: Request) -> Response:
        for _ in range(int(STALL_S / 0.1)):
            if await request.is_disconnected():
                break
            await asyncio.sleep(0.1)
        return JSONResponse({})

    async def garbage(request: Request) -> Response:
        return Response("data: {not json\n\n", media_type="text/event-stream")

    return [Route(f"/{kind}/v1/models", models) for kind in ("stall", "garbage")] + [
        Route("/stall/v1/chat/completions", stall, methods=["POST"]),
        Route("/garbage/v1/chat/completions", garbage, methods=["POST"])]


def secrets(url: str, **entry) -> dict:
    return {"endpoints": [{"name": NAME, "url": url, "role": "datacenter", "api_key": KEY,
                           **entry}]}


def page_text(at) -> str:
    """Everything the page would send to the browser: every element's protobuf."""
    stack, out = [at.main, at.sidebar], []
    while stack:
        node = stack.pop()
        out.append(str(getattr(node, "proto", "")))
        stack.extend(getattr(node, "children", {}).values())
    return "\n".join(out)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def start_race(at, side: str, users: int = 2, max_tokens: int = 8):
    at.selectbox(key="arena_dc_side").select(side).run()
    at.number_input(key="arena_users").set_value(users)
    at.number_input(key="arena_max_tokens").set_value(max_tokens)
    return at.button(key="arena_run").click().run()


def test_endpoints_are_offered_by_name_and_their_url_and_key_never_reach_the_page(remote):
    url, _ = remote
    at = new_app(secrets=secrets(url))
    assert not at.exception
    assert at.selectbox(key="arena_dc_side").options == [
        endpoints.IN_PROCESS["datacenter"], NAME]
    text = page_text(at)
    assert NAME in text and KEY not in text and url not in text
    assert not at.text_input  # nowhere to type an address


def test_a_race_against_a_remote_datacenter_finishes_on_both_sides(remote):
    url, eng = remote
    served = eng.stats(steps_after=None).num_finished
    at = start_race(new_app(secrets=secrets(url)), NAME)
    run_until(at, lambda a: a.session_state[arena.SLOT.key].finished)
    race = at.session_state[arena.SLOT.key]
    assert race.error is None
    for side in ("datacenter", "local"):
        outs = race.outputs(side)
        assert len(outs) == 2 and all(len(o.token_ids) == 8 and o.text for o in outs)
    assert eng.stats(steps_after=None).num_finished == served + 2  # served over HTTP
    wait_idle(shared.shared_engine().engine)  # nothing reached this process's engine
    assert shared.shared_engine().engine.stats(steps_after=None).num_finished == 0
    at.run()
    assert KEY not in page_text(at)
    # this remote server exports no /metrics: the page says so instead of a blank panel
    assert any("not exported by this server" in c.value for c in at.caption)


def test_an_endpoint_that_does_not_answer_is_named_and_nothing_runs():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    at = start_race(new_app(secrets=secrets(url)), NAME)
    assert not at.exception
    errors = " ".join(e.value for e in at.error)
    assert "Not started" in errors and NAME in errors and "unreachable" in errors
    assert url not in errors  # the endpoint goes by its name on the page
    assert arena.SLOT.key not in at.session_state  # no race was built
    stats = shared.shared_engine().engine.stats(steps_after=None)
    assert stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize("entry,words", [
    ({"api_key": "wrong-key"}, "401"),
    ({"model": "no-such-model"}, "no-such-model"),
])
def test_a_refusing_endpoint_is_named_with_its_reason(remote, entry, words):
    url, _ = remote
    at = start_race(new_app(secrets=secrets(url, **entry)), NAME)
    assert not at.exception
    errors = " ".join(e.value for e in at.error)
    assert "Not started" in errors and NAME in errors and words in errors
    assert "wrong-key" not in page_text(at) and KEY not in page_text(at)


@pytest.mark.parametrize("kind,words", [
    ("stall", "timeout: nothing received for 1 s"),
    ("garbage", "malformed stream: an event is not JSON: '{not json'"),
])
def test_an_endpoint_that_times_out_or_streams_garbage_fails_only_its_side(kind, words):
    """The endpoint answers /v1/models, so the race starts; its requests then fail with a
    message naming it, shown on the page, and the local PC's side of the race finishes."""
    with serving(misbehaving()) as root:
        url = f"{root}/{kind}/v1"
        at = start_race(new_app(secrets=secrets(url, timeout=1)), NAME)
        run_until(at, lambda a: a.session_state[arena.SLOT.key].finished)
        at.run()
    assert not at.exception
    race = at.session_state[arena.SLOT.key]
    assert race.error.endswith(f"datacenter: remote datacenter {NAME!r}: {words}")
    errors = " ".join(e.value for e in at.error)
    assert NAME in errors and words in errors and url not in page_text(at)
    outs = race.outputs("local")  # the other side is unaffected
    assert len(outs) == 2 and all(o.error is None and o.text and len(o.token_ids) == 8
                                  for o in outs), [(o.finish_reason, o.error) for o in outs]
    assert metrics(at, "local")["Users finished"] == "2/2"
    assert metrics(at, "datacenter")["Users finished"] == "0/2"


def test_the_servers_state_is_charted_over_time_when_it_exports_metrics(remote_with_metrics):
    url = remote_with_metrics
    at = start_race(new_app(secrets=secrets(url)), NAME, users=2, max_tokens=32)
    run_until(at, lambda a: a.session_state[arena.SLOT.key].finished)
    at.run()
    race = at.session_state[arena.SLOT.key]
    assert race.error is None
    history = race.engine.server_history()  # read while the race's requests were out
    assert len(history) >= 2 and {s.state.source for s in history} == {"batchlens"}
    charts = keyed(at, "server-state-datacenter").get("vega_lite_chart")
    assert len(charts) == 1
    vega = json.loads(charts[0].proto.spec)
    assert vega["title"] == "The server's own state"
    assert not any(NOT_EXPORTED in c.value for c in at.caption)
    assert KEY not in page_text(at) and url not in page_text(at)


@pytest.mark.parametrize("bad", [0, -1, "soon", True])
def test_a_timeout_that_is_not_a_positive_number_is_a_misconfiguration(bad):
    at = new_app(secrets=secrets("http://127.0.0.1:9/v1", timeout=bad))
    assert not at.exception
    text = " ".join(c.value for c in at.caption)
    assert "misconfigured" in text and f"{NAME}): timeout must be a number of seconds > 0" in text
    assert "arena_dc_side" not in [s.key for s in at.selectbox]  # none is offered


def test_only_configured_names_resolve_to_a_server():
    """A name that is not configured (an address typed into a widget's state, a query
    parameter) never becomes a request: nothing is fetched."""
    with pytest.raises(ValueError, match="no endpoint called"):
        endpoints.remote_side("http://127.0.0.1:9/v1", "datacenter")
    assert endpoints.remote_side(endpoints.IN_PROCESS["local"], "local") is None


@pytest.mark.parametrize("exported", [False, True], ids=["no-metrics", "metrics"])
def test_a_sweep_against_a_remote_datacenter_runs_on_both_sides(remote, request, exported):
    url, eng = remote
    if exported:  # the same engine behind a server that exports /metrics
        url = request.getfixturevalue("remote_with_metrics")
    served = eng.stats(steps_after=None).num_finished
    at = new_app(secrets=secrets(url)).switch_page("pages/sweep.py").run()
    at.selectbox(key="sweep_dc_side").select(NAME).run()
    at.multiselect(key="sweep_users").set_value([1, 2])
    at.number_input(key="sweep_max_tokens").set_value(2)
    at.button(key="sweep_run_button").click().run()
    run_until(at, lambda a: bool(a.success) or bool(a.error) or bool(a.warning))
    assert not at.error, at.error[0].value
    table = at.dataframe[0].value
    assert list(table["side"]) == ["datacenter", "local"] * 2
    assert list(table["output_tokens"]) == [2, 2, 4, 4]
    assert eng.stats(steps_after=None).num_finished == served + 3  # 1 + 2 users over HTTP
    assert KEY not in page_text(at) and url not in page_text(at)
    # the remote server's own state: charted over the sweep, or said to be missing
    not_exported = any(NOT_EXPORTED in c.value for c in at.caption)
    charts = keyed(at, "server-state-datacenter").get("vega_lite_chart") if exported else []
    assert (not_exported, len(charts)) == ((False, 1) if exported else (True, 0))


def test_a_remote_side_refuses_several_answers_per_user_in_words(remote):
    url, _ = remote
    at = new_app(secrets=secrets(url))
    at.number_input(key="arena_n").set_value(3)
    at = start_race(at, NAME)
    assert not at.exception
    errors = " ".join(e.value for e in at.error)
    assert "Not started" in errors and "one candidate per request" in errors
    assert "n=3" in errors and arena.SLOT.key not in at.session_state
