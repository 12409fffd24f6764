"""ServerConfig validation, the shared YAML file, CLI flags over YAML, sd_notify, metrics."""

from __future__ import annotations

import socket

import pytest

from outrider.cli import build_parser
from outrider.server.async_engine import EngineStats
from outrider.server.cli import configs_from_args
from outrider.server.config import ServerConfig, load_yaml


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"port": 70000}, "port=70000"),
        ({"api_key": "a", "api_key_file": "f"}, "not both"),
        ({"api_key": ""}, "api_key=''"),
        ({"max_n": 0}, "max_n=0"),
        ({"max_body_bytes": -1}, "max_body_bytes"),
        ({"max_stop_strings": 0}, "max_stop_strings=0"),
        ({"max_prompt_chars": -1}, "max_prompt_chars=-1"),
        ({"max_logprobs": 21}, "max_logprobs=21.*0..20"),
        ({"max_logprobs": -1}, "max_logprobs=-1"),
        ({"shutdown_timeout": 0}, "shutdown_timeout"),
        ({"default_max_tokens": 0}, "default_max_tokens"),
        ({"tool_parser": "xml"}, "unknown tool_parser='xml'.*hermes"),
        ({"reasoning_parser": "nope"}, "unknown reasoning_parser"),
        ({"metrics_prefix": "sglang"}, "metrics_prefix='sglang'.*vllm"),
        ({"header_timeout": 0}, "header_timeout=0"),
        ({"max_connections": 0}, "max_connections=0"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests=0.*None"),
    ],
)
def test_server_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)


def test_server_config_is_frozen_and_normalises_origins():
    c = ServerConfig(cors_origins=["https://a.example"])
    assert c.cors_origins == ("https://a.example",)
    with pytest.raises(AttributeError):
        c.port = 1  # type: ignore[misc]


