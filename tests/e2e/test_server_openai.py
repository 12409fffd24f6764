"""The official `openai` client against a live `outrider serve` on 127.0.0.1 (the real default
model, fp32 on CPU): chat, completions, streaming, usage, n, logprobs, seeds, stop strings and
tools (a Hermes-style template that renders `tools=`, and the hermes parser)."""

from __future__ import annotations

import json

import openai
import pytest

from outrider.core import RequestOutput

pytestmark = pytest.mark.slow


KEY = "sk-outrider-test"

# SmolLM2's own ChatML template, extended the way Qwen2.5's renders tools and tool turns. Without
# tools it renders exactly what the checkpoint's template renders (asserted below).
HERMES_TEMPLATE = """\
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}
{%- if tools -%}
<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else default_system }}

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{{ '\\n' }}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and messages[0]['role'] != 'system' and not tools -%}
{{ '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}
{%- endif -%}
{%- if message['role'] == 'system' and tools -%}
{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined -%}
{{ '<|im_start|>assistant\\n' + message['content'] }}
{%- for call in message['tool_calls'] -%}
{{ '<tool_call>\\n{"name": "' + call['function']['name'] + '", "arguments": ' + \
(call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}
{%- endfor -%}
{{ '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' -%}
{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
{%- else -%}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore
    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    template = tmp_path_factory.mktemp("tpl") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    core = EngineCore(EngineConfig().replace(model={"dtype": "float32", "device": "cpu"}))
    config = ServerConfig(
        api_key=KEY,
        tool_parser="hermes",
        chat_template=str(template),
        max_n=4,
        cors_origins=("https://app.example",),
    )
    with ServerThread(config, core) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server):
    return server.state.model_name


def test_models_lists_the_served_model(client, model):
    ids = [m.id for m in client.models.list().data]
    assert ids == [model] and model.startswith("SmolLM2-135M-Instruct")


def test_template_without_tools_matches_the_checkpoint(server):
    state = server.state
    own = state.engine.tokenizer.apply_chat_template(ASK)
    assert state.chat_tokenizer.apply_chat_template(ASK) == own
    assert state.chat_tokenizer.chat_template != state.engine.tokenizer.chat_template


def test_chat_answers_with_usage(client, model, server):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    tok = server.state.engine.tokenizer
    expected_prompt = len(tok.encode(tok.apply_chat_template(ASK), add_special_tokens=False))
    assert r.usage.prompt_tokens == expected_prompt
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_max_tokens_and_max_completion_tokens_cut_at_length(client, model):
    for kwargs in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Count from one to twenty."}],
            temperature=0,
            **kwargs,
        )
        assert r.choices[0].finish_reason == "length", kwargs
        assert r.usage.completion_tokens == 3, kwargs


def test_streaming_chat_equals_whole_and_reports_usage(client, model):
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_n_and_seed(client, model):
    r = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert "Paris" in r.choices[0].text and r.object == "text_completion"
    kw = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i
    assert 3 <= a.usage.completion_tokens <= 24  # three choices of 1..8 tokens


def test_completions_stream_with_n_and_prompt_list(client, model):
    chunks = list(
        client.completions.create(
            model=model,
            prompt=["The capital of France is", "Two plus two is"],
            max_tokens=5,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert sorted(texts) == [0, 1, 2, 3] and sorted(reasons) == [0, 1, 2, 3]
    assert texts[0] == texts[1] and "Paris" in texts[0]  # greedy: both choices agree
    assert chunks[-1].usage.completion_tokens <= 20 and chunks[-1].usage.prompt_tokens > 0


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        best = max(t.logprob for t in entry.top_logprobs)
        assert entry.logprob == pytest.approx(best, abs=1e-5)  # greedy picks the top token
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
    text = "".join(e.token for e in content)
    assert text.startswith(r.choices[0].message.content[:5])


def test_completion_logprobs(client, model):
    r = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_stop_strings_and_sampling_extras(client, model):
    r = client.completions.create(
        model=model,
        prompt="The capital of France is Paris. The capital of Spain is",
        max_tokens=20,
        temperature=0,
        stop=["."],
    )
    assert "." not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=6,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2},
    )
    assert r.usage.completion_tokens >= 2


def test_tools_are_rendered_by_the_template(client, model, server):
    base = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, tools=[WEATHER_TOOL], tool_choice="auto"
    )
    tok = server.state.chat_tokenizer
    rendered = tok.apply_chat_template(ASK, tools=[WEATHER_TOOL])
    assert "get_weather" in rendered and "<tools>" in rendered
    assert with_tools.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert with_tools.usage.prompt_tokens > base.usage.prompt_tokens + 20
    none = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert none.usage.prompt_tokens == base.usage.prompt_tokens  # "none" renders no tools


def test_tool_round_trip_with_a_tool_result(client, model, server):
    """The second leg of a tool call: the assistant's call and the tool's answer go back
    through the template, and the model answers from them."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees Celsius."},
    ]
    r = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=24, temperature=0
    )
    tok = server.state.chat_tokenizer
    rendered = tok.apply_chat_template(
        [
            messages[0],
            {
                **messages[1],
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            messages[2],
        ],
        tools=[WEATHER_TOOL],
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>\nSunny, 24 degrees Celsius." in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def _fake_generate(text: str):
    """An engine whose model 'says' text, in two deltas, for every request."""

    async def generate(requests):
        for index, (rid, _, _) in enumerate(requests):
            half = len(text) // 2
            for part, done in ((text[:half], False), (text[half:], True)):
                yield (
                    index,
                    RequestOutput(
                        request_id=rid,
                        prompt=None,
                        prompt_token_ids=[],
                        text=part,
                        token_ids=[1],
                        finished=done,
                        finish_reason="stop" if done else None,
                        metrics={},
                    ),
                )

    return generate


TOOL_OUTPUT = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)


def test_tool_calls_reach_the_client_whole_and_streamed(client, model, server, monkeypatch):
    monkeypatch.setattr(server.state.engine, "generate", _fake_generate(TOOL_OUTPUT))
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER_TOOL])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check."
    [call] = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    chunks = list(
        client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER_TOOL], stream=True)
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check." and "<tool_call>" not in content
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools in the request the same text is plain content.
    plain = client.chat.completions.create(model=model, messages=ASK)
    assert (
        plain.choices[0].message.content == TOOL_OUTPUT and not plain.choices[0].message.tool_calls
    )


def test_cors_allows_only_the_configured_origin(server):
    import httpx

    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    ok = httpx.options(
        server.url + "/chat/completions", headers={"Origin": "https://app.example", **preflight}
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(
        server.url + "/chat/completions", headers={"Origin": "https://evil.example", **preflight}
    )
    assert "access-control-allow-origin" not in other.headers


def test_completion_echo_prepends_the_prompt(client, model):
    prompt = "The capital of France is"
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True
    )
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text
    assert r.usage.completion_tokens == 3
