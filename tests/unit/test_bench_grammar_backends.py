"""benchmarks/grammar_backends.py's parts, on llguidance (outrider's dependency; xgrammar is not
installed beside outrider, so its side runs only in the benchmark): a walk along an example
with the default model's tokenizer, the draft masks the library's call computes against those
computed by hand, the per-case rows and summary, and the footprint it records."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks import load_benchmark

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("grammar_backends.py")


@pytest.fixture(scope="module")
def llg(bench):
    from outrider.loaders.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    eos = list(ck.tokenizer.eos_token_ids)
    return bench.Llguidance(ck.tokenizer.backend, ck.config.vocab_size, eos), ck, eos


@pytest.fixture(scope="module")
def cases():
    return {c.name: c for c in load_benchmark("structured_cases.py").load_cases()}


def _ids(ck, eos, case):
    return ck.tokenizer.backend.encode(case.example, add_special_tokens=False).ids + eos[:1]


def test_walk_times_every_position_and_ends_the_grammar(bench, llg, cases):
    lib, ck, eos = llg
    case = cases["person"]
    ids = _ids(ck, eos, case)
    out = bench.walk(lib, case, ids, k=4)
    assert len(out["consume_us"]) == len(ids) == len(out["masks"])
    assert len(out["mask_us"]) == len(ids) - 1  # the first mask is counted apart
    # a root and 4 tokens of the example ahead (never EOS): positions 1 .. len - 5
    assert len(out["draft_mask_us"]) == len(out["draft_loop_us"]) == len(ids) - 5
    assert out["compile_s"] > 0 and out["first_mask_us"] > 0
    # The last mask, after the closing brace, allows EOS and nothing else.
    assert bench.popcount(out["masks"][-1]) == 1
    row = bench.case_row([out, out])
    assert row["positions"] == len(ids) and row["compile_ms_runs"] == [row["compile_ms"]] * 2
    ready = row["compile_ms"] + row["first_mask_us"] / 1e3
    assert row["ready_ms"] == pytest.approx(ready, abs=2e-3)  # from the unrounded parts


def test_json_is_spelled_as_the_engine_spells_it_unless_flexible(bench, llg, cases):
    lib, ck, eos = llg
    flexible = bench.Llguidance(ck.tokenizer.backend, ck.config.vocab_size, eos, "flexible")
    case = cases["person"]
    compact = ck.tokenizer.backend.encode('{"name":"Al","age":3,"city":"X"}').ids + eos[:1]
    with pytest.raises(ValueError, match="refused token"):
        bench.walk(lib, case, compact, k=2)  # the engine writes ", " and ": " only
    assert bench.walk(flexible, case, compact, k=2)["consume_us"]
    assert bench.walk(lib, case, _ids(ck, eos, case), k=2)["consume_us"]


def test_a_wrong_example_is_refused_by_name(bench, llg, cases):
    lib, ck, eos = llg
    case = cases["us_zip"]
    bad = ck.tokenizer.backend.encode("ab", add_special_tokens=False).ids + eos[:1]
    with pytest.raises(ValueError, match="llguidance refused token 0 .* of us_zip's example"):
        bench.walk(lib, case, bad, k=2)
    short = _ids(ck, eos, case)[:-2] + eos[:1]  # "100" then EOS: not five digits
    with pytest.raises(ValueError, match="refused token"):
        bench.walk(lib, case, short, k=2)


def test_the_draft_call_computes_the_masks_done_by_hand(bench, llg, cases):
    lib, ck, eos = llg
    case = cases["tool_book_flight"]
    ids, k, p = _ids(ck, eos, case), 4, 6
    matcher = lib.compile(case)
    for t in ids[:p]:
        assert lib.consume(matcher, t)
    fast, slow = lib.alloc(1 + k), lib.alloc(1 + k)
    lib.draft(matcher, ids[p - 1], ids[p : p + k], fast)
    for i, t in enumerate(ids[p : p + k]):
        lib.fill(matcher, slow, i)
        lib.consume(matcher, t)
    lib.fill(matcher, slow, k)
    lib.rollback(matcher, k)
    assert torch.equal(fast, slow)
    assert lib.consume(matcher, ids[p])  # both left the matcher where it was


def test_agreement_and_summary(bench):
    a = [torch.tensor([-1, 0], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)]
    b = [torch.tensor([-1, 0], dtype=torch.int32), torch.tensor([7, 0], dtype=torch.int32)]
    assert bench.agreement(a, a) == {"equal_fraction": 1.0, "max_allowed_diff": 0}
    assert bench.agreement(a, b) == {"equal_fraction": 0.5, "max_allowed_diff": 2}
    rows = {"lib": {"x": {"compile_ms": 1.0, "mask_us": 10.0}, "y": {"compile_ms": 3.0,
                                                                    "mask_us": None}}}  # fmt: skip
    out = bench.summarize(rows)["lib"]
    assert out["compile_ms"] == 2.0 and out["mask_us"] == 10.0 and out["cases"] == 2
    assert out["draft_mask_us"] is None


def test_footprint_of_llguidance_has_no_dependencies(bench, tmp_path):
    (tmp_path / "llguidance-1.0-cp39-abi3-any.whl").write_bytes(b"x" * 2**20)
    out = bench.footprint("llguidance", None, str(tmp_path))
    assert out["requires"] == {} and out["wheel_mb"] == 1.0
    assert out["installed_mb"] > 1 and out["installed_with_requires_mb"] == out["installed_mb"]
    assert bench.footprint("no-such-library", None, None) == {"installed": False}
    jinja = bench.footprint("jinja2", None, None)["requires"]
    assert set(jinja) == {"MarkupSafe"} and jinja["MarkupSafe"]["installed_mb"] is not None
