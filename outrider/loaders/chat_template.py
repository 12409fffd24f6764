"""Chat templates: jinja source from a checkpoint or an operator, rendered as transformers renders
it (the same sandbox, helpers and variables, so prompts match token for token), within limits on
what one render may cost.

A template is code from wherever the checkpoint came from, and a client's messages, tools and
chat_template_kwargs are its input. The sandbox keeps it away from Python's internals; the limits
keep it from running or allocating without end:
- time: every loop iteration, call, filter, operator and written piece checks a wall-clock
  deadline, so nested loops stop within one iteration of it (no thread is interrupted);
- characters: every string or list the template writes or builds through an operator, filter
  or call counts its length against one budget, and the operations that make a large value from
  small inputs (`*`, `**`, `%` and format widths, center, ljust, indent, replace, join, ...)
  check what they would make before making it;
- loops over range() are capped at jinja's MAX_RANGE, and recursion at Python's own limit.
Anything a render raises becomes a ChatTemplateError (a ValueError): the server answers 400.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.runtime import Macro
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

# Integers a template computes stay below this many bits: `10 ** 10 ** 8` or repeated squaring
# would otherwise run for minutes inside one operation, where no deadline check can reach.
MAX_INT_BITS = 1 << 16
MAX_JSON_INDENT = 16  # tojson(indent=...): each level of nesting writes it again on every line


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may cost: `timeout_s` seconds of wall time, and `max_chars` characters
    written or built (each string or list the template makes counts its length, as it is made).
    The defaults leave an honest template room for a 4 MiB request several times over."""

    timeout_s: float = 5.0
    max_chars: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("timeout_s", "max_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: use a positive value")


class ChatTemplateError(ValueError):
    """A template that failed on its input or went past its limits."""


def render_chat_template(source: str, limits: TemplateLimits, variables: dict[str, Any]) -> str:
    """`source` rendered with `variables`, within `limits`."""
    token = _BUDGET.set(_Budget(limits))
    try:
        return _compile(source).render(variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {_syntax(e)}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from e
    except RecursionError:
        raise ChatTemplateError(
            "the chat template recursed too deeply on these messages (a macro or loop calling "
            "itself without end, or input nested too deep)"
        ) from None
    except MemoryError:
        raise ChatTemplateError("the chat template ran out of memory on these messages") from None
    except Exception as e:  # the template's own failure on this input, whatever it raised
        raise ChatTemplateError(
            f"the chat template failed on these messages: {type(e).__name__}: {e}"
        ) from e
    finally:
        _BUDGET.reset(token)


def check_chat_template_syntax(source: str) -> None:
    """A ChatTemplateError when `source` does not compile, saying where."""
    try:
        _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {_syntax(e)}") from None


def _syntax(e: jinja2.TemplateSyntaxError) -> str:
    return f"line {e.lineno}: {e.message}"


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """The template, sandboxed and instrumented for the limits (a jinja2.TemplateSyntaxError
    when it does not parse)."""
    env = _LimitedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        finalize=_write,
    )
    filters = {**env.filters, "join": _join_of(env.filters["join"]), "tojson": _tojson}
    env.filters = {name: _limited(f, _FILTER_CHECKS.get(name)) for name, f in filters.items()}
    env.filters.update({_LOOP: _loop, _LITERAL: _literal, _BUILT: _built})
    env.globals["range"] = _range
    env.globals["lipsum"] = _lipsum
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    tree = _Instrument().visit(env.parse(source))
    tree.set_environment(env)
    return env.from_string(tree)


# ---- the budget of one render ------------------------------------------------------------