def test_api_key_file(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-secret\n")
    assert ServerConfig(api_key_file=str(key)).resolve_api_key() == "sk-secret"
    assert ServerConfig(api_key="k").resolve_api_key() == "k"
    with pytest.raises(FileNotFoundError, match="missing"):
        ServerConfig(api_key_file=str(tmp_path / "missing")).resolve_api_key()
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        ServerConfig(api_key_file=str(tmp_path / "empty")).resolve_api_key()


YAML = """
server: {host: 0.0.0.0, port: 9000, max_n: 3, tool_parser: hermes}
model: {dtype: float32, max_model_len: 512}
cache: {num_blocks: 64}
speculative: {method: ngram, num_draft_tokens: 3}
"""


def test_one_yaml_holds_both_configs(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text(YAML)
    server, engine = load_yaml(path)
    assert (server.host, server.port, server.max_n, server.tool_parser) == (
        "0.0.0.0",
        9000,
        3,
        "hermes",
    )
    assert engine.model.dtype == "float32" and engine.cache.num_blocks == 64
    assert engine.speculative.method == "ngram" and engine.speculative.num_draft_tokens == 3
    path.write_text("server: {prot: 1}\n")
    with pytest.raises(ValueError, match="prot"):
        load_yaml(path)


def test_flags_override_yaml_only_when_given(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text(YAML)
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--port", "9100", "--max-model-len", "256"]
    )
    server, engine = configs_from_args(args)
    assert server.port == 9100 and server.host == "0.0.0.0" and server.max_n == 3
    assert engine.model.max_model_len == 256 and engine.model.dtype == "float32"
    assert engine.cache.num_blocks == 64
    args = build_parser().parse_args(["serve", "--api-key", "k", "--cors-origin", "https://x"])
    server, engine = configs_from_args(args)
    assert server.api_key == "k" and server.cors_origins == ("https://x",)
    assert server.port == ServerConfig().port and engine.model.model is None


def test_connection_limits_are_flags_and_yaml_keys(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("server: {header_timeout: 2.5, max_connections: 64}\n")
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--max-concurrent-requests", "8", "--max-connections", "9"]
    )
    server, _ = configs_from_args(args)
    assert (server.header_timeout, server.max_connections, server.max_concurrent_requests) == (
        2.5,
        9,
        8,
    )
    default = ServerConfig()
    assert (default.header_timeout, default.max_connections) == (10.0, 1000)
    assert default.max_concurrent_requests is None


def test_open_files_are_raised_to_fit_max_connections(monkeypatch):
    import resource

    from outrider.server.server import open_files_for

    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: limits.update(now=value))
    open_files_for(2000)
    assert limits["now"] == (2000, 4096)
    open_files_for(1000)  # already enough: left alone
    assert limits["now"] == (2000, 4096)
    open_files_for(10_000)  # no further than the hard limit
    assert limits["now"] == (4096, 4096)


def test_sd_notify_sends_datagrams(tmp_path, monkeypatch):
    from outrider.server import sdnotify

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False  # outside systemd: a no-op
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sdnotify.notify("READY=1") is True
        assert sock.recv(100) == b"READY=1"
        assert sdnotify.notify("STOPPING=1") is True
        assert sock.recv(100) == b"STOPPING=1"
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sdnotify.notify("READY=1") is False  # a broken socket never stops the server


def test_metrics_render_engine_snapshot():
    from outrider.core import RequestOutput
    from outrider.server.metrics import ServerMetrics

    stats = EngineStats(
        num_running=2,
        num_waiting=1,
        num_free_blocks=25,
        num_blocks=100,
        num_preemptions=3,
        spec_num_drafts=10,
        spec_num_draft_tokens=40,
        spec_num_accepted_tokens=22,
        spec_accepted_per_position=(9, 7, 4, 2),
        spec_k=3,
        spec_steps_by_k=((0, 5), (3, 8)),
        step_ledger=(("decode_ahead", 6, 0.25, 12, 12), ("verify", 2, 0.5, 9, 3)),
    )
    m = ServerMetrics("m", lambda: stats)
    out = RequestOutput("r", None, [1, 2], "ab", [5, 6], True, "stop", {"num_prompt_tokens": 2})
    m.on_delta(out, None)
    m.on_delta(out, 0.2)
    m.on_finished(out)
    text = m.render().decode()
    for line in (
        'outrider:num_requests_running{model_name="m"} 2.0',
        'outrider:num_requests_waiting{model_name="m"} 1.0',
        'outrider:kv_cache_usage_perc{model_name="m"} 0.75',
        'outrider:num_preemptions_total{model_name="m"} 3.0',
        'outrider:spec_decode_num_drafts_total{model_name="m"} 10.0',
        'outrider:spec_decode_num_draft_tokens_total{model_name="m"} 40.0',
        'outrider:spec_decode_num_accepted_tokens_total{model_name="m"} 22.0',
        'outrider:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 4.0',
        'outrider:spec_decode_k{model_name="m"} 3.0',
        'outrider:spec_decode_steps_total{k="0",model_name="m"} 5.0',
        'outrider:spec_decode_steps_total{k="3",model_name="m"} 8.0',
        'outrider:engine_step_count_total{kind="decode_ahead",model_name="m"} 6.0',
        'outrider:engine_step_seconds_total{kind="verify",model_name="m"} 0.5',
        'outrider:engine_step_tokens_total{kind="verify",model_name="m"} 9.0',
        'outrider:engine_step_rows_total{kind="decode_ahead",model_name="m"} 12.0',
        'outrider:generation_tokens_total{model_name="m"} 4.0',
        'outrider:prompt_tokens_total{model_name="m"} 2.0',
        'outrider:inter_token_latency_seconds_count{model_name="m"} 2.0',
        'outrider:request_success_total{finished_reason="stop",model_name="m"} 1.0',
    ):
        assert line in text, line


def test_metrics_prefix_vllm_names_the_series_vllm_dashboards_read():
    from outrider.core import RequestOutput
    from outrider.server.metrics import ServerMetrics

    server, _ = configs_from_args(build_parser().parse_args(["serve", "--metrics-prefix", "vllm"]))
    assert server.metrics_prefix == "vllm" and ServerConfig().metrics_prefix == "outrider"
    stats = EngineStats(num_running=2, num_free_blocks=25, num_blocks=100, spec_num_drafts=10)
    m = ServerMetrics("m", lambda: stats, server.metrics_prefix)
    out = RequestOutput("r", None, [1, 2], "ab", [5, 6], True, "stop", {"num_prompt_tokens": 2})
    m.on_delta(out, None)
    m.on_delta(out, 0.2)
    m.on_finished(out)
    text = m.render().decode()
    # The series of vLLM's Grafana dashboard (examples/online_serving/dashboards) outrider has.
    for name in (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prompt_tokens_total", "generation_tokens_total", "request_success_total",
        "num_preemptions_total", "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
        "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
    ):  # fmt: skip
        assert f"\nvllm:{name}{{" in text, name
    assert "outrider:" not in text
