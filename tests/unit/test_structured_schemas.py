"""The structured-outputs case set (benchmarks/structured_schemas.json): every schema is a valid
JSON Schema of the shapes the benchmarks claim to cover, every regex compiles, every example is
a valid output of its case, and llguidance with the default model's tokenizer accepts each
example token by token and then stops (the walk benchmarks/grammar_backends.py times)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from outrider.core import StructuredOutputs
from tests.benchmarks import BENCH, load_benchmark

DOC = json.loads((BENCH / "structured_schemas.json").read_text())


def _walk(schema: dict):
    """Every subschema of `schema`, itself included."""
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _walk(sub)
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"])


def _subschemas() -> list[dict]:
    return [sub for e in DOC["schemas"] for sub in _walk(e["schema"])]


def test_counts_and_unique_names():
    assert len(DOC["schemas"]) >= 30
    assert len(DOC["regex"]) >= 4 and len(DOC["choice"]) >= 2
    names = [e["name"] for kind in ("schemas", "regex", "choice") for e in DOC[kind]]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for e in (e for kind in ("schemas", "regex", "choice") for e in DOC[kind]):
        assert e["prompt"].strip() and "example" in e, e["name"]


@pytest.mark.parametrize("entry", DOC["schemas"], ids=lambda e: e["name"])
def test_every_schema_is_valid_and_its_example_validates(entry):
    schema = entry["schema"]
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    cls(schema).validate(entry["example"])
    assert schema["type"] == "object"  # what a chat model is asked for, and tool arguments
    StructuredOutputs(json=schema)  # what SamplingParams takes


def test_the_schemas_cover_the_shapes():
    subs = _subschemas()
    objects = [s for s in subs if s.get("type") == "object"]
    schemas = [e["schema"] for e in DOC["schemas"]]

    def nested(s):
        return any(p.get("type") == "object" for p in s.get("properties", {}).values())

    assert sum(nested(s) for s in schemas) >= 3
    assert sum(s.get("type") == "array" and s["items"].get("type") == "object" for s in subs) >= 3
    assert sum(s.get("type") == "array" and s["items"].get("type") == "string" for s in subs) >= 3
    assert sum("enum" in s for s in subs) >= 8
    for t in ("integer", "number"):
        bounded = [s for s in subs if s.get("type") == t and {"minimum", "maximum"} <= set(s)]
        assert len(bounded) >= 4, t
    assert sum(s.get("type") == "boolean" for s in subs) >= 8
    assert sum("maxLength" in s for s in subs) >= 20
    assert sum("pattern" in s for s in subs) >= 6
    assert sum(set(s["properties"]) - set(s.get("required", [])) != set() for s in objects) >= 5
    assert sum(s.get("additionalProperties") is False for s in objects) >= 30
    assert any("additionalProperties" not in s for s in schemas)  # one open object
    assert sum(e["name"].startswith("tool_") for e in DOC["schemas"]) >= 8


def test_patterns_compile():
    for s in _subschemas():
        if "pattern" in s:
            re.compile(s["pattern"])


@pytest.mark.parametrize("entry", DOC["regex"], ids=lambda e: e["name"])
def test_every_regex_compiles_and_matches_its_example(entry):
    rx = re.compile(entry["regex"])
    assert rx.fullmatch(entry["example"]), (entry["regex"], entry["example"])
    assert not rx.fullmatch(entry["example"] + "!")  # anchored as the engine applies it
    StructuredOutputs(regex=entry["regex"])


@pytest.mark.parametrize("entry", DOC["choice"], ids=lambda e: e["name"])
def test_every_choice_holds_its_example(entry):
    choices = entry["choice"]
    assert len(choices) >= 2 and len(set(choices)) == len(choices)
    assert all(isinstance(c, str) and c for c in choices)
    assert entry["example"] in choices
    StructuredOutputs(choice=choices)


def test_the_benchmarks_read_every_case_and_accept_every_example():
    cases = load_benchmark("structured_cases.py").load_cases()
    assert len(cases) == sum(len(DOC[k]) for k in ("schemas", "regex", "choice"))
    assert all(c.is_valid(c.example) for c in cases)
    assert not any(c.is_valid(c.example + "x") for c in cases)


@pytest.fixture(scope="module")
def default_tokenizer():
    llguidance = pytest.importorskip("llguidance")
    from outrider.loaders.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    eos = list(ck.tokenizer.eos_token_ids)
    lltok = llguidance.LLTokenizer(
        ck.tokenizer.backend.to_str(), n_vocab=ck.config.vocab_size, eos_token=eos
    )
    return ck.tokenizer.backend, lltok, eos


def test_llguidance_accepts_every_example_and_stops(default_tokenizer):
    """Keys in the schema's order, outputs well under ~150 tokens, patterns llguidance
    supports: the default model's tokens of each example walk the grammar to its end."""
    import llguidance

    backend, lltok, eos = default_tokenizer
    cases = load_benchmark("structured_cases.py").load_cases()
    for case in cases:
        if case.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(case.spec)
        else:
            rx = case.spec if case.kind == "regex" else "|".join(map(re.escape, case.spec))
            grammar = llguidance.LLMatcher.grammar_from_regex(rx)
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        assert not matcher.is_error(), (case.name, matcher.get_error())
        ids = backend.encode(case.example, add_special_tokens=False).ids
        assert len(ids) <= 100, (case.name, len(ids))
        assert matcher.consume_tokens(ids), (case.name, matcher.get_error())
        assert matcher.is_accepting(), case.name
        assert matcher.consume_token(eos[0]) and matcher.is_stopped(), case.name
