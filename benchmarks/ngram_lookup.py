"""What an n-gram `propose` costs per decode step: the vectorized proposer vs the dict-per-request
one it replaced (outrider/speculative/ngram.py at a reference commit, loaded from git), side by
side on the same requests.

    python benchmarks/ngram_lookup.py [--requests 64] [--contexts 1000 4000] [--steps 200]
                                      [--ref 5f66075] [--out PATH]

Each case: R requests of L random tokens from a 16-token vocabulary (matches at every n), or
a repetitive case (a 50-token phrase from a 32k vocabulary, repeated, 5% of its tokens changed,
and continued by the output); both proposers index the prompts once ("index"), then every step
appends one token to every request and times `propose(requests, k=4)` with n in 1..4, the two
proposers in alternating order. Both must give the same drafts at every step. "rebuild" times
the new proposer's table rebuild from all its requests (the pause when its table fills up).
Writes benchmarks/results/ngram_lookup.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import module_at, write_result  # noqa: E402

from outrider.core import Request, SamplingParams  # noqa: E402
from outrider.speculative.ngram import NgramConfig, NgramProposer  # noqa: E402

REFERENCE = "5f66075"  # the last commit with the dict-per-request proposer


def load_reference(commit: str):
    """The proposer module as it was at `commit`."""
    return module_at(commit, "outrider/speculative/ngram.py", "ngram_reference")


def make_case(kind: str, num: int, length: int, rng: random.Random):
    """Prompts, and the token each request appends next (given its length so far)."""
    if kind == "random":  # 16 tokens: every 1..3-gram recurs, 4-grams now and then
        prompts = [[rng.randrange(16) for _ in range(length)] for _ in range(num)]
        return prompts, lambda i, pos: rng.randrange(16)
    # A 50-token phrase over a 32k vocabulary, repeated, 5% of its tokens changed; the output
    # goes on repeating it, 10% of its tokens changed.
    phrases = [[rng.randrange(32000) for _ in range(50)] for _ in range(num)]
    prompts = []
    for phrase in phrases:
        tokens = [phrase[i % 50] for i in range(length)]
        for i in rng.sample(range(length), length // 20):
            tokens[i] = rng.randrange(32000)
        prompts.append(tokens)
    return (
        prompts,
        lambda i, pos: phrases[i][pos % 50] if rng.random() < 0.9 else rng.randrange(32000),
    )


def run_case(kind, num, length, steps, k, reference, seed=0) -> dict:
    rng = random.Random(seed)
    prompts, next_token = make_case(kind, num, length, rng)
    config = dict(min_n=1, max_n=4, num_draft_tokens=k)
    proposers = {
        "old": reference.NgramProposer(reference.NgramConfig(**config)),
        "new": NgramProposer(NgramConfig(**config)),
    }
    requests = {
        name: [
            Request(
                prompt_token_ids=list(p), params=SamplingParams(temperature=0), request_id=f"r{i}"
            )
            for i, p in enumerate(prompts)
        ]
        for name in proposers
    }
    index_s = {}
    for name, proposer in proposers.items():
        t0 = time.perf_counter()
        proposer.propose(requests[name], k)
        index_s[name] = time.perf_counter() - t0
    times = {name: [] for name in proposers}
    drafted = 0
    for step in range(steps):
        appended = [next_token(i, length + step) for i in range(num)]
        out = {}
        for name in rng.sample(list(proposers), 2):  # alternate which one runs first
            for r, t in zip(requests[name], appended):
                r.output_token_ids.append(t)
            t0 = time.perf_counter()
            out[name] = proposers[name].propose(requests[name], k)
            times[name].append(time.perf_counter() - t0)
        old = [d.token_ids for d in out["old"]]
        assert old == [d.token_ids for d in out["new"]], "the proposers disagree"
        drafted += sum(map(len, old))
    # The pause when the new one's table fills up: a rebuild from every tracked request.
    t0 = time.perf_counter()
    proposers["new"]._reindex()
    rebuild_ms = 1e3 * (time.perf_counter() - t0)

    def per_step(ts):
        ts = sorted(ts)
        return {"median_us": 1e6 * ts[len(ts) // 2], "p90_us": 1e6 * ts[int(len(ts) * 0.9)]}

    row = {
        "kind": kind, "requests": num, "context": length, "steps": steps, "k": k,
        "mean_drafts": drafted / (steps * num),
        "old": per_step(times["old"]) | {"index_ms": 1e3 * index_s["old"]},
        "new": per_step(times["new"]) | {"index_ms": 1e3 * index_s["new"], "rebuild_ms": rebuild_ms},
    }  # fmt: skip
    row["speedup"] = row["old"]["median_us"] / row["new"]["median_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--kinds", nargs="+", default=["random", "repetitive"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument(
        "--ref", default=REFERENCE, help="commit holding the version to compare with"
    )
    parser.add_argument("--out", default=None, help="directory or .json path for the result")
    args = parser.parse_args()
    reference = load_reference(args.ref)
    rows = []
    for kind in args.kinds:
        for length in args.contexts:
            row = run_case(kind, args.requests, length, args.steps, args.k, reference)
            rows.append(row)
            print(
                f"{kind:10s} R={row['requests']} L={length:6d}  per step: old "
                f"{row['old']['median_us']:7.0f} us  new {row['new']['median_us']:7.0f} us  "
                f"({row['speedup']:.2f}x)   index: old {row['old']['index_ms']:6.1f} ms  "
                f"new {row['new']['index_ms']:6.1f} ms (rebuild {row['new']['rebuild_ms']:.1f} ms)  "
                f"drafts/req {row['mean_drafts']:.2f}",
                flush=True,
            )
    payload = {"reference_commit": args.ref, "max_n": 4, "min_n": 1, "rows": rows}
    print(write_result("ngram_lookup", payload, args.out))


if __name__ == "__main__":
    main()
