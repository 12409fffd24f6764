"""The structured-outputs case set (benchmarks/structured_schemas.json) as benchmarks read it:
JSON schemas, regular expressions and choices, each with its prompt and a valid example, and
whether an output satisfies its case. benchmarks/structured.py asks the engine for them;
benchmarks/grammar_backends.py compiles them with each grammar library."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

CASES = Path(__file__).resolve().parent / "structured_schemas.json"


@dataclass(frozen=True)
class Case:
    """One request of the set: `kind` "json" (`spec` the schema), "regex" (the pattern) or
    "choice" (the tuple of strings); `example` a valid output, as text."""

    name: str
    kind: str
    spec: dict | str | tuple[str, ...]
    prompt: str
    example: str

    def structured_outputs(self) -> dict:
        """SamplingParams.structured_outputs for this case."""
        return {self.kind: list(self.spec) if self.kind == "choice" else self.spec}

    def is_valid(self, text: str) -> bool:
        """Whether `text` is what the constraint allows: JSON that validates against the schema,
        a full match of the regex, or exactly one of the choices."""
        if self.kind == "regex":
            return re.fullmatch(self.spec, text) is not None
        if self.kind == "choice":
            return text in self.spec
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError:
            return False
        return jsonschema.validators.validator_for(self.spec)(self.spec).is_valid(value)


def load_cases(path: str | Path = CASES, num_schemas: int | None = None) -> list[Case]:
    """The set's JSON schemas, then its regexes, then its choices; `num_schemas` caps each of
    the three (2: two schemas, two regexes, two choices)."""
    doc = json.loads(Path(path).read_text())
    cap = slice(None, num_schemas)
    cases = [
        Case(e["name"], "json", e["schema"], e["prompt"], json.dumps(e["example"]))
        for e in doc.get("schemas", [])[cap]
    ]
    cases += [
        Case(e["name"], "regex", e["regex"], e["prompt"], e["example"])
        for e in doc.get("regex", [])[cap]
    ]
    cases += [
        Case(e["name"], "choice", tuple(e["choice"]), e["prompt"], e["example"])
        for e in doc.get("choice", [])[cap]
    ]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{path}: case names {dup} appear more than once: names key results")
    return cases
