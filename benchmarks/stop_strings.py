"""What stop strings cost the engine thread per decode step: the detokenizer that scans every
stop string each step (outrider/engine/detokenizer.py at a reference commit, loaded from git)
against the one that feeds each step's text to an Aho-Corasick automaton (stop_strings.py),
side by side on the same text.

    python benchmarks/stop_strings.py [--cases 1x4 4x16 64x256 1000x248 15000x248]
                                      [--steps 400] [--budget-s 20] [--ref aac5ade] [--out PATH]

A case CxL: C random stop strings of L characters over the text's alphabet (their prefixes
keep turning up, so every step holds some text back; none ever completes). Each step adds
one 4-character token; both detokenizers must return the same deltas. Per side: the median
update() time, and the time to build the detokenizer (the new one builds its automaton then;
the engine does it in validate(), off the engine thread, when the server checks a request).
Each side runs at most --steps steps or --budget-s seconds. Writes
benchmarks/results/stop_strings.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import module_at, write_result  # noqa: E402

from outrider.core import Request, SamplingParams  # noqa: E402
from outrider.engine import detokenizer, stop_strings  # noqa: E402

REFERENCE = "aac5ade"  # the last commit whose detokenizer scans every stop string each step
ALPHABET = "abcdefgh "


def load_reference(commit: str):
    """The detokenizer module as it was at `commit`."""
    return module_at(commit, "outrider/engine/detokenizer.py", "detokenizer_reference")


class PieceTokenizer:
    """Token id i is the i-th 4-character piece of the text."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in token_ids)


def run_side(cls, tokenizer, params, steps: int, budget_s: float) -> dict:
    t = time.perf_counter()
    detok = cls(tokenizer, Request([0], params))
    build_ms = (time.perf_counter() - t) * 1e3
    times, deltas = [], []
    deadline = time.perf_counter() + budget_s
    for i in range(1, steps + 1):
        t = time.perf_counter()
        deltas.append(detok.update([i]))
        times.append(time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return {
        "build_ms": round(build_ms, 3),
        "steps": len(times),
        "median_us": round(statistics.median(times) * 1e6, 2),
        "max_us": round(max(times) * 1e6, 2),
        "deltas": deltas,
    }


def run_case(count: int, length: int, steps: int, budget_s: float, reference) -> dict:
    rng = random.Random(f"{count}x{length}")
    pieces = ["".join(rng.choice(ALPHABET) for _ in range(4)) for _ in range(steps + 1)]
    stops = ["".join(rng.choice(ALPHABET) for _ in range(length - 1)) + "z" for _ in range(count)]
    tokenizer, params = PieceTokenizer(pieces), SamplingParams(stop=stops, max_tokens=None)
    stop_strings.automaton.cache_clear()
    new = run_side(detokenizer.IncrementalDetokenizer, tokenizer, params, steps, budget_s)
    old = run_side(reference.IncrementalDetokenizer, tokenizer, params, steps, budget_s)
    both = min(old["steps"], new["steps"])
    assert old.pop("deltas")[:both] == new.pop("deltas")[:both], (count, length)
    return {
        "stop_strings": count,
        "chars_each": length,
        "old": old,
        "new": new,
        "speedup": round(old["median_us"] / new["median_us"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["1x4", "4x16", "64x256", "1000x248",
                                                       "15000x248"])  # fmt: skip
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--budget-s", type=float, default=20.0)
    parser.add_argument(
        "--ref", default=REFERENCE, help="commit holding the version to compare with"
    )
    parser.add_argument("--out", default=None, help="directory or .json path for the result")
    args = parser.parse_args()
    reference = load_reference(args.ref)
    rows = []
    for case in args.cases:
        count, length = map(int, case.split("x"))
        row = run_case(count, length, args.steps, args.budget_s, reference)
        rows.append(row)
        print(
            f"{count:6d} x {length:4d} chars  per step: old {row['old']['median_us']:10.1f} us  "
            f"new {row['new']['median_us']:6.1f} us ({row['speedup']}x)   build: old "
            f"{row['old']['build_ms']:.1f} ms  new {row['new']['build_ms']:.1f} ms",
            flush=True,
        )
    payload = {"reference_commit": args.ref, "token_chars": 4, "rows": rows}
    print(write_result("stop_strings", payload, args.out))


if __name__ == "__main__":
    main()
