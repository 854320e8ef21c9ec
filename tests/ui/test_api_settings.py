"""The dashboard's API settings read from the environment (ui/api.py)."""

from __future__ import annotations

import pytest

from ui import api


@pytest.mark.parametrize(("env", "origins"), [
    (None, ["*"]),  # unset: every origin, as vLLM's server
    ("https://chat.example, https://b.example", ["https://chat.example", "https://b.example"]),
    ("", []),  # set but empty: no CORS at all
])
def test_allowed_origins_from_the_environment(monkeypatch, env, origins):
    if env is None:
        monkeypatch.delenv("BATCHLENS_ALLOWED_ORIGINS", raising=False)
    else:
        monkeypatch.setenv("BATCHLENS_ALLOWED_ORIGINS", env)
    assert api.allowed_origins() == origins
    assert len(api.middleware()) == (1 if origins else 0)


@pytest.mark.parametrize(("env", "prefix"), [(None, "batchlens:"), ("vllm", "vllm:"),
                                             ("vllm:", "vllm:")])
def test_the_metrics_prefix_from_the_environment_reaches_the_exporter(monkeypatch, env, prefix):
    if env is None:
        monkeypatch.delenv("BATCHLENS_METRICS_PREFIX", raising=False)
    else:
        monkeypatch.setenv("BATCHLENS_METRICS_PREFIX", env)
    monkeypatch.setattr(api.shared, "ENGINE_WATCHERS", [])
    assert api.prefix() == prefix
    api.routes()
    (watch,) = api.shared.ENGINE_WATCHERS  # the exporter's own watch method
    assert watch.__self__.prefix == prefix
    body, _ = watch.__self__.render()
    assert f"# TYPE {prefix}num_requests_running gauge" in body.decode()


def test_a_metrics_prefix_prometheus_would_refuse_names_the_setting(monkeypatch):
    monkeypatch.setenv("BATCHLENS_METRICS_PREFIX", "9-lives")
    with pytest.raises(ValueError, match=r"metrics_prefix \(\$BATCHLENS_METRICS_PREFIX\): "
                                         r"letters, digits and underscores.*'9-lives'"):
        api.prefix()


def test_the_tool_call_parser_and_chat_template_settings(monkeypatch, tmp_path):
    monkeypatch.delenv("BATCHLENS_TOOL_CALL_PARSER", raising=False)
    monkeypatch.delenv("BATCHLENS_CHAT_TEMPLATE", raising=False)
    assert api.tool_parser() is None and api.chat_template() is None
    monkeypatch.setenv("BATCHLENS_TOOL_CALL_PARSER", "hermes")
    assert api.tool_parser() == "hermes"
    monkeypatch.setenv("BATCHLENS_TOOL_CALL_PARSER", "mistral")
    with pytest.raises(ValueError, match=r"tool_call_parser \(\$BATCHLENS_TOOL_CALL_PARSER\)"
                                         r" must be one of hermes, llama3_json"):
        api.tool_parser()
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    monkeypatch.setenv("BATCHLENS_CHAT_TEMPLATE", str(template))
    assert api.chat_template() == "{{ messages[0]['content'] }}"
    monkeypatch.setenv("BATCHLENS_CHAT_TEMPLATE", str(tmp_path / "none.jinja"))
    with pytest.raises(ValueError, match=r"chat_template \(\$BATCHLENS_CHAT_TEMPLATE\): "
                                         r"no such file"):
        api.chat_template()
