"""What one whole engine step costs on this machine, by padded batch size and k: the table the
adaptive controller (controller.py) decides from, measured once per (machine, model, drafter,
dtype) and cached on disk."""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class StepProfile:
    """Measured milliseconds of one whole engine step on this machine, by padded batch size and k:
    k = 0 is the plain decode step; k >= 1 is the whole speculative step (target verify of 1 + k
    tokens per sequence + acceptance + the drafter's forwards for the next k drafts).

    Invariants (checked): batch sizes >= 1, every batch size measures the same k's, k = 0 among
    them, every time finite and > 0. Keys are normalized to sorted ints, so JSON's string keys
    load as they were saved. `key` says what the table was measured for (machine, model,
    drafter, dtype, ...): a cached table with another key is stale. Not hashable (dict fields)."""

    ms: dict[int, dict[int, float]]  # batch_size -> {k: ms}
    key: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ms = {int(b): {int(k): float(t) for k, t in row.items()} for b, row in self.ms.items()}
        ms = {b: dict(sorted(ms[b].items())) for b in sorted(ms)}
        if not ms or min(ms) < 1:
            raise ValueError(
                f"invalid step profile batch sizes {list(ms)}: measure at least one batch size "
                ">= 1 (the padded sizes decode graphs are captured for)"
            )
        ks = list(ms[min(ms)])
        for b, row in ms.items():
            if list(row) != ks:
                raise ValueError(
                    f"step profile measures k {list(row)} at batch size {b} but {ks} at batch "
                    f"size {min(ms)}: measure the same k's at every batch size"
                )
            bad = {k: t for k, t in row.items() if not (math.isfinite(t) and t > 0)}
            if bad:
                raise ValueError(f"step profile at batch size {b} has invalid times {bad} (ms)")
        if 0 not in ks:
            raise ValueError(
                f"step profile measures k {ks} but not k = 0: the plain decode step is what "
                "speculation has to beat, measure it too"
            )
        object.__setattr__(self, "ms", ms)
        object.__setattr__(self, "key", {str(k): str(v) for k, v in self.key.items()})

    @property
    def ks(self) -> list[int]:
        return list(next(iter(self.ms.values())))

    def step_ms(self, batch_size: int, k: int) -> float:
        """Cost of a step of batch_size sequences at k: the smallest measured batch size >=
        batch_size (graphs are padded up to it); above the largest, linear from the two largest."""
        if batch_size < 1:
            raise ValueError(f"invalid batch_size={batch_size}: a step has at least 1 sequence")
        sizes = list(self.ms)
        if k not in self.ms[sizes[0]]:
            raise ValueError(
                f"k={k} is not in the step profile (measured k: {self.ks}): choose one of "
                "those, or measure the profile again with this k"
            )
        i = bisect.bisect_left(sizes, batch_size)
        if i < len(sizes) or len(sizes) == 1:  # one point: no slope to extrapolate with
            return self.ms[sizes[min(i, len(sizes) - 1)]][k]
        b1, b2 = sizes[-2:]
        t1, t2 = self.ms[b1][k], self.ms[b2][k]
        # Measurement noise can make the slope negative; more sequences never make a step cheaper.
        slope = max(0.0, (t2 - t1) / (b2 - b1))
        return t2 + slope * (batch_size - b2)

    def monotone(self) -> StepProfile:
        """The same table made non-decreasing in k and in batch size (a running max): more
        drafts or more sequences never make a step cheaper, so a dip is measurement noise,
        and a table with dips can make a k look better than it is."""
        ms: dict[int, dict[int, float]] = {}
        prev: dict[int, float] = {}
        for b, row in self.ms.items():
            out, top = {}, 0.0
            for k, t in row.items():
                top = max(top, t, prev.get(k, 0.0))
                out[k] = top
            ms[b] = prev = out
        return StepProfile(ms, self.key)

    def bucket(self, batch_size: int) -> int:
        """The measured batch size a step of batch_size runs as (the largest past the table)."""
        sizes = list(self.ms)
        i = bisect.bisect_left(sizes, batch_size)
        return sizes[min(i, len(sizes) - 1)]

    def to_json(self) -> str:
        ms = {str(b): {str(k): t for k, t in row.items()} for b, row in self.ms.items()}
        return json.dumps({"key": self.key, "ms": ms}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> StepProfile:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("ms"), dict):
            raise ValueError('a step profile is a JSON object {"key": {...}, "ms": {...}}')
        return cls(ms=data["ms"], key=data.get("key") or {})

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename: engines sharing a cache directory never read half a file.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(
        cls, path: str | os.PathLike, key: Mapping[str, str] | None = None
    ) -> StepProfile | None:
        """The profile saved at path; None when there is none or it was measured for another key
        (then measure again). A file that is not a profile raises rather than being re-measured
        over silently."""
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            return None
        try:
            profile = cls.from_json(text)
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(
                f"unreadable step profile {path}: {e}; delete it to measure again"
            ) from e
        if key is not None and profile.key != {str(k): str(v) for k, v in key.items()}:
            return None
        return profile
