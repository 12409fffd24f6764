"""A chat template is code from the checkpoint or the operator, and the client's messages, tools
and chat_template_kwargs are its input: one render runs within a time limit and a character
budget. A hostile template (nested loops, string multiplication, unbounded recursion, a huge
range) ends with a one-line error at once, a 400 when a request's data set it off, and a
start-up failure naming the template when it cannot render a one-message conversation."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from outrider.loaders.chat_template import ChatTemplateError, TemplateLimits, render_chat_template
from outrider.loaders.tokenizer import Tokenizer
from tests.unit.test_server_async_engine import FakeCore
from tests.unit.test_server_errors_unit import _tokenizer

KEY = "sk-unit-templates"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMALL = TemplateLimits(timeout_s=0.2, max_chars=100_000)
# Far above SMALL's limits, far below a hang: a test that takes this long has no limit at all.
GENEROUS_S = 30

NESTED_LOOPS = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    "{% endfor %}{% endfor %}{% endfor %}"
)
STRING_TIMES = "{{ 'x' * 300000000 }}"
RECURSION = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
HUGE_RANGE = "{% for i in range(10 ** 9) %}{% endfor %}"


def _render(source: str, **variables) -> str:
    return render_chat_template(source, SMALL, {"messages": [], **variables})


@pytest.mark.parametrize(
    ("source", "words"),
    [
        (NESTED_LOOPS, ["time limit of 0.2 s", "chat_template_timeout_s"]),
        (STRING_TIMES, ["'*' would make 300,000,000 characters", "chat_template_max_chars"]),
        (RECURSION, ["recursed too deeply"]),
        (HUGE_RANGE, ["range(1000000000)", "at most 100,000"]),
    ],
    ids=["nested loops", "string multiplication", "macro recursion", "huge range"],
)
def test_a_hostile_template_stops_at_once_with_a_clear_error(source, words):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        _render(source)
    assert time.monotonic() - start < GENEROUS_S
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(
    ("source", "word"),
    [
        ("{{ ([0] * 300000000) | length }}", "'*'"),
        ("{{ 2 ** 100000000 }}", "'**'"),
        ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
         "{% endfor %}", "integer"),
        ("{{ 'x' | center(1000000000) }}", "center"),
        ("{{ 'x'.ljust(1000000000) }}", "ljust"),
        ("{{ '%1000000000d' % 1 }}", "'%'"),
        ("{{ '%.1000000000f' | format(1) }}", "format"),
        ("{{ '{:>1000000000}'.format(1) }}", "str.format"),
        ("{{ range(100000) | join('x' * 10000) }}", "join"),
        ("{{ ('a' * 1000) | replace('', 'b' * 10000) }}", "replace"),
        ("{{ ('\n' * 10000) | indent('x' * 1000, blank=True) }}", "indent"),
        ("{{ [1] | slice(10 ** 12) | list | length }}", "slice"),
        ("{{ lipsum(10 ** 7) }}", "lipsum"),
        ("{{ messages | tojson(indent=1000000) }}", "tojson"),
        # What is written or built counts as it is made, wherever it goes:
        ("{% for i in range(100000) %}" + "y" * 100 + "{% endfor %}", "wrote or built"),
        ("{% macro m() %}{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}{% endmacro %}"
         "{{ m() | length }}", "100,000"),
        ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(1000) %}"
         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "wrote or built"),
    ],
)  # fmt: skip
def test_every_way_to_make_a_large_value_is_counted_before_or_as_it_is_made(source, word):
    with pytest.raises(ChatTemplateError, match=re.escape(word)):
        _render(source)


def test_loops_over_client_data_stop_at_the_time_limit():
    # Each loop is short; together they are 10^12 iterations, no range() involved.
    source = "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
    source += "{% endfor %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="time limit"):
        _render(source, messages=[{"role": "user", "content": ""}] * 10_000)


def test_any_failure_inside_a_template_is_a_template_error():
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        _render("{{ 1 / 0 }}")
    with pytest.raises(ChatTemplateError, match="rejected the messages: roles must alternate"):
        _render("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="does not compile: line 2"):
        _render("ok\n{% for %}")


def test_an_honest_template_renders_as_before_within_the_limits():
    source = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
        "{% endfor %}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{{ '%-5s|' % 'ab' }}{{ '{:>4}'.format(7) }}{{ 'x'.center(5) }}{{ [1, 2] | join(', ') }}"
    )
    messages = [{"role": "user", "content": " hi "}] * 3
    out = _render(source, messages=messages, tools=[{"a": 1}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n" * 3 + (
        '[\n  {\n    "a": 1\n  }\n]ab   |   7  x  1, 2'
    )


def test_the_limits_are_per_render():
    """One render spending most of the budget (its '*', then writing the result) leaves the
    next its whole budget."""
    for _ in range(3):
        assert len(_render("{{ 'x' * n }}", n=45_000)) == 45_000


# ---- the server ----------------------------------------------------------------------------

# Each blows up only when a request's chat_template_kwargs say so: start-up's trial render of a
# one-message conversation passes, a client's request sets it off.
BASE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
TRIGGERED = {
    "nested loops": "{% if n %}" + NESTED_LOOPS.replace("100000", "n") + "{% endif %}",
    "string multiplication": "{{ 'x' * (n or 0) }}",
    "macro recursion": "{% macro f(k) %}{% if k %}{{ f(k - 1) }}{% endif %}{% endmacro %}"
    "{{ f(n or 0) }}",
    "huge range": "{% for i in range(n or 0) %}{% endfor %}",
}


@contextlib.contextmanager
def _app(template: str, **server: object) -> Iterator:
    from outrider.server.app import build_app
    from outrider.server.async_engine import AsyncEngine
    from outrider.server.config import ServerConfig
    from outrider.server.state import ServerState

    core = FakeCore(tokens=2)
    core.tokenizer = Tokenizer(_tokenizer().backend, chat_template=template, eos_token_ids=[2])
    engine = AsyncEngine(core)
    config = ServerConfig(api_key=KEY, served_model_name="m", **server)
    state = ServerState.build(engine, config, "m")
    engine.start()
    try:
        yield build_app(state, KEY)
    finally:
        engine.stop()


@pytest.mark.parametrize(
    ("name", "n", "word"),
    [
        ("nested loops", 100_000, "time limit of 0.2 s"),
        ("string multiplication", 300_000_000, "would make 300,000,000 characters"),
        ("macro recursion", 100_000, "recursed too deeply"),
        ("huge range", 10**9, "at most 100,000"),
    ],
)
def test_a_request_that_sets_a_template_off_gets_400(name, n, word):
    limits = {"chat_template_timeout_s": 0.2, "chat_template_max_chars": 100_000}
    with _app(BASE + TRIGGERED[name], **limits) as app:
        client = TestClient(app, headers=AUTH)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        start = time.monotonic()
        r = client.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"n": n}})
        assert time.monotonic() - start < GENEROUS_S
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and word in err["message"], err


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{% for m in messages %}", ["does not compile", "line 1"]),
        (NESTED_LOOPS, ["time limit of 0.2 s"]),
        ("{{ raise_exception('no system message') }}", ["no system message"]),
    ],
)
def test_an_operator_template_that_cannot_render_stops_start_up(tmp_path, template, words):
    path = tmp_path / "bad.jinja"
    path.write_text(template)
    server = {"chat_template": str(path), "chat_template_timeout_s": 0.2}
    with pytest.raises(ValueError) as e, _app(BASE, **server):
        pass
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_a_checkpoint_template_that_cannot_render_names_its_file(tmp_path):
    tok = Tokenizer(
        _tokenizer().backend,
        chat_template=STRING_TIMES,
        chat_template_origin=f"the chat_template in {str(tmp_path / 'tokenizer_config.json')!r}",
    )
    with pytest.raises(ValueError, match="tokenizer_config.json.*would make 300,000,000"):
        tok.with_chat_template(SMALL)
    assert tok.with_chat_template(SMALL, BASE).apply_chat_template([]) == ""


def test_serve_exits_2_on_a_template_typo_before_loading_a_model(tmp_path, monkeypatch, capsys):
    import outrider.server.server
    from outrider.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the template was checked")

    monkeypatch.setattr(outrider.server.server, "load_engine", refuse)
    path = tmp_path / "typo.jinja"
    path.write_text("{{ messages[0].content }\n")
    assert main(["serve", "--chat-template", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "does not compile" in err and "Traceback" not in err
