"""Every flag of every command says what it does in `--help`: a few words of its own, not only
the default the help formatter appends."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from outrider.cli import build_parser
from outrider.flags import Commands

MIN_WORDS = 4
_DEFAULT = re.compile(r"\(default: [^)]*\)")


def _flags(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    """(command path, action) for every optional argument of `parser` and its subcommands.
    Subcommands under `Commands` get their flags only when chosen, so each is filled here, once,
    as Commands would when it is chosen."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                fill = action.fill.pop(name, None) if isinstance(action, Commands) else None
                if fill is not None:
                    fill()
                yield from _flags(sub, f"{path} {name}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_has_a_sentence():
    flags = list(_flags(build_parser(), "outrider"))
    assert len(flags) > 200  # every command's flags were reached, the lazily added ones too
    bare = []
    for path, action in flags:
        words = _DEFAULT.sub("", action.help or "").split()
        if len(words) < MIN_WORDS:
            bare.append(f"{path} {'/'.join(action.option_strings)}: {action.help!r}")
    assert not bare, (
        f"{len(bare)} flag(s) without a sentence in --help; say what each does (and its unit) "
        "in its help=:\n" + "\n".join(bare)
    )