class _Budget:
    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.left = limits.max_chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"the chat template ran past its time limit of {self.limits.timeout_s:g} s "
                "(chat_template_timeout_s) on these messages"
            )

    def reserve(self, size: int, what: str) -> None:
        """Fail before an operation that would make `size` characters when they are not left."""
        if size > self.left:
            raise ChatTemplateError(
                f"the chat template's {what} would make {size:,} characters, past its limit of "
                f"{self.limits.max_chars:,} written or built (chat_template_max_chars); "
                f"{max(self.left, 0):,} were left"
            )

    def spend(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise ChatTemplateError(
                f"the chat template wrote or built more than {self.limits.max_chars:,} "
                "characters on these messages, its limit (chat_template_max_chars)"
            )

    def count(self, value: Any) -> Any:
        """`value`, its length spent when it is a string or a list."""
        if isinstance(value, (str, bytes, list, tuple)):
            self.spend(len(value))
        return value


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:
        # Also what keeps jinja from folding a limited filter into a constant at compile time:
        # it evaluates the filter at render time instead, with a budget.
        raise RuntimeError("a chat template runs only inside render_chat_template")
    return budget


# ---- the sandbox -------------------------------------------------------------------------


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """Operators and calls check the clock and the budget. Calls made while rendering go
    through `call` (jinja routes every call through it in a sandbox); of the operators, those
    in intercepted_binops go through `call_binop`."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        if operator == "*":
            _check_repeat(budget, left, right)
        elif operator == "**":
            _check_power(left, right)
        elif operator == "%" and isinstance(left, str):
            budget.reserve(_printf_width(left), "'%' formatting")
        return budget.count(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.tick()
        args = _check_call(budget, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        # A macro's text was counted piece by piece as it was written.
        return result if isinstance(__obj, Macro) else budget.count(result)


def _check_repeat(budget: _Budget, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        bits = left.bit_length() + right.bit_length()
        if bits > MAX_INT_BITS:
            raise ChatTemplateError(
                f"the chat template's '*' would make an integer of {bits:,} bits: chat templates "
                f"may make at most {MAX_INT_BITS:,}"
            )
        return
    seq, times = (left, right) if isinstance(right, int) else (right, left)
    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
        budget.reserve(len(seq) * times, "'*'")


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        bits = (abs(base).bit_length() - 1) * exponent
        if bits > MAX_INT_BITS:
            raise ChatTemplateError(
                f"the chat template's '**' would make an integer of about {bits:,} bits: chat "
                f"templates may make at most {MAX_INT_BITS:,}"
            )


# %-conversions: (width, precision), each digits or '*' (taken from the arguments).
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?[a-zA-Z%]")


def _printf_width(fmt: str) -> int:
    """At least how many characters `fmt % args` pads to: its widths and precisions."""
    total = 0
    for width, precision in _PRINTF.findall(fmt):
        if "*" in (width, precision):
            raise ChatTemplateError(
                "the chat template's '%' formatting takes a width from its arguments ('*'): "
                "chat templates may only write widths as digits"
            )
        total += int(width or 0) + int(precision or 0)
    return total


def _format_width(fmt: str, args: Iterable[Any]) -> int:
    """Like _printf_width for str.format: digits in the fields' specs; a spec that takes a
    number from the arguments (`{:{w}}`) counts the largest integer argument."""
    total = 0
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None or not spec:
            continue
        total += sum(int(d) for d in re.findall(r"\d+", spec))
        if "{" in spec:
            total += max((a for a in args if isinstance(a, int)), default=0)
    return total


def _check_call(budget: _Budget, obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Checks what a string method would make before it is called; returns the arguments to
    call it with (join's iterable as a list, having been counted)."""
    wrapped = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format in its own
    owner, name = getattr(wrapped, "__self__", None), getattr(wrapped, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        if obj is _lipsum:
            budget.reserve(_lipsum_size(*args, **kwargs), "lipsum()")
        return args
    if name in ("format", "format_map"):
        mapping = args[0] if name == "format_map" and args and isinstance(args[0], dict) else {}
        values = [*args, *kwargs.values(), *mapping.values()]
        budget.reserve(_format_width(owner, values), f"str.{name}()")
    elif name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        budget.reserve(args[0], f"str.{name}()")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        budget.reserve(
            owner.count("\t" if isinstance(owner, str) else b"\t") * tab, "str.expandtabs()"
        )
    elif name == "replace" and len(args) >= 2:
        budget.reserve(_replaced_size(owner, *args), "str.replace()")
    elif name == "join" and args:
        items = list(args[0])
        budget.reserve(max(len(items) - 1, 0) * len(owner), "str.join()")
        return (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        budget.reserve(len(owner) * longest, "str.translate()")
    return args


def _replaced_size(s: str, old: str, new: str, count: int | None = -1) -> int:
    times = s.count(old) if old else len(s) + 1
    if count is not None and count >= 0:
        times = min(times, count)
    return len(s) + times * (len(new) - len(old))


# ---- filters and globals -----------------------------------------------------------------


def _limited(f: Callable, check: Callable | None = None) -> Callable:
    """Filter `f` checking the clock, then `check(budget, *args)` (the filter's arguments after
    any context jinja passes it), then counting its result."""
    skip = 1 if hasattr(f, "jinja_pass_arg") else 0  # pass_context / _eval_context / _environment

    @functools.wraps(f)  # keeps jinja_pass_arg, so jinja passes the same arguments
    def limited(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        if check is not None:
            check(budget, *args[skip:], **kwargs)
        return budget.count(f(*args, **kwargs))

    return limited


def _center(budget: _Budget, value: Any, width: int = 80) -> None:
    budget.reserve(int(width), "center filter")


def _indent(budget: _Budget, s: Any, width: int | str = 4, *_: Any, **__: Any) -> None:
    size = width if isinstance(width, int) else len(str(width))
    budget.reserve((str(s).count("\n") + 1) * size, "indent filter")


def _wordwrap(
    budget: _Budget,
    s: Any,
    width: int = 79,
    long: Any = True,
    wrapstring: Any = None,
    *_: Any,
    **__: Any,
) -> None:
    lines = len(str(s)) // max(int(width), 1) + 1
    budget.reserve(lines * len(wrapstring or "\n"), "wordwrap filter")


def _replace(budget: _Budget, s: Any, old: Any, new: Any, count: int | None = None) -> None:
    budget.reserve(_replaced_size(str(s), str(old), str(new), count), "replace filter")


def _format(budget: _Budget, value: Any, *_: Any, **__: Any) -> None:
    budget.reserve(_printf_width(str(value)), "format filter")


def _fill(budget: _Budget, value: Any, count: int, fill_with: Any = None) -> None:
    # slice makes `count` lists whatever the input; batch pads the last to `count` items.
    budget.reserve(int(count), "batch or slice filter")


_FILTER_CHECKS: dict[str, Callable] = {
    "center": _center,
    "indent": _indent,
    "wordwrap": _wordwrap,
    "replace": _replace,
    "format": _format,
    "batch": _fill,
    "slice": _fill,
}


def _join_of(join: Callable) -> Callable:
    """jinja's join, counting the separators it will write before writing them."""

    @functools.wraps(join)
    def bounded_join(eval_ctx: Any, value: Iterable[Any], d: str = "", attribute: Any = None):
        items = list(value)
        _budget().reserve(max(len(items) - 1, 0) * len(str(d)), "join filter")
        return join(eval_ctx, items, d, attribute)

    return bounded_join


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML (<, >, &), which would change prompts.
    if len(indent if isinstance(indent, str) else " " * (indent or 0)) > MAX_JSON_INDENT:
        raise ChatTemplateError(
            f"the chat template's tojson indent={indent!r} is wider than {MAX_JSON_INDENT}: "
            "every nested line would repeat it"
        )
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _range(*args: int) -> range:
    numbers = range(*args)
    if len(numbers) > MAX_RANGE:
        raise ChatTemplateError(
            f"the chat template asked for range({', '.join(map(str, args))}), {len(numbers):,} "
            f"numbers: chat "
            f"templates may loop over at most {MAX_RANGE:,}"
        )
    return numbers


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    return generate_lorem_ipsum(n, html, min, max)


def _lipsum_size(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> int:  # noqa: A002
    return n * max * 16  # the longest lorem ipsum word is 12 characters, plus separators


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


# ---- what the instrumented template calls ------------------------------------------------

_LOOP, _LITERAL, _BUILT = "__outrider_loop", "__outrider_literal", "__outrider_built"


class _Ticking:
    """An iterable that checks the clock before each item (keeping len() for jinja's loop)."""

    def __init__(self, items: Iterable[Any], budget: _Budget) -> None:
        self._items, self._budget = items, budget

    def __iter__(self) -> Iterator[Any]:
        for item in self._items:
            self._budget.tick()
            yield item

    def __len__(self) -> int:
        return len(self._items)  # a TypeError for an iterator: jinja then counts it itself


# The three filters and `_write` take the context so jinja never evaluates them at compile time.
@jinja2.pass_context
def _loop(context: Any, items: Iterable[Any]) -> _Ticking:
    return _Ticking(items, _budget())


@jinja2.pass_context
def _literal(context: Any, text: str) -> str:
    return text


@jinja2.pass_context
def _built(context: Any, value: Any) -> Any:
    budget = _budget()
    budget.tick()
    return budget.count(value)


@jinja2.pass_context
def _write(context: Any, value: Any) -> str:
    """Every piece a template writes, anywhere (a macro's body, a set block, the output)."""
    text = str(value)
    budget = _budget()
    budget.tick()
    budget.spend(len(text))
    return text


class _Instrument(NodeTransformer):
    """Rewrites the parsed template: every `for` iterates through _loop, every literal piece of
    text is written through _literal (so it is counted each time a loop writes it), and every
    `~` concatenation is counted through _built."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = _filter(node.iter, _LOOP)
        return node

    def visit_TemplateData(self, node: nodes.TemplateData) -> nodes.Expr:
        return _filter(nodes.Const(node.data, lineno=node.lineno), _LITERAL)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Expr:
        self.generic_visit(node)
        return _filter(node, _BUILT)


def _filter(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it for
    training masks): rendered as its body, so templates using it compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()
