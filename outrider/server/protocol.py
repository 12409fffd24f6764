"""OpenAI request and response schemas (pydantic), as the official `openai` client sends and
reads them, plus the sampling extensions vLLM users expect (top_k, min_p, ...) and the
structured-output fields of OpenAI, vLLM and SGLang (read into one constraint by structured.py).

Requests ignore unknown fields (clients send vendor extras) but reject wrong types, NaN and
infinity; every semantic check beyond types (context length, vocabulary, the server's
per-request limits in limits.py) happens where the value is used, with a message naming it.
Token ids are strict integers: JSON true is not token 1, nor 1.0 or "1" a token id; numbers
are never booleans, and booleans only true or false.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

# Bounds that keep every accepted value inside what torch and the sampler can compute with:
# a temperature or penalty this extreme would turn logits into inf/NaN.
_MAX_INT = 2**31 - 1
TokenIds = list[StrictInt]


def _not_a_bool(value: Any) -> Any:
    """JSON true/false are not numbers, though Python's bool is an int."""
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer, not a boolean")
    return value


def _not_a_bool_number(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a valid number, not a boolean")
    return value


# Counts and ids: integers (2.0 and "2" still read as 2, as pydantic reads ints), never booleans.
Int = Annotated[int, BeforeValidator(_not_a_bool)]
# Numbers (temperature, penalties): 0.7 or "0.7", never true/false (true read as 1.0).
Float = Annotated[float, BeforeValidator(_not_a_bool_number)]
# Switches: JSON true or false only. pydantic's own bool reads "yes", "off", 1 and 0 too:
# "stream": "yes" streamed.
Bool = StrictBool


# The chat renderer's own arguments (Tokenizer.encode_chat and apply_chat_template, which pass
# chat_template_kwargs on as template variables): a variable of one of these names would
# collide with them ("got multiple values for argument 'self'") or, as add_special_tokens,
# quietly change the encoding. messages, tools and add_generation_prompt are request fields.
RENDERER_ARGUMENTS = frozenset(
    {"self", "messages", "tools", "add_generation_prompt", "add_special_tokens", "max_tokens"}
)


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(RENDERER_ARGUMENTS & value.keys())
    if taken:
        raise PydanticCustomError(
            "reserved_name",
            "{names} cannot be a template variable: the chat renderer takes {reserved} itself; "
            "send messages, tools and add_generation_prompt as the request's own fields",
            {
                "names": ", ".join(map(repr, taken)),
                "reserved": ", ".join(sorted(RENDERER_ARGUMENTS)),
            },
        )
    return value


TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_template_kwargs)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: Bool = False


NonEmpty = Annotated[str, Field(min_length=1)]


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow BaseModel.schema; the alias is what clients send.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` extra field (core.StructuredOutputs' fields). Unknown fields
    are refused, not ignored: a constraint the server does not know must not vanish."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # shadows BaseModel.json
    regex: NonEmpty | None = None
    choice: list[NonEmpty] | None = None
    grammar: NonEmpty | None = None
    json_object: Bool = False
    disable_any_whitespace: Bool = False


class SamplingFields(_Request):
    """Fields both endpoints share."""

    model: str | None = None
    temperature: Float | None = Field(None, ge=0, le=100)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, le=_MAX_INT)
    min_p: Float | None = Field(None, ge=0, le=1)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(None, ge=0.01, le=100)
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    n: Int = Field(1, ge=1, le=_MAX_INT)
    max_tokens: Int | None = Field(None, ge=1, le=2**62)
    min_tokens: Int = Field(0, ge=0, le=_MAX_INT)
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    logit_bias: dict[str, Float] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs (at most one of these; structured.py): OpenAI's, vLLM's, SGLang's.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: list[NonEmpty] | None = None
    guided_grammar: NonEmpty | None = None
    guided_whitespace_pattern: str | None = None  # declared to be refused, not ignored
    regex: NonEmpty | None = None
    ebnf: NonEmpty | None = None
    json_schema: dict[str, Any] | str | None = None  # SGLang's: the schema as JSON text


# -- chat ---------------------------------------------------------------------------------------


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=_MAX_INT)  # at most max_logprobs (limits.py)
    max_completion_tokens: Int | None = Field(None, ge=1, le=2**62)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: TemplateKwargs | None = None


# -- completions --------------------------------------------------------------------------------


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object", type(None): "null"}  # fmt: skip


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _prompt_shape(value: object, handler) -> object:
    """The union's own check, with one clear message when the prompt fits no member (the
    union alone gives one error per member: "Input should be a valid string" for [true])."""
    try:
        return handler(value)
    except ValidationError:
        pass
    items = value if isinstance(value, list) else []
    inner = [t for p in items for t in (p if isinstance(p, list) else [p])]
    if any(isinstance(t, bool) for t in inner):
        got = "true/false are not token ids (a token id is an integer)"
    elif items:
        kinds = "/".join(sorted({_json_type(p) for p in items}))
        nested = "/".join(sorted({_json_type(t) for p in items if isinstance(p, list) for t in p}))
        got = f"got an array of {kinds}" + (f" holding {nested}" if nested else "")
    else:
        got = f"got {_json_type(value)}"
    raise PydanticCustomError(
        "prompt_shape",
        "give a string, an array of strings, an array of token ids (integers) or an array of "
        "such arrays: {got}",
        {"got": got},
    )


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template (one of them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: Bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: Bool = True
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: Bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


class CompletionRequest(SamplingFields):
    # Left to right, token ids first: with strict ints no value fits two members, and pydantic's
    # default "smart" union tried list[str] on every id first (2 s for a 4 MB prompt, now 0.1 s).
    prompt: Annotated[
        str | TokenIds | list[str] | list[TokenIds],
        Field(union_mode="left_to_right"),
        WrapValidator(_prompt_shape),
    ]
    logprobs: Int | None = Field(None, ge=0, le=_MAX_INT)  # at most max_logprobs (limits.py)
    echo: Bool = False
    suffix: str | None = None
    best_of: Int | None = Field(None, ge=1, le=_MAX_INT)


# -- responses (plain dicts would do; models document the shape and keep it in one place) ----


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "outrider"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
