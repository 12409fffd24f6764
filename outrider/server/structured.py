"""Structured outputs, however a client asks for them, as one `StructuredOutputs`:

    OpenAI   response_format {"type": "json_object"} / {"type": "json_schema", "json_schema":
             {"schema": {...}}}; tool_choice "required" or {"function": {"name": ...}}
    vLLM     structured_outputs {json | regex | choice | grammar | json_object, ...};
             guided_json, guided_regex, guided_choice, guided_grammar
    SGLang   json_schema (JSON text), regex, ebnf

A request gives at most one of them (two are a 400 naming both). Each becomes a `Constraint`
that remembers the request field it came from, so that the engine refusing it (a schema, regex
or grammar that does not compile) is a 400 naming that field, not the engine's name for it.
A schema is handed on as JSON text in the client's key order: llguidance writes an object's
properties in its schema's order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from outrider.core import StructuredOutputs
from outrider.server.errors import APIError, bad_request, clip
from outrider.server.parsers.base import ToolParser, ToolSchema
from outrider.server.protocol import ChatCompletionRequest, SamplingFields

# OpenAI: a function without `parameters` takes none.
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Constraint:
    """One structured output and where in the request it came from. `field` is the request
    field (an error's `param`); `label` names it in messages ("response_format json_schema")."""

    field: str
    label: str
    outputs: StructuredOutputs

    def refusal(self, error: ValueError) -> APIError | None:
        """The 400 naming this constraint's field when `error`, from EngineCore.validate, is
        about it (the engine names it `structured_outputs`, as core's own errors do); else
        None."""
        if "structured_outputs" not in str(error):
            return None
        return bad_request(_naming(self.label, error), self.field)


def request_constraint(
    req: SamplingFields, tool_call: Constraint | None = None
) -> Constraint | None:
    """The request's one constraint (with `tool_call`, from `tool_call_constraint`), or None.
    Raises APIError 400 when two fields constrain the output or one cannot be read."""
    if req.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported: drop it (JSON may hold any whitespace "
            "by default), or set structured_outputs.disable_any_whitespace for none",
            "guided_whitespace_pattern",
        )
    found = [
        c
        for c in (
            _response_format(req),
            _vllm(req),
            *_guided(req),
            *_sglang(req),
            tool_call,
        )
        if c is not None
    ]
    if len(found) > 1:
        labels = " and ".join(c.label for c in found)
        raise bad_request(
            f"{labels} each constrain the output, and a request takes one constraint: keep one "
            "of them",
            found[1].field,
        )
    return found[0] if found else None


def tool_call_constraint(
    req: ChatCompletionRequest, parser: ToolParser | None
) -> Constraint | None:
    """tool_choice "required" (a call of any of the tools; several unless parallel_tool_calls
    is false) or a named function (one call of it), as the output the tool parser reads back
    as calls. None for "auto", "none" or no tool_choice."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    named = None if isinstance(choice, str) else choice.function.name
    label = f"tool_choice={choice!r}" if named is None else f"tool_choice function {clip(named)}"
    if not req.tools:
        raise bad_request(
            f"{label} needs tools, and the request has none: give tools, or drop tool_choice",
            "tool_choice",
        )
    if parser is None:
        raise bad_request(
            f"{label} needs the server to read tool calls back, and it has no tool parser: "
            "start it with --tool-parser (hermes, qwen or kimi_k2: the model's call format), or "
            "use tool_choice 'auto'",
            "tool_choice",
        )
    tools = [ToolSchema(t.function.name, t.function.parameters or NO_ARGUMENTS) for t in req.tools]
    if named is not None:
        tools = [t for t in tools if t.name == named][:1]
        if not tools:
            raise bad_request(
                f"{label} is not among the request's tools "
                f"{clip([t.function.name for t in req.tools])}: name one of them",
                "tool_choice.function.name",
            )
    several = named is None and req.parallel_tool_calls is not False
    return Constraint(
        "tool_choice", label, StructuredOutputs(grammar=parser.call_grammar(tools, several))
    )


def _response_format(req: SamplingFields) -> Constraint | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    label = f"response_format {fmt.type}"
    if fmt.type == "json_object":
        return Constraint("response_format", label, StructuredOutputs(json_object=True))
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request(
            'response_format json_schema has no schema: give {"type": "json_schema", '
            '"json_schema": {"name": ..., "schema": {...}}}',
            "response_format.json_schema",
        )
    return Constraint(
        "response_format", label, StructuredOutputs(json=json.dumps(fmt.json_schema.schema_))
    )


def _vllm(req: SamplingFields) -> Constraint | None:
    given = req.structured_outputs
    if given is None:
        return None
    fields = given.model_dump(by_alias=True, exclude_defaults=True)
    if isinstance(fields.get("json"), str):
        _check_json_text(fields["json"], "structured_outputs.json")
    elif isinstance(fields.get("json"), dict):
        fields["json"] = json.dumps(fields["json"])
    return _constraint("structured_outputs", "structured_outputs", **fields)


def _guided(req: SamplingFields) -> list[Constraint | None]:
    return [
        _schema(req.guided_json, "guided_json"),
        _constraint("guided_regex", "guided_regex", regex=req.guided_regex)
        if req.guided_regex is not None
        else None,
        _constraint("guided_choice", "guided_choice", choice=req.guided_choice)
        if req.guided_choice is not None
        else None,
        _constraint("guided_grammar", "guided_grammar", grammar=req.guided_grammar)
        if req.guided_grammar is not None
        else None,
    ]


def _sglang(req: SamplingFields) -> list[Constraint | None]:
    return [
        _schema(req.json_schema, "json_schema"),
        _constraint("regex", "regex", regex=req.regex) if req.regex is not None else None,
        # SGLang's EBNF is GBNF's `name ::= ...`, which StructuredOutputs.grammar takes.
        _constraint("ebnf", "ebnf", grammar=req.ebnf) if req.ebnf is not None else None,
    ]


def _schema(value: dict[str, Any] | str | None, field: str) -> Constraint | None:
    if value is None:
        return None
    if isinstance(value, str):
        _check_json_text(value, field)
        return _constraint(field, field, json=value)
    return _constraint(field, field, json=json.dumps(value))


def _check_json_text(text: str, field: str) -> None:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad_request(
            f"{field} is not valid JSON ({e}): give a JSON schema, as an object or its JSON text",
            field,
        ) from None
    if not isinstance(schema, dict | bool):
        raise bad_request(
            f"{field} is a JSON {type(schema).__name__}, not a JSON schema: give an object such "
            'as {"type": "object", "properties": {...}}',
            field,
        )


def _constraint(field: str, label: str, **fields: Any) -> Constraint:
    try:
        return Constraint(field, label, StructuredOutputs(**fields))
    except ValueError as e:  # "structured_outputs sets [...]: give exactly one of ..."
        raise bad_request(_naming(label, e), field) from None


def _naming(label: str, error: ValueError) -> str:
    """The error, led by the request field's label where it does not name it already."""
    return str(error) if label in str(error) else f"{label}: {error}"
