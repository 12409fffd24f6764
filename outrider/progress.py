"""Progress bars for what takes seconds at start-up — loading the weights, capturing CUDA
graphs, measuring the speculative step profile — on stderr when it is a terminal (never in a
log file or a pipe; OUTRIDER_PROGRESS=1 forces them, 0 hides them)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from outrider import env

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """`items`, drawn as a bar while they are consumed (or `items` itself when bars are off)."""
    if not env.progress(sys.stderr.isatty()):
        return items
    from tqdm import tqdm

    return tqdm(
        items, desc=f"[outrider] {desc}", total=total, leave=False, file=sys.stderr,
        dynamic_ncols=True, mininterval=0.25,
    )  # fmt: skip
