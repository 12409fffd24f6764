"""Names -> implementations, imported on first use: what models, attention backends and
proposers are looked up by. An entry is "module:attribute" (imported when first asked for, so
naming a heavy implementation costs nothing until it serves) or the object itself."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """`what` names the kind in errors ("attention backend"); `entries` are the built-in names,
    which `unregister` refuses to drop; `remover` is what errors tell users to call to free a
    name (the public function that calls `unregister`)."""

    def __init__(
        self, what: str, entries: Mapping[str, str | T], remover: str = "unregister"
    ) -> None:
        self.what, self.remover = what, remover
        self._built_in = tuple(entries)
        self._entries: dict[str, str | T] = dict(entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> tuple[str, ...]:
        """Every name: the built-in ones first, then the others in registration order."""
        return tuple(self._entries)

    def entry(self, name: str) -> str | T:
        """What `name` was registered with, not imported."""
        return self._entries[name]

    def get(self, name: str) -> T:
        """The implementation registered as `name`, imported on first use; ValueError listing
        the names when there is none."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.what} {name!r}: use one of {', '.join(self._entries)}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            entry = getattr(importlib.import_module(module), attribute)
        return entry

    def register(self, name: str, entry: str | T) -> None:
        """Add `name`; a name already taken is refused. A string entry must read
        "module:attribute"."""
        if name in self._entries:
            raise ValueError(
                f"a {self.what} is already registered as {name!r} ({self._entries[name]!r}): "
                f"choose another name, or {self.remover}({name!r}) first"
            )
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            if not module or not attribute or ":" in attribute:
                raise ValueError(
                    f"{self.what} {name!r}: {entry!r} is not 'module:attribute' (e.g. "
                    f"{next(iter(self._entries.values()))!r}); give that, or the object itself"
                )
        self._entries[name] = entry

    def unregister(self, name: str) -> None:
        """Forget a name `register` added; the built-in ones stay."""
        if name in self._built_in:
            raise ValueError(
                f"{name!r} is one of outrider's own {self.what}s ({', '.join(self._built_in)}) "
                "and stays registered"
            )
        if name not in self._entries:
            raise ValueError(
                f"no {self.what} is registered as {name!r}: registered are "
                f"{', '.join(self._entries)}"
            )
        del self._entries[name]
