"""The measurement behind outrider's grammar library: llguidance against xgrammar on this CPU,
with the default model's tokenizer, over every case of benchmarks/structured_schemas.json.

    python benchmarks/grammar_backends.py [--xgrammar-path /tmp/xg] [--wheel-dir /tmp/xgw]
        [--libraries llguidance xgrammar] [--whitespace engine] [--num-schemas N] [--k 4]
        [--repeats 3] [--out NAME] [--out-dir DIR]

xgrammar is not one of outrider's dependencies and is not installed beside it: put its wheel
and apache-tvm-ffi's in a directory of their own and name it with --xgrammar-path, e.g.

    python -m pip download --no-deps -d /tmp/xgw xgrammar apache-tvm-ffi llguidance
    python -m pip install --no-deps --target /tmp/xg /tmp/xgw/xgrammar-*.whl /tmp/xgw/apache_tvm*

(its other needs, torch, transformers, triton, numpy and pydantic, are outrider's already).

llguidance runs as the engine runs it (engine/structured.py: its grammar text, pointer masks,
its executor); xgrammar is given the same language: JSON spelled with ", " and ": " and no other
whitespace (--whitespace flexible: both libraries' any-whitespace JSON instead), a choice as
literal alternatives. Per library: the import (a fresh interpreter, alone and after torch), the
tokenizer setup (once per model), and per case: compile (the constraint to a matcher; median of
--repeats, each from scratch), the first next-token bitmask (a matcher computes some of its
tables on first use), the median next-token bitmask and token consume along the tokens of the
case's valid example (the default tokenizer's tokens of it, then EOS), and the masks of one
speculative step of k drafts: the root's and each draft's, the drafts being the example's next
k tokens (all valid: the most masks a step computes), through the library's own call
(llguidance's unsafe_compute_mask_ptr_with_draft_token, as the engine calls it; xgrammar's
traverse_draft_tree on a chain) and by hand (mask, consume, ..., rollback). Where both run, how
many positions' masks agree bit for bit. And each library's footprint: its wheel and installed
size, its runtime dependencies and their installed sizes here. Writes
benchmarks/results/grammar_backends_cpu.json (_flexible: any whitespace).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from structured_cases import CASES, Case, load_cases  # noqa: E402

LIBRARIES = ("llguidance", "xgrammar")
# The per-library summary: medians over cases of each case's median.
SUMMARY = (
    "compile_ms",
    "first_mask_us",
    "ready_ms",
    "mask_us",
    "consume_us",
    "draft_mask_us",
    "draft_loop_us",
)


def popcount(row) -> int:
    """Allowed tokens in one bitmask row (int32 words)."""
    import numpy as np

    return int(np.unpackbits(row.numpy().view(np.uint8)).sum())


class Llguidance:
    """llguidance as the engine runs it (engine/structured.py): the grammar text the engine
    compiles for the constraint (`grammar_text`; with `whitespace` "flexible", JSON in
    llguidance's default any-whitespace instead), masks written through pointers, a chain's
    draft masks in an LLExecutor of half the cores."""

    name = "llguidance"
    modules = ("llguidance",)

    def __init__(self, backend, vocab_size: int, eos: list[int], whitespace: str = "engine"):
        import os

        import llguidance

        self._ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.words = -(-vocab_size // 32)
        self.executor = llguidance.LLExecutor(
            num_threads=max(1, min(16, (os.cpu_count() or 2) // 2))
        )
        self.whitespace = whitespace

    def compile(self, case: Case):
        from outrider.core import StructuredOutputs
        from outrider.engine.structured import grammar_text

        if case.kind == "json" and self.whitespace == "flexible":
            grammar = self._ll.LLMatcher.grammar_from_json_schema(case.spec)
        else:
            grammar = grammar_text(StructuredOutputs.of(case.structured_outputs()))
        matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{case.name}: llguidance refused it: {matcher.get_error()}")
        return matcher

    def alloc(self, rows: int):
        import torch

        return torch.zeros(rows, self.words, dtype=torch.int32)

    def fill(self, matcher, mask, row: int = 0) -> None:
        matcher.unsafe_compute_mask_ptr(mask[row].data_ptr(), self.words * 4)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def draft(self, matcher, root: int, drafts: list[int], mask) -> None:
        """Masks after the root (row 0) and after each draft (row i + 1); the matcher is left
        where it was."""
        self.executor.unsafe_compute_mask_ptr_with_draft_token(
            [(matcher, 0, drafts)], mask.data_ptr(), self.words * 4, mask.shape[0]
        )

    def done(self, matcher) -> bool:
        return matcher.is_stopped() and not matcher.is_error()


class Xgrammar:
    """xgrammar given what the engine gives llguidance: JSON with ", " and ": " and no other
    whitespace (any whitespace with `whitespace` "flexible"), a choice as a grammar of literal
    alternatives; a compiler without its cache, so every compile is a first one."""

    name = "xgrammar"
    modules = ("xgrammar",)

    def __init__(self, backend, vocab_size: int, eos: list[int], whitespace: str = "engine"):
        import transformers
        import xgrammar

        self._xg = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=eos
        )
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size
        self.whitespace = whitespace

    def compile(self, case: Case):
        c = self.compiler
        if case.kind == "json":
            if self.whitespace == "flexible":
                compiled = c.compile_json_schema(case.spec)
            else:
                compiled = c.compile_json_schema(
                    case.spec, any_whitespace=False, separators=(", ", ": ")
                )
        elif case.kind == "regex":
            compiled = c.compile_regex(case.spec)
        else:
            compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in case.spec))
        return self._xg.GrammarMatcher(compiled)

    def alloc(self, rows: int):
        return self._xg.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher, mask, row: int = 0) -> None:
        matcher.fill_next_token_bitmask(mask, row)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def draft(self, matcher, root: int, drafts: list[int], mask) -> None:
        """A chain as xgrammar's draft tree: node 0 the root (already consumed), node i + 1
        draft i, each node's mask the one after it; the matcher is left where it was."""
        import torch

        n = 1 + len(drafts)
        nxt = torch.tensor([i + 1 if i + 1 < n else -1 for i in range(n)], dtype=torch.int64)
        sibling = torch.full((n,), -1, dtype=torch.int64)
        tokens = torch.tensor([root, *drafts], dtype=torch.int64)
        if not matcher.traverse_draft_tree(nxt, sibling, tokens, mask):
            raise RuntimeError("xgrammar's traverse_draft_tree timed out")

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def _us(seconds: float) -> float:
    return seconds * 1e6


def walk(lib, case: Case, ids: list[int], k: int) -> dict:
    """One fresh matcher along ids (the example's tokens, EOS last): its compile time, first
    mask, each later mask, each consume, and at every position with a root and k tokens of the
    example ahead the masks of a k-draft step, by the library's call and by hand; the masks
    (row 0) along the way for comparing libraries."""
    t0 = time.perf_counter()
    matcher = lib.compile(case)
    compiled = time.perf_counter() - t0
    mask, drafts = lib.alloc(1), lib.alloc(1 + k)
    out = {
        "compile_s": compiled,
        "mask_us": [],
        "consume_us": [],
        "draft_mask_us": [],
        "draft_loop_us": [],
        "masks": [],
    }
    body = len(ids) - 1  # drafts come from the example, never EOS
    for p, token in enumerate(ids):
        t0 = time.perf_counter()
        lib.fill(matcher, mask)
        dt = _us(time.perf_counter() - t0)
        if p == 0:
            out["first_mask_us"] = dt
        else:
            out["mask_us"].append(dt)
        out["masks"].append(mask[0].clone())
        if p >= 1 and p + k <= body:
            ahead = ids[p : p + k]
            t0 = time.perf_counter()
            lib.draft(matcher, ids[p - 1], ahead, drafts)
            out["draft_mask_us"].append(_us(time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i, d in enumerate(ahead):
                lib.fill(matcher, drafts, i)
                lib.consume(matcher, d)
            lib.fill(matcher, drafts, k)
            lib.rollback(matcher, k)
            out["draft_loop_us"].append(_us(time.perf_counter() - t0))
        t0 = time.perf_counter()
        ok = lib.consume(matcher, token)
        out["consume_us"].append(_us(time.perf_counter() - t0))
        if not ok:
            raise ValueError(f"{lib.name} refused token {p} ({token}) of {case.name}'s example")
    if not lib.done(matcher):
        raise ValueError(f"{lib.name}: {case.name}'s example and EOS did not end its grammar")
    return out


def case_row(walks: list[dict]) -> dict:
    """One library's row for one case from its repeated walks: compile and first mask as the
    median over walks (each from scratch), the rest the median over every sample."""

    def med(key: str) -> float | None:
        xs = [x for w in walks for x in w[key]]
        return round(statistics.median(xs), 2) if xs else None

    compile_ms = statistics.median(w["compile_s"] for w in walks) * 1e3
    first_us = statistics.median(w["first_mask_us"] for w in walks)
    return {
        "compile_ms": round(compile_ms, 3),
        "compile_ms_runs": [round(w["compile_s"] * 1e3, 3) for w in walks],
        "first_mask_us": round(first_us, 2),
        "ready_ms": round(compile_ms + first_us / 1e3, 3),  # until the first token may sample
        "mask_us": med("mask_us"),
        "consume_us": med("consume_us"),
        "draft_mask_us": med("draft_mask_us"),
        "draft_loop_us": med("draft_loop_us"),
        "positions": len(walks[0]["consume_us"]),
    }


def agreement(a: list, b: list) -> dict:
    """Positions whose masks are equal bit for bit, and the largest difference in allowed
    tokens where they are not."""
    same = [bool((x == y).all()) for x, y in zip(a, b)]
    diff = [abs(popcount(x) - popcount(y)) for x, y, s in zip(a, b, same) if not s]
    return {
        "equal_fraction": round(sum(same) / len(same), 3),
        "max_allowed_diff": max(diff, default=0),
    }


def summarize(rows: dict) -> dict:
    """{library: {case: row}} -> per library the median over cases of each SUMMARY metric."""
    out = {}
    for lib, by_case in rows.items():
        out[lib] = {}
        for key in SUMMARY:
            xs = [r[key] for r in by_case.values() if r.get(key) is not None]
            out[lib][key] = round(statistics.median(xs), 3) if xs else None
        out[lib]["cases"] = len(by_case)
    return out


def _size(dist) -> int:
    """Bytes a distribution installed (its RECORD's sizes, else the files on disk)."""
    total = 0
    for f in dist.files or []:
        if f.size is not None:
            total += f.size
        else:
            p = Path(dist.locate_file(f))
            total += p.stat().st_size if p.is_file() else 0
    return total


def _dist(name: str, path: str | None):
    for where in ([path] if path else []) + [None]:
        try:
            if where is None:
                return metadata.distribution(name)
            return next(iter(metadata.distributions(name=name, path=[where])))
        except (metadata.PackageNotFoundError, StopIteration):
            continue
    return None


def _wheel(name: str, wheel_dir: str | None) -> int | None:
    if not wheel_dir:
        return None
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = [w for w in Path(wheel_dir).glob("*.whl") if w.name.lower().startswith(stem + "-")]
    return found[0].stat().st_size if found else None


def footprint(name: str, path: str | None, wheel_dir: str | None) -> dict:
    """The library's wheel and installed size, its runtime dependencies (markers evaluated for
    this machine, extras left out) and each one's installed size here (direct ones only)."""
    from packaging.requirements import Requirement

    dist = _dist(name, path)
    if dist is None:
        return {"installed": False}
    deps = {}
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        dep = _dist(req.name, path)
        deps[req.name] = {
            "spec": str(req),
            "version": dep.version if dep else None,
            "installed_mb": round(_size(dep) / 2**20, 1) if dep else None,
            "wheel_mb": None if (w := _wheel(req.name, wheel_dir)) is None else round(w / 2**20, 2),
        }
    wheel = _wheel(name, wheel_dir)
    return {
        "version": dist.version,
        "wheel_mb": None if wheel is None else round(wheel / 2**20, 2),
        "installed_mb": round(_size(dist) / 2**20, 1),
        "requires": deps,
        "installed_with_requires_mb": round(
            _size(dist) / 2**20 + sum(d["installed_mb"] or 0 for d in deps.values()), 1
        ),
    }


def import_seconds(module: str, path: str | None, after_torch: bool, repeats: int = 3) -> float:
    """Median seconds to import `module` in a fresh interpreter (after torch: as in outrider,
    which has it loaded)."""
    pre = "import torch; " if after_torch else ""
    code = (
        f"import sys, time; sys.path.insert(0, {path!r}) if {path!r} else None; {pre}"
        f"t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    )
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"import {module} failed: {out.stderr[-2000:]}")
        runs.append(float(out.stdout.split()[-1]))
    return round(statistics.median(runs), 3)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    ap.add_argument(
        "--xgrammar-path",
        default=None,
        help="directory xgrammar and apache-tvm-ffi were installed into (--target)",
    )
    ap.add_argument("--wheel-dir", default=None, help="the downloaded wheels, to size them")
    ap.add_argument("--cases", default=str(CASES))
    ap.add_argument("--num-schemas", type=int, default=None, help="cap on the cases of each kind")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per speculative step")
    ap.add_argument(
        "--whitespace",
        choices=("engine", "flexible"),
        default="engine",
        help="JSON as the engine spells it (', ' and ': ', nothing else) or any whitespace",
    )
    ap.add_argument("--repeats", type=int, default=3, help="walks per case and library")
    ap.add_argument(
        "--out",
        default=None,
        help="result name (default grammar_backends_cpu, with _flexible for --whitespace flexible)",
    )
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: use 1 or more")
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)  # this run only: never outrider's environment

    from outrider.loaders.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    backend, vocab = ck.tokenizer.backend, ck.config.vocab_size
    eos = list(ck.tokenizer.eos_token_ids)
    cases = load_cases(args.cases, args.num_schemas)
    ids = {c.name: backend.encode(c.example, add_special_tokens=False).ids + eos[:1] for c in cases}
    classes = {"llguidance": Llguidance, "xgrammar": Xgrammar}
    paths = {"llguidance": None, "xgrammar": args.xgrammar_path}
    libs, setup, info = {}, {}, {}
    for name in args.libraries:
        for module in classes[name].modules:  # imports are timed apart, in fresh interpreters
            importlib.import_module(module)
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            lib = classes[name](backend, vocab, eos, args.whitespace)
            runs.append(time.perf_counter() - t0)
        libs[name] = lib
        setup[name] = {
            "tokenizer_setup_ms": round(statistics.median(runs) * 1e3, 1),
            "tokenizer_setup_ms_runs": [round(r * 1e3, 1) for r in runs],
        }
        info[name] = {
            "footprint": footprint(name, paths[name], args.wheel_dir),
            "import_s": {
                m: import_seconds(m, paths[name], after_torch=False) for m in classes[name].modules
            },
            "import_after_torch_s": {
                m: import_seconds(m, paths[name], after_torch=True) for m in classes[name].modules
            },
            **setup[name],
        }
        print(f"{name}: tokenizer setup {setup[name]['tokenizer_setup_ms']} ms", flush=True)
    rows: dict = {name: {} for name in libs}
    agree: dict = {}
    errors: dict = {}
    for case in cases:
        masks = {}
        for name, lib in libs.items():
            try:
                walks = [walk(lib, case, ids[case.name], args.k) for _ in range(args.repeats)]
            except Exception as e:  # one case a library cannot do is a result, not the end
                errors.setdefault(name, {})[case.name] = f"{type(e).__name__}: {e}"
                continue
            rows[name][case.name] = {"kind": case.kind, **case_row(walks)}
            masks[name] = walks[0]["masks"]
        if len(masks) == 2:
            agree[case.name] = agreement(*masks.values())
        line = "  ".join(
            f"{n} {r[case.name]['compile_ms']:8.2f} ms {r[case.name]['mask_us']:7.1f} us"
            for n, r in rows.items()
            if case.name in r
        )
        print(f"{case.name:24s} {line}", flush=True)
    summary = summarize(rows)
    by_kind = {
        kind: summarize(
            {n: {c: r for c, r in by.items() if r["kind"] == kind} for n, by in rows.items()}
        )
        for kind in ("json", "regex", "choice")
    }
    print(f"\n{'library':12s} {'setup ms':>9s} " + " ".join(f"{k:>14s}" for k in SUMMARY))
    for name, s in summary.items():
        print(
            f"{name:12s} {setup[name]['tokenizer_setup_ms']:>9} "
            + " ".join(f"{'-' if s[k] is None else s[k]:>14}" for k in SUMMARY)
        )
    if agree:
        equal = statistics.median(a["equal_fraction"] for a in agree.values())
        print(f"masks equal bit for bit (median over cases): {equal}")
    result = {
        "k": args.k,
        "repeats": args.repeats,
        "whitespace": args.whitespace,
        "cases": {
            "file": Path(args.cases).name,
            "count": len(cases),
            "tokens": {c.name: len(ids[c.name]) for c in cases},
        },
        "libraries": info,
        "summary": summary,
        "summary_by_kind": by_kind,
        "mask_agreement": agree,
        "errors": errors,
        "rows": rows,
        "notes": "medians over cases of each case's median; masks on the CPU, one matcher, "
        "its thread; llguidance's draft call runs on the engine's LLExecutor (half the cores); "
        "xgrammar's compiler uses its default threads (max_threads=8) and no cache",
    }
    name = args.out or "grammar_backends_cpu" + (
        "_flexible" if args.whitespace == "flexible" else ""
    )
    path = write_result(name, result, args.out_dir)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
