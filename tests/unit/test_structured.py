"""Structured outputs: constraints compile (or are refused naming the field), masks equal the
grammar's, drafts are cut to what it allows, forced tokens ride as drafts, and through the whole
engine constrained output is valid and, greedy, the same token for token with speculation
(n-gram, EAGLE-3 chains and trees) as without; sampled rows keep the masked target's law."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.core import (
    ForwardMode,
    Request,
    ScheduledBatch,
    ScheduledSeq,
    SeqDrafts,
    StructuredOutputs,
)
from outrider.engine.structured import Grammars
from outrider.executor.sampler import (
    GRAMMAR_TOPK,
    apply_token_bitmask_,
    masked_argmax,
    token_bitmask,
    top_candidates,
)
from outrider.executor.verify_step import (
    masked_greedy_chain_no_sync,
    verify_chain_rows_no_sync,
)
from outrider.loaders.checkpoint import open_checkpoint
from tests.unit.test_engine_tiny import prompts, tiny_dir  # noqa: F401 (fixtures)
from tests.unit.test_spec_eagle3 import eagle_llm

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_grammars():
    ck = open_checkpoint(None)
    return Grammars(ck.tokenizer, ck.config.vocab_size), ck.tokenizer


def _allowed(mask_row: torch.Tensor) -> set[int]:
    bits = (mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)).flatten().tolist())


# -- constraints ----------------------------------------------------------------------------


def test_a_constraint_is_exactly_one_of_its_kinds():
    assert StructuredOutputs(json=PERSON).kind == "json"
    assert json.loads(StructuredOutputs(json=PERSON).json) == PERSON
    assert list(json.loads(StructuredOutputs(json=PERSON).json)["properties"]) == [
        "name",
        "age",
        "tags",
    ]  # fmt: skip  (key order is the output's)
    assert StructuredOutputs(choice=["x", "y"]).choice == ("x", "y")
    with pytest.raises(ValueError, match="exactly one of json"):
        StructuredOutputs(json=PERSON, regex="a+")
    with pytest.raises(ValueError, match="exactly one of json"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="unknown field.*guided_json"):
        SamplingParams(structured_outputs={"guided_json": PERSON})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"


@pytest.mark.parametrize(
    "spec,field",
    [
        ({"json": '{"type": "nonsense"}'}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "(abc"}, "structured_outputs.regex"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(default_grammars, spec, field):
    grammars, _ = default_grammars
    with pytest.raises(ValueError, match=re.escape(field)):
        grammars.compile(StructuredOutputs.of(spec))


def test_compiled_grammars_are_cached_by_their_text(default_grammars):
    grammars, _ = default_grammars
    a = grammars.compile(StructuredOutputs(json=PERSON))
    assert grammars.compile(StructuredOutputs(json=dict(PERSON))) is a
    assert grammars.compile(StructuredOutputs(json=PERSON, disable_any_whitespace=True)) is not a


def test_generate_flags_become_the_constraint(tmp_path):
    from outrider.cli import build_parser, structured_outputs

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(PERSON))

    def parse(*flags):
        return structured_outputs(build_parser().parse_args(["generate", *flags, "hi"]))

    assert parse() is None
    assert parse("--json-schema", str(schema)) == {"json": PERSON}
    assert parse("--json-schema", '{"type": "object"}') == {"json": {"type": "object"}}
    assert parse("--choice", "yes", "--choice", "no") == {"choice": ["yes", "no"]}
    with pytest.raises(SystemExit, match="--regex, --choice: give one"):
        parse("--regex", "a+", "--choice", "b")
    with pytest.raises(SystemExit, match="--json-schema .*missing.json.*readable file"):
        parse("--json-schema", str(tmp_path / "missing.json"))


# -- masks, drafts, forced tokens -------------------------------------------------------------


def _request(grammars: Grammars, spec: dict, rid: str) -> Request:
    so = StructuredOutputs.of(spec)
    req = Request([1, 2], SamplingParams(temperature=0, structured_outputs=so), request_id=rid)
    grammars.start(rid, so)
    return req


def test_each_rows_mask_is_what_the_grammar_allows_after_the_drafts_before_it(default_grammars):
    grammars, tok = default_grammars
    req = _request(grammars, {"choice": ["yes", "no way", "nope"]}, "mask-chain")
    drafts = tok.encode("no way")
    assert len(drafts) >= 2
    seq = ScheduledSeq(req, [5, *drafts], 2, [0], True, SeqDrafts.chain(drafts))
    plain = ScheduledSeq(req, [5], 2, [0], True)  # the same request, no drafts
    batch = ScheduledBatch(ForwardMode.VERIFY, [seq])
    grammars.attach_masks(batch)
    assert seq.token_masks.shape == (1 + len(drafts), grammars.words)
    assert batch.fill_masks is not None  # laid out; computed once the forward is queued
    batch.ready_masks()
    assert batch.fill_masks is None
    first = _allowed(seq.token_masks[0])
    assert drafts[0] in first and tok.encode("yes")[0] in first
    assert len(first) < 20  # the prefixes of three words, not the vocabulary
    for j in range(1, len(drafts)):
        assert drafts[j] in _allowed(seq.token_masks[j])
    assert _allowed(seq.token_masks[-1]) == set(tok.eos_token_ids)  # "no way" is complete
    batch = ScheduledBatch(ForwardMode.DECODE, [plain])
    grammars.attach_masks(batch)
    batch.ready_masks()
    assert torch.equal(plain.token_masks[0], seq.token_masks[0])  # the matcher rolled back
    grammars.forget("mask-chain")


def test_masks_are_computed_beside_the_caller_and_never_beside_a_matcher_move(default_grammars):
    """attach_masks hands the masks to a thread and returns; a call that moves a matcher before
    the runner waits for them (advance, here) waits first, so the masks are the state at
    attach_masks, not half of the next one."""
    import threading

    grammars, tok = default_grammars
    req = _request(grammars, {"regex": "[0-9]{3}-[a-z]+"}, "beside")
    seq = ScheduledSeq(req, [5], 2, [0], True)
    seen = []
    grammars._executor = _Spy(grammars._executor, lambda: seen.append(threading.get_ident()))
    try:
        batch = ScheduledBatch(ForwardMode.DECODE, [seq])
        grammars.attach_masks(batch)
        grammars.advance("beside", tok.encode("123"))  # before the runner's wait
        batch.ready_masks()
    finally:
        grammars._executor = grammars._executor.inner
    assert seen and seen[0] != threading.get_ident()  # computed in another thread
    digits = {t for t in _allowed(seq.token_masks[0]) if tok.decode([t]).isdigit()}
    assert digits and "-" not in {tok.decode([t]) for t in _allowed(seq.token_masks[0])}
    later = ScheduledBatch(ForwardMode.DECODE, [ScheduledSeq(req, [5], 5, [0], True)])
    grammars.attach_masks(later)
    later.ready_masks()  # after "123": the dash alone
    assert {tok.decode([t]) for t in _allowed(later.seqs[0].token_masks[0])} == {"-"}
    grammars.forget("beside")


class _Spy:
    """An llguidance executor that calls `hook` before each mask computation."""

    def __init__(self, inner, hook) -> None:
        self.inner, self._hook = inner, hook

    def unsafe_compute_mask_ptr(self, *args):
        self._hook()
        return self.inner.unsafe_compute_mask_ptr(*args)

    def unsafe_compute_mask_ptr_with_draft_token(self, *args):
        self._hook()
        return self.inner.unsafe_compute_mask_ptr_with_draft_token(*args)


def test_drafts_are_cut_where_the_grammar_refuses_them(default_grammars):
    grammars, tok = default_grammars
    _request(grammars, {"regex": "[0-9]{3}-[a-z]+"}, "cut")
    good, bad = tok.encode("123-"), tok.encode("!")
    kept = grammars.allowed_drafts("cut", SeqDrafts.chain(good + bad + good))
    assert kept.token_ids == good
    assert grammars.allowed_drafts("cut", SeqDrafts.chain(bad)) is None
    # a tree keeps the nodes whose whole path is allowed, renumbered
    tree = SeqDrafts([good[0], bad[0], bad[0], *good[1:2]], [-1, -1, 0, 0])
    pruned = grammars.allowed_drafts("cut", tree)
    if len(good) >= 2:
        assert pruned.token_ids == [good[0], good[1]] and pruned.parents == [-1, 0]
    else:
        assert pruned.token_ids == [good[0]] and pruned.parents == [-1]
    assert grammars.allowed_drafts("unconstrained", tree) is tree
    grammars.forget("cut")


def test_trees_side_by_side_get_each_nodes_mask_as_a_fresh_walk_would(default_grammars):
    """Two trees in one step, filled node by node in waves (each matcher walks back to the
    common ancestor between nodes): every row equals the mask of a fresh matcher fed the path
    to its node, and both matchers end where they began."""
    grammars, tok = default_grammars
    spec = {"choice": ["abc", "abd", "ax", "b"]}
    a, b, c, d, x = (tok.encode(ch)[0] for ch in "abcdx")
    trees = {
        "t1": SeqDrafts([b], [-1]),
        "t2": SeqDrafts([a, b, b, x, c, d], [-1, -1, 0, 0, 2, 2]),  # a, b, ab, ax, abc, abd
    }
    seqs = []
    for rid, drafts in trees.items():
        req = _request(grammars, spec, rid)
        seqs.append(ScheduledSeq(req, [5, *drafts.token_ids], 2, [0], True, drafts))
    batch = ScheduledBatch(ForwardMode.VERIFY, seqs)
    grammars.attach_masks(batch)
    batch.ready_masks()
    words = grammars.words
    for seq, drafts in zip(seqs, trees.values()):
        for row in range(1 + drafts.num_nodes):
            fresh = grammars.compile(StructuredOutputs.of(spec)).deep_copy()
            path, node = [], row - 1
            while node >= 0:
                path.insert(0, drafts.token_ids[node])
                node = drafts.parents[node]
            assert fresh.consume_tokens(path)
            want = torch.empty(words, dtype=torch.int32)
            fresh.unsafe_compute_mask_ptr(want.data_ptr(), words * 4)
            assert torch.equal(seq.token_masks[row], want), (seq.request.request_id, row)
    for rid in trees:  # back where they began: "a" and "b" still both allowed first
        assert grammars.allowed_drafts(rid, SeqDrafts.chain([a])) is not None
        assert grammars.allowed_drafts(rid, SeqDrafts.chain([b])) is not None
        grammars.forget(rid)


def test_tree_rows_are_masked_after_the_path_to_each_node(default_grammars):
    grammars, tok = default_grammars
    req = _request(grammars, {"choice": ["ab", "ac", "b"]}, "tree")
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    drafts = SeqDrafts([a, b, b], [-1, -1, 0])  # a, b, a->b
    seq = ScheduledSeq(req, [5, a, b, b], 2, [0], True, drafts)
    batch = ScheduledBatch(ForwardMode.VERIFY, [seq])
    grammars.attach_masks(batch)
    batch.ready_masks()
    rows = [_allowed(seq.token_masks[i]) for i in range(4)]
    assert {a, b} <= rows[0]
    assert b in rows[1] and tok.encode("c")[0] in rows[1]  # after "a": b or c
    assert rows[2] == set(tok.eos_token_ids) == rows[3]  # "b" and "ab" are complete
    grammars.forget("tree")


def test_a_cut_chain_goes_on_with_what_the_grammar_forces_there(default_grammars):
    grammars, tok = default_grammars
    _request(grammars, {"regex": "[0-9]{3}-abcdef"}, "cut")
    digits, bad = tok.encode("123"), tok.encode("!")
    rest = tok.encode("-abcdef")
    drafts, n = grammars.forced_drafts("cut", SeqDrafts.chain(digits + bad + digits), 16)
    assert drafts.token_ids[: len(digits)] == digits  # nothing forced before the cut
    assert tok.decode(drafts.token_ids) == "123-abcdef" and n == len(drafts.token_ids) - len(digits)
    short, m = grammars.forced_drafts("cut", SeqDrafts.chain(digits + bad), len(digits) + 1)
    assert len(short.token_ids) == len(digits) + 1 == m + len(digits)  # `limit` in all
    assert (
        tok.decode(short.token_ids[-1:])
        == tok.decode(rest)[: len(tok.decode(short.token_ids[-1:]))]
    )
    probs = torch.full((len(digits) + 1, 4), 0.25)  # sampled drafts are only cut
    cut, k = grammars.forced_drafts("cut", SeqDrafts.chain(digits + bad, probs), 16)
    assert cut.token_ids == digits and k == 0 and cut.draft_probs.shape[0] == len(digits)
    assert grammars.forced_drafts("cut", SeqDrafts.chain(bad), 16) == (None, 0)
    assert grammars.advance("cut", []) is False  # the matcher is where it was
    grammars.forget("cut")


def test_forced_tokens_lead_the_drafts_and_the_grammar_ends_the_run(default_grammars):
    grammars, tok = default_grammars
    _request(grammars, {"json": PERSON}, "forced")
    drafts, n = grammars.forced_drafts("forced", None, 8)
    assert n == len(drafts.token_ids) > 0
    assert tok.decode(drafts.token_ids).startswith('{"name')
    same, m = grammars.forced_drafts("forced", SeqDrafts.chain(drafts.token_ids), 8)
    assert m == n and same.token_ids == drafts.token_ids  # drafts that agree are kept
    cut, _ = grammars.forced_drafts("forced", SeqDrafts.chain(drafts.token_ids + [7]), 8)
    assert cut.token_ids[:n] == drafts.token_ids and 7 not in cut.token_ids[n:]  # refused
    _request(grammars, {"choice": ["yes"]}, "end")
    yes = tok.encode("yes")
    run = yes + [next(iter(tok.eos_token_ids)), 99]
    assert grammars.until_complete("end", run) == len(yes)
    assert grammars.advance("end", yes) is True
    for rid in ("forced", "end"):
        grammars.forget(rid)


def test_the_bitmask_refuses_exactly_the_zero_bits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    allowed = torch.rand(3, 70, generator=g) < 0.3
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    masked = apply_token_bitmask_(logits.clone(), words.to(torch.int32))
    assert torch.equal(masked.isfinite(), allowed)
    assert torch.equal(masked[allowed], logits[allowed])


def test_a_steps_masks_are_one_block_the_runner_takes_as_it_is(default_grammars):
    """Grammars lays a step's rows back to back in a buffer that alternates between steps: the
    runner's bitmask is that block itself where every row is constrained, and the masks the
    step before computed stay intact while the next step's are laid out."""
    grammars, tok = default_grammars
    reqs = [_request(grammars, {"choice": ["yes", "no way"]}, f"block-{i}") for i in range(3)]
    drafts = tok.encode("no way")
    seqs = [ScheduledSeq(reqs[0], [5, *drafts], 2, [0], True, SeqDrafts.chain(drafts))]
    seqs += [ScheduledSeq(r, [5], 2, [0], True) for r in reqs[1:]]
    batch = ScheduledBatch(ForwardMode.VERIFY, seqs)
    grammars.attach_masks(batch)
    batch.ready_masks()
    rows = [1 + len(drafts), 1, 1]
    block = token_bitmask(seqs, rows)
    assert block.data_ptr() == seqs[0].token_masks.data_ptr()
    assert torch.equal(block[-1], seqs[2].token_masks[0])
    first = seqs[1].token_masks[0].clone()
    later = ScheduledBatch(ForwardMode.DECODE, [ScheduledSeq(reqs[1], [5], 2, [0], True)])
    grammars.attach_masks(later)
    later.ready_masks()
    assert torch.equal(seqs[1].token_masks[0], first)  # the other buffer took this step
    padded = token_bitmask(seqs, [1 + len(drafts) + 1, 1, 1])  # a row past seq 0's own
    assert padded.data_ptr() != block.data_ptr() and (padded[len(drafts) + 1] == -1).all()
    for rid in (r.request_id for r in reqs):
        grammars.forget(rid)


def test_the_batch_bitmask_lays_rows_out_as_the_logits():
    req = Request([1], SamplingParams())
    free = ScheduledSeq(req, [1], 0, [0], True)
    bound = ScheduledSeq(req, [1, 2], 0, [0], True, SeqDrafts.chain([2]))
    bound.token_masks = torch.tensor([[5], [6]], dtype=torch.int32)
    assert token_bitmask([free, free], [1, 1]) is None
    out = token_bitmask([free, bound, free], [1, 3, 1])
    assert out[:, 0].tolist() == [-1, 5, 6, -1, -1]


def test_greedy_constrained_rows_accept_as_the_sampler_would_decide_them():
    """The one-launch path for greedy rows held to a grammar (the masked argmax, drafts counted
    while they equal it) decides what the sampler's path decides from the same masked logits:
    rows picked out of a larger verify, ties to the lowest token, padding drafts never
    counted, a draft the mask refuses rejected."""
    k, vocab = 3, 70
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4 * (1 + k), vocab, generator=g)
    logits[5, [5, 40]] = 9.0  # a tie among allowed tokens: the lower one wins
    allowed = torch.rand(4 * (1 + k), vocab, generator=g) < 0.4
    allowed[5, [5, 40]] = True
    allowed[13, logits[13].argmax()] = False  # the unmasked argmax refused
    words = torch.zeros(4 * (1 + k), 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    words = words.to(torch.int32)
    picked = [1, 3]  # two of the four sequences
    rows = torch.tensor([i * (1 + k) + j for i in picked for j in range(1 + k)])
    masked = apply_token_bitmask_(logits.clone(), words)
    best = masked.argmax(dim=-1).view(4, 1 + k)
    drafts = best[picked, :k].clone()  # every draft what the target picks ...
    drafts[1, 2] = (drafts[1, 2] + 1) % vocab  # ... but sequence 3's third
    num_drafts = torch.tensor([2, 3])  # sequence 1's third draft is padding
    tokens, accepted = masked_greedy_chain_no_sync(logits, rows, words[rows], drafts, num_drafts)
    params = SamplingParams(temperature=0.0)
    seqs = [ScheduledSeq(Request([1], params), [0] * (1 + k), 1, [0], True) for _ in picked]
    want_tokens, want_accepted = verify_chain_rows_no_sync(
        masked[rows], seqs, k, drafts, num_drafts
    )
    assert accepted.tolist() == want_accepted.tolist() == [2, 2]
    for f, a in enumerate(accepted.tolist()):
        assert tokens[f, : a + 1].tolist() == want_tokens[f, : a + 1].tolist()
    assert tokens[0, 1].item() == 5  # row 5: the tie
    assert bool(allowed[rows, tokens.reshape(-1)].all())


def test_a_greedy_row_picked_from_its_top_logits_is_its_masked_argmax(default_grammars):
    """Grammars.paths over a row's top GRAMMAR_TOPK logits gives the argmax among the tokens
    the grammar allows (the lowest of tied ones), and leaves to its mask (`decide`) the rows
    where they cannot tell it (none allowed, or a tie reaching the last one): at several
    points of a JSON object, for random rows, rows whose best tokens the grammar refuses, and
    tied rows, a request each."""
    grammars, tok = default_grammars
    g = torch.Generator().manual_seed(11)
    picked = fell_back = 0
    for n, prefix in enumerate(["", '{"name": "Al', '{"name": "Al", "age": 4']):
        ids = tok.encode(prefix) if prefix else []
        reqs = [_request(grammars, {"json": PERSON}, f"pick{n}-{r}") for r in range(14)]
        seqs = [ScheduledSeq(req, [5], 2, [0], True) for req in reqs]  # each its root row alone
        for req in reqs:
            grammars._matchers[req.request_id].consume_tokens(ids)
        batch = ScheduledBatch(ForwardMode.DECODE, seqs[:1])
        grammars.attach_masks(batch)
        batch.ready_masks()
        mask = seqs[0].token_masks[:1].clone()
        allowed_set = _allowed(mask[0])
        allowed = sorted(allowed_set)
        refused = [t for t in range(grammars.vocab_size) if t not in allowed_set][:64]
        rows = []
        for case in range(12):
            row = torch.randn(grammars.vocab_size, generator=g)
            if case % 3 == 1:  # the best tokens refused, an allowed one behind them
                row[refused[: GRAMMAR_TOPK // 2]] = 10.0
                row[allowed[case % len(allowed)]] = 9.0
            if case % 3 == 2:  # two allowed tokens tied at the top
                row[allowed[0]] = row[allowed[-1]] = 12.0
            rows.append(row)
        rows.append(torch.full((grammars.vocab_size,), 1.0))  # all tied: past the top ids
        rows.append(torch.zeros(grammars.vocab_size).index_fill_(0, torch.tensor(refused), 5.0))
        logits = torch.stack(rows)
        want = masked_argmax(logits, mask.expand(len(rows), -1))
        candidates = top_candidates(logits, list(range(len(rows))))
        late_rows = []

        def decide(late, masks, logits=logits, late_rows=late_rows, mask=mask):
            late_rows.extend(i for i, _ in late)
            assert torch.equal(masks, mask.expand(len(late), -1))
            return masked_argmax(logits[[i for i, _ in late]], masks)

        paths = grammars.paths(seqs, [[candidates[r]] for r in range(len(rows))], decide)
        assert [p for ((_, p),) in paths] == want, prefix
        fell_back += len(late_rows)
        picked += len(rows) - len(late_rows)
        for req in reqs:
            grammars.forget(req.request_id)
    assert picked >= 20 and fell_back >= 6  # both ways were taken


def test_a_row_whose_grammar_forces_bytes_takes_its_masks_one_token_without_a_mask(
    default_grammars,
):
    """Where the grammar forces bytes (the object's opening, a key's quote after a comma) its
    mask allows one token, the first of the forced text's tokens, and `paths` takes that token
    whatever the logits, with neither a mask nor `decide` (a read of the logits on the
    device); a row the grammar leaves free, and a forced row of a grammar that turns forcing
    off (whose mask allows other spellings: 't' and 'to' for a forced "todos"), still go to a
    late mask and `decide`."""
    grammars, tok = default_grammars
    prefixes = ["", '{"name": "Al",', '{"name": "Al", "age": 4']  # forced, forced, free
    specs = [{"json": PERSON}] * 3 + [
        {"grammar": '%llguidance {"no_forcing": true}\nstart: "todos" /[a-z]+/'}
    ]
    reqs = [_request(grammars, spec, f"forced{n}") for n, spec in enumerate(specs)]
    seqs = [ScheduledSeq(req, [5], 2, [0], True) for req in reqs]
    masks = []
    for req, prefix in zip(reqs, [*prefixes, ""]):
        grammars._matchers[req.request_id].consume_tokens(tok.encode(prefix) if prefix else [])
        masks.append(grammars._masks([grammars._matchers[req.request_id]])[0])
    masks = torch.stack(masks)
    assert [len(_allowed(m)) for m in masks[:2]] == [1, 1]
    assert len(_allowed(masks[2])) > 1 and len(_allowed(masks[3])) > 1
    assert grammars._matchers[reqs[3].request_id].compute_ff_bytes() == b"todos"
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(reqs), grammars.vocab_size, generator=g)
    for r, m in enumerate(masks):  # every row's best tokens refused
        refused = [t for t in range(200) if t not in _allowed(m)][:GRAMMAR_TOPK]
        logits[r, refused] = 10.0
    logits[3, sorted(_allowed(masks[3]))[-1]] = 9.0  # 'to' above 't', both allowed there
    want = masked_argmax(logits, masks)
    candidates = top_candidates(logits, list(range(len(reqs))))
    asked = []

    def decide(late, late_masks):
        asked.extend(i for i, _ in late)
        return masked_argmax(logits[[i for i, _ in late]], late_masks)

    before = dataclasses.replace(grammars.counters)
    paths = grammars.paths(seqs, [[candidates[r]] for r in range(len(reqs))], decide)
    assert [p for ((_, p),) in paths] == want
    assert tok.decode([want[3]]) == "to"
    assert asked == [2, 3]  # the free row and the unforced grammar's
    assert grammars.counters.forced_rows - before.forced_rows == 2
    assert grammars.counters.late_masks - before.late_masks == 2
    for req in reqs:
        grammars.forget(req.request_id)


def test_the_forced_token_is_the_masks_only_token_wherever_a_schema_forces_bytes(
    default_grammars,
):
    """What `_pick` relies on, along whole outputs of three schemas: at every position where
    the grammar forces bytes and has tokens for them (keys, quotes, braces), the mask allows
    exactly the first of those tokens. Where it forces bytes it has no tokens for, the mask
    allows more than one (a late mask decides)."""
    grammars, tok = default_grammars
    outputs = [
        ({"json": PERSON}, '{"name": "Al", "age": 41, "tags": ["a", "b"]}'),
        (
            {"json": {"type": "object", "properties": {"todos": {"type": "array", "items":
             {"type": "string"}}, "total": {"type": "integer"}}, "required": ["todos", "total"],
             "additionalProperties": False}},
            '{"todos": ["milk", "tea"], "total": 2}',
        ),
        ({"json_object": True}, '{"k": [1, 2.5, {"z": null}]}'),
    ]  # fmt: skip
    forced = 0
    for n, (spec, text) in enumerate(outputs):
        req = _request(grammars, spec, f"walk{n}")
        matcher = grammars._matchers[req.request_id]
        for token in tok.encode(text):
            ff_bytes, ff_tokens = matcher.compute_ff_bytes(), matcher.compute_ff_tokens()
            if ff_bytes:
                allowed = _allowed(grammars._masks([matcher])[0])
                if ff_tokens:
                    assert allowed == {ff_tokens[0]}, (text, ff_bytes)
                    forced += 1
                else:
                    assert len(allowed) > 1, (text, ff_bytes)
            assert matcher.consume_token(token), (text, tok.decode([token]))
        grammars.forget(req.request_id)
    assert forced >= 10


def test_picked_paths_follow_the_drafts_as_far_as_the_masked_targets_accept(
    default_grammars,
):
    """Grammars.paths over chains' verify rows gives, row by row, the masked argmax (each row's
    mask after the drafts before it) as far as the drafts equal it, and the first target no
    draft matched: a chain for every cut, with the cut row's top logits all refused (a late
    mask there) or not, all in one call, the late rows of a round decided together."""
    grammars, tok = default_grammars
    drafts = tok.encode('{"name": "Al')
    t = 1 + len(drafts)
    cuts = [(cut, refuse_top) for cut in range(t) for refuse_top in (False, True)]
    reqs = [_request(grammars, {"json": PERSON}, f"path{n}") for n in range(len(cuts))]
    seqs = [ScheduledSeq(r, [5, *drafts], 2, [0], True, SeqDrafts.chain(drafts)) for r in reqs]
    batch = ScheduledBatch(ForwardMode.VERIFY, seqs[:1])
    grammars.attach_masks(batch)
    batch.ready_masks()
    masks = seqs[0].token_masks.clone()  # every chain's: one grammar, one output so far
    g = torch.Generator().manual_seed(3)
    rows, wants, accepts = [], [], []
    for cut, refuse_top in cuts:
        logits = torch.randn(t, grammars.vocab_size, generator=g)
        logits[torch.arange(cut), drafts[:cut]] = 20.0  # the targets take drafts < cut
        if refuse_top:
            allowed = _allowed(masks[cut])
            refused = [x for x in range(grammars.vocab_size) if x not in allowed]
            logits[cut, refused[:GRAMMAR_TOPK]] = 30.0
        want = masked_argmax(logits, masks)
        accepted = 0
        while accepted < len(drafts) and want[accepted] == drafts[accepted]:
            accepted += 1
        rows.append(logits)
        wants.append(want)
        accepts.append(accepted)
    candidates = [list(top_candidates(x, list(range(t))).values()) for x in rows]
    calls = []

    def decide(late, late_masks):
        calls.append(late)
        return [
            masked_argmax(rows[i][row : row + 1], late_masks[n : n + 1])[0]
            for n, (i, row) in enumerate(late)
        ]

    before = dataclasses.replace(grammars.counters)
    got = grammars.paths(seqs, candidates, decide)
    for n, (path, want, accepted) in enumerate(zip(got, wants, accepts)):
        assert path == [(r, want[r]) for r in range(accepted + 1)], cuts[n]
    assert max(accepts) == len(drafts)  # a chain taken whole
    late = sum(len(c) for c in calls)
    counters = grammars.counters
    forced = counters.forced_rows - before.forced_rows  # the grammar's token: no mask, no decide
    assert late + forced >= t and len(calls) < late  # a late mask per refused cut, several a call
    assert forced >= 1
    # late masks: the rows `decide` read, and those their candidates then told
    assert counters.late_masks - before.late_masks >= late
    assert counters.picked_rows - before.picked_rows == sum(a + 1 for a in accepts)
    assert counters.path_s > before.path_s
    for req in reqs[:: len(reqs) - 1]:  # the matchers rolled back
        plain = ScheduledBatch(ForwardMode.DECODE, [ScheduledSeq(req, [5], 2, [0], True)])
        grammars.attach_masks(plain)
        plain.ready_masks()
        assert torch.equal(plain.seqs[0].token_masks[0], masks[0])
    for req in reqs:
        grammars.forget(req.request_id)


def test_plain_greedy_constrained_rows_take_no_mask_and_the_same_tokens(
    tiny_json_dir,
    prompts,  # noqa: F811
    monkeypatch,
):
    """A plain engine decides its greedy constrained rows from their top logits (no mask
    computed): token for token what the masks give, for the tiny model's four constraints."""
    params = _constrained([TINY_SPECS[i % len(TINY_SPECS)] for i in range(4)], max_tokens=30)
    llm = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256)
    counters = llm.engine.grammars.counters
    lazy = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params)]
    picked, masked_rows = counters.picked_rows, counters.mask_rows
    assert picked > 20 and masked_rows == 0
    attach = Grammars.attach_masks
    monkeypatch.setattr(Grammars, "attach_masks", lambda self, b, pick=False: attach(self, b))
    masked = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params)]
    assert counters.picked_rows == picked and counters.mask_rows > 20 and lazy == masked


def test_sampled_rows_keep_the_masked_targets_law():
    """Rows at temperature 1 verifying one draft: the first emitted token follows the softmax
    over the allowed tokens (chi-square), and never a refused one."""
    vocab, trials = 12, 6000
    g = torch.Generator().manual_seed(5)
    base = torch.randn(vocab, generator=g)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[1, 3, 4, 8, 10]] = True
    words = torch.zeros(1, dtype=torch.int64)
    for t in allowed.nonzero().flatten().tolist():
        words[0] |= 1 << t
    mask = words.to(torch.int32).view(1, 1).expand(trials * 2, 1)
    logits = apply_token_bitmask_(base.repeat(trials * 2, 1), mask.contiguous())
    params = SamplingParams(temperature=1.0)
    seqs = [ScheduledSeq(Request([1], params), [0, 3], 1, [0], True) for _ in range(trials)]
    torch.manual_seed(9)
    tokens, _ = verify_chain_rows_no_sync(
        logits, seqs, 1, torch.full((trials, 1), 3), torch.ones(trials, dtype=torch.long)
    )
    first = tokens[:, 0]
    assert bool(allowed[first].all())
    law = torch.softmax(base.masked_fill(~allowed, float("-inf")), 0)
    counts = torch.bincount(first, minlength=vocab).double()
    expected = law.double() * trials
    cells = allowed.nonzero().flatten()
    chi2 = ((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    df = torch.tensor((len(cells) - 1) / 2.0, dtype=torch.float64)
    assert float(torch.special.gammaincc(df, chi2 / 2)) > 1e-4, (counts, expected)


# -- through the engine ---------------------------------------------------------------------

TINY_SPECS = [
    {"json": PERSON},
    {"regex": "(fox|dog)( (quick|lazy))*"},
    {"choice": ["the quick", "brown fox", "lazy dog"]},
    {"grammar": 'start: "[" item ("," item)* "]"\nitem: /[a-z]{1,4}/'},
]


def _constrained(specs, temperature=0.0, max_tokens=40):
    return [
        SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=i, structured_outputs=spec
        )  # fmt: skip
        for i, spec in enumerate(specs)
    ]


@pytest.fixture(scope="module")
def tiny_json_dir(tiny_dir, tmp_path_factory):  # noqa: F811
    """The tiny random target with a byte-level tokenizer that has every byte (the shared tiny
    one lacks "{", so no JSON fits it) and its decoder."""
    import shutil

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tiny-json")
    for f in tiny_dir[0].iterdir():
        if f.name != "tokenizer.json":
            shutil.copy(f, path / f.name)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    text = ['{"name": "the fox", "age": 12, "tags": ["a", "b"]}', "the quick brown fox"]
    tok.train_from_iterator(text * 8, trainer)
    tok.save(str(path / "tokenizer.json"))
    return path, tiny_dir[1]


def _check_valid(spec: dict, text: str, finish: str) -> None:
    if finish != "stop":
        return  # cut at max_tokens: a prefix of a valid output, nothing more to check
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    elif "choice" in spec:
        assert text in spec["choice"], text
    else:
        assert re.fullmatch(r"\[[a-z]{1,4}(,[a-z]{1,4})*\]", text), text


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"},
        "eagle3_chain",
        "eagle3_tree",
    ],
    ids=["ngram", "eagle3_chain", "eagle3_tree"],
)
@pytest.mark.parametrize("decided", ["picked", "masked"])
def test_greedy_constrained_speculation_equals_constrained_plain(
    tiny_json_dir,
    prompts,  # noqa: F811
    speculative,
    decided,
    monkeypatch,
):
    """fp32 greedy, batches of 1 and of every prompt: token for token; every output that
    finished is valid. Verify rows decided on the host from their top logits (`picked`: more
    rows than grammar_steps.SPEC_MASKS_MAX_ROWS), or by their masks on the device (`masked`)."""
    from outrider.engine import grammar_steps as steps_module
    from outrider.executor.spec_step import SpecStep

    monkeypatch.setattr(steps_module, "SPEC_MASKS_MAX_ROWS", 0 if decided == "picked" else 999)

    tree_steps, run_tree = [], SpecStep.run_tree
    monkeypatch.setattr(
        SpecStep, "run_tree", lambda self, b: tree_steps.append(b) or run_tree(self, b)
    )
    paths, walk_paths = [], Grammars.paths

    def walk(self, seqs, candidates, decide):
        paths.extend((s.drafts is not None and s.drafts.num_nodes, s.token_masks) for s in seqs)
        return walk_paths(self, seqs, candidates, decide)

    monkeypatch.setattr(Grammars, "paths", walk)
    prompts = prompts[:5]
    specs = [TINY_SPECS[i % len(TINY_SPECS)] for i in range(len(prompts))]
    params = _constrained(specs, max_tokens=30)
    plain = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256)
    want = [o.outputs[0] for o in plain.generate(prompts, params)]
    alone = [plain.generate([prompts[1]], params[1])[0].outputs[0].token_ids]
    assert alone[0] == want[1].token_ids
    for spec, out in zip(specs, want):
        _check_valid(spec, out.text, out.finish_reason)
    if speculative == "eagle3_chain":
        llm = eagle_llm(tiny_json_dir)
    elif speculative == "eagle3_tree":
        llm = eagle_llm(tiny_json_dir, topk=2, num_steps=3)
    else:
        llm = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256,
                  speculative=speculative)  # fmt: skip
    paths.clear()
    masks_before = llm.engine.grammars.counters.mask_rows
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if decided == "picked":  # verify rows decided from their top logits, no mask for them
        assert any(drafted for drafted, _ in paths) and all(m is None for _, m in paths)
    else:  # every verify row's mask, none picked from top logits
        assert not any(drafted for drafted, _ in paths)
        assert llm.engine.grammars.counters.mask_rows - masks_before > len(prompts)
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert llm.generate([prompts[1]], params[1])[0].outputs[0].token_ids == alone[0]
    stats = llm.engine.speculator.stats
    assert stats.num_verify_steps > 0
    # chains draft what the grammar forces, trees where it refuses the whole tree
    assert stats.num_forced_drafts > 0
    if speculative == "eagle3_tree":  # constrained trees verify in the tree step
        assert tree_steps, "constrained greedy trees left the tree step"
    assert not llm.engine.grammars  # every finished request's matcher is gone


def test_grammar_drafts_can_be_turned_off_and_output_stays(tiny_json_dir, prompts):  # noqa: F811
    specs = [TINY_SPECS[0]] * 3
    params = _constrained(specs, max_tokens=30)
    outs, stats = [], []
    for forced in (True, False):
        spec = {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed",
                "grammar_drafts": forced}  # fmt: skip
        llm = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256,
                  speculative=spec)  # fmt: skip
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts[:3], params)])
        stats.append(llm.engine.speculator.stats)
    assert outs[0] == outs[1]
    assert stats[0].num_forced_drafts > 0 and stats[1].num_forced_drafts == 0
    assert stats[0].num_accepted_tokens > stats[1].num_accepted_tokens


def test_a_plain_engine_takes_forced_runs_at_once_with_the_same_output(
    tiny_json_dir,
    prompts,  # noqa: F811
):
    """A plain engine emits the tokens a grammar forces (keys, quotes, brackets, a choice's
    rest) as soon as they are forced and computes them in the next forward: fewer steps, and
    the same output as one token a step (grammar_drafts off), greedy and seeded sampling (its
    noise is keyed by output position, so skipped draws change nothing); a run cut by
    max_tokens ends the output there; a request asking for logprobs takes none."""
    specs = TINY_SPECS * 2
    runs, llms = {}, {}
    for jumps in (True, False):
        llm = llms[jumps] = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu",
                                num_blocks=256, speculative={"grammar_drafts": jumps})  # fmt: skip
        got = {}
        for temperature in (0.0, 0.8):
            c0 = llm.engine.grammars.counters.jumped
            steps = sum(n for _, n, *_ in llm.engine.ledger.snapshot())
            outs = llm.generate(prompts[: len(specs)], _constrained(specs, temperature))
            got[temperature] = [o.outputs[0].token_ids for o in outs]
            got[temperature, "steps"] = sum(n for _, n, *_ in llm.engine.ledger.snapshot()) - steps
            got[temperature, "jumped"] = llm.engine.grammars.counters.jumped - c0
        short = _constrained(specs[:1], max_tokens=3)  # inside the object's first key
        got["short"] = llm.generate(prompts[:1], short)[0].outputs[0]
        c0 = llm.engine.grammars.counters.jumped
        asked = [dataclasses.replace(p, logprobs=1) for p in _constrained(specs[:1])]
        got["logprobs"] = llm.generate(prompts[:1], asked)[0].outputs[0].token_ids
        got["logprobs", "jumped"] = llm.engine.grammars.counters.jumped - c0
        runs[jumps] = got
    on, off = runs[True], runs[False]
    for temperature in (0.0, 0.8):
        assert on[temperature] == off[temperature]
        assert on[temperature, "jumped"] > 10 and off[temperature, "jumped"] == 0
        assert on[temperature, "steps"] < off[temperature, "steps"]
    assert on["short"].token_ids == off["short"].token_ids and len(on["short"].token_ids) == 3
    assert on["short"].finish_reason == off["short"].finish_reason == "length"
    assert on["logprobs"] == off["logprobs"] == on[0.0][0] and on["logprobs", "jumped"] == 0
    # Admission: what the grammar forces first is output before any step and leads the first
    # delta; a run that would end the output leaves its last token to a step to sample.
    engine = llms[True].engine
    for spec, text in (({"json": PERSON}, None), ({"choice": ["brown fox"]}, "brown fox")):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
        req = engine.add_request(prompts[0], params)
        forced = list(req.output_token_ids)
        left = engine.grammars.forced_tokens(req.request_id)
        assert len(forced) > 1 and len(left) == (text is not None)  # a choice: its last token
        deltas = []
        while not req.is_finished:
            deltas += [d for d in engine.step() if d.request_id == req.request_id]
        assert deltas[0].token_ids[: len(forced)] == forced
        assert [t for d in deltas for t in d.token_ids] == req.output_token_ids
        if text is not None:
            assert "".join(d.text for d in deltas) == text and len(deltas) == 1
    # Run ahead (async scheduling): a row inside a forced run computes the rest of the run in
    # the step launched before the run's first token is read (overlap.next_batch's forced_run
    # rows), so steps keep running ahead and runs are still taken at once: the same tokens, and
    # fewer steps than one forced token a step run ahead.
    wide = TINY_SPECS * 2  # 8 rows
    ahead = {}
    for jumps in (True, False):
        llm = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256,
                  async_scheduling=True, speculative={"grammar_drafts": jumps})  # fmt: skip
        outs = llm.generate(prompts[: len(wide)], _constrained(wide))
        engine = llm.engine
        ahead[jumps] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "steps": sum(n for _, n, *_ in engine.ledger.snapshot()),
            "ahead": engine.num_steps_run_ahead,
            "jumped": engine.grammars.counters.jumped,
        }
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # Blocks of 2 positions in a pool of few: a run reaches into blocks past the read's tokens,
    # which the read keeps (postprocess's hold); were they trimmed, other rows would take them
    # and the run's KV would land in theirs.
    llm = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", block_size=2, num_blocks=72,
              async_scheduling=True)  # fmt: skip
    outs = llm.generate(prompts[: len(wide)], _constrained(wide))
    assert [o.outputs[0].token_ids for o in outs] == on[0.0]
    assert llm.engine.grammars.counters.jumped > 10
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert ahead[True]["tokens"] == ahead[False]["tokens"] == on[0.0]
    # (A run that starts after a token the model chose is known only once that token is read:
    # the step launched before then samples the run's first token, and the run rides in the
    # step after. Stepped one at a time, the whole run is taken after the chosen token.)
    assert ahead[True]["jumped"] > 10 and ahead[False]["jumped"] == 0
    assert ahead[True]["steps"] < ahead[False]["steps"]
    assert ahead[True]["ahead"] > ahead[True]["steps"] // 2


def test_sampled_constrained_output_is_valid_with_speculation(tiny_json_dir, prompts):  # noqa: F811
    specs = [TINY_SPECS[i % len(TINY_SPECS)] for i in range(len(prompts))]
    llm = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256,
              speculative={"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"})  # fmt: skip
    outs = llm.generate(prompts, _constrained(specs, temperature=0.8, max_tokens=60))
    finished = 0
    for spec, o in zip(specs, outs):
        _check_valid(spec, o.outputs[0].text, o.outputs[0].finish_reason)
        finished += o.outputs[0].finish_reason == "stop"
    assert finished >= len(specs) // 2


def test_a_bad_constraint_is_refused_before_the_engine_changes(tiny_json_dir, prompts):  # noqa: F811
    llm = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=64)
    bad = SamplingParams(structured_outputs={"regex": "(unclosed"})
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.engine.add_request(prompts[0], bad)
    assert not llm.engine.has_unfinished() and not llm.engine.grammars
    out = llm.generate([prompts[0]], _constrained([TINY_SPECS[2]])[0])[0].outputs[0]
    assert out.text in TINY_SPECS[2]["choice"] and out.finish_reason == "stop"


@pytest.mark.slow
def test_the_default_model_writes_valid_json_for_its_schema():
    """A real model: every constrained chat answer parses and validates, plain and with
    EAGLE-3, greedy and sampled, and the grammar finishes each request."""
    convs = [
        [{"role": "user", "content": "Give the name and age of a fictional person as JSON."}],
        [{"role": "user", "content": "Invent a character with a name, an age and tags."}],
    ]
    for spec in (None, {"method": "eagle3", "num_draft_tokens": 4}):
        llm = LLM(device="cpu", dtype="float32", speculative=spec)
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, max_tokens=120, seed=1,
                                    structured_outputs={"json": PERSON})  # fmt: skip
            for r in llm.chat(convs, params):
                out = r.outputs[0]
                assert out.finish_reason == "stop", out.text
                jsonschema.validate(json.loads(out.text), PERSON)


def test_the_default_models_greedy_constrained_output_is_the_same_run_ahead():
    """A real model on schemas whose keys the grammar forces: greedy constrained requests
    stepped one at a time, run ahead (async forced on), asking for logprobs (each row then
    masked whole before its argmax), and taking forced runs one token a step instead of at once
    (grammar_drafts off), give the same tokens. After `{"` on a schema whose key must be
    "todos", llguidance's validate_tokens accepts 'to' where its mask allows only 't': a row
    decided by validate_tokens in one path and by the mask in another would fork there (the
    tiny model's grammars never meet such a spot)."""
    from tests.benchmarks import load_benchmark

    cases_mod = load_benchmark("structured_cases.py")
    cases = {c.name: c for c in cases_mod.load_cases(cases_mod.CASES)}
    picked = [cases[n] for n in ("todo_list", "order", "weather_report")]
    convs = [[{"role": "user", "content": c.prompt}] for c in picked]
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=c.structured_outputs())
        for c in picked
    ]
    outs = {}
    for async_scheduling, jumps in ((False, True), (True, False), (True, True)):
        llm = LLM(device="cpu", dtype="float32", async_scheduling=async_scheduling,
                  speculative={"grammar_drafts": jumps})  # fmt: skip
        key = (async_scheduling, jumps)
        outs[key] = [r.outputs[0].token_ids for r in llm.chat(convs, params)]
        jumped = llm.engine.grammars.counters.jumped
        assert (jumped > 20) if jumps else (jumped == 0)
        if async_scheduling:
            assert llm.engine.num_steps_run_ahead > (5 if jumps else 20)
        else:
            masked = [dataclasses.replace(p, logprobs=1) for p in params]
            outs["logprobs"] = [r.outputs[0].token_ids for r in llm.chat(convs, masked)]
    assert outs[False, True] == outs[True, False] == outs[True, True] == outs["logprobs"]


def test_drafts_verified_are_ones_the_grammar_allows_after_the_output(
    tiny_json_dir,
    prompts,  # noqa: F811
    monkeypatch,
):
    """The drafts a device drafter makes inside a step are cut to (and led by) what the grammar
    allows after that step's tokens: every constrained chain verified is allowed whole from the
    request's output so far (cut against the grammar before it had seen the step's tokens,
    they were refused or stale forced runs)."""
    refused, seen = [], []
    attach = Grammars.attach_masks

    def check(self, batch, pick=False):
        for s in batch.seqs:
            rid = s.request.request_id
            if rid in self and s.drafts is not None and s.drafts.num_nodes:
                tokens = list(s.drafts.token_ids)
                seen.append(rid)
                if self._matchers[rid].validate_tokens(tokens) < len(tokens):
                    refused.append((rid, tokens))
        return attach(self, batch, pick)

    monkeypatch.setattr(Grammars, "attach_masks", check)
    specs = [TINY_SPECS[i % len(TINY_SPECS)] for i in range(4)]
    llm = eagle_llm(tiny_json_dir)
    llm.generate(prompts[:4], _constrained(specs, max_tokens=30))
    assert len(seen) > 4 and not refused, refused[:3]


@pytest.mark.parametrize(
    "kind", ["plain", "eagle3_guarded", "eagle3_always", "plain_masked", "eagle3_masked"]
)
def test_greedy_constrained_rows_run_ahead_on_a_guess_and_give_the_same_tokens(
    tiny_json_dir,
    prompts,  # noqa: F811
    kind,
    monkeypatch,
):
    """Async scheduling forced on (the CPU): greedy constrained rows run ahead on their
    unmasked argmax, and where a grammar refuses it the grammar's pick is taken and the refused
    row alone is computed again by the step after (plain: overlap.Ahead.redo), or, beside a
    drafter's aux streams (EAGLE-3, its controller choosing k=0 throughout), the step run
    ahead is dropped whole: the same tokens as one step at a time, batched and alone, a mix of
    constrained and unconstrained rows included, rows whose request ended in the step before
    (their grammar gone) left alone, and every block back. "always": run ahead beside the aux
    streams whatever the refusal rate (every drop path taken); "guarded": the engine's odds.
    "_masked": as the engine runs so few rows (MASKS_AHEAD_MAX_ROWS), no guess at all: their
    masked argmax is taken on the device before the step after is launched on them, so
    nothing is redone or dropped, beside aux streams too."""
    from outrider.engine import grammar_steps as steps_module
    from tests.unit.test_spec_eagle3 import _ScriptedController

    masked = kind.endswith("_masked")
    if not masked:  # every step guesses
        monkeypatch.setattr(steps_module, "MASKS_AHEAD_MAX_ROWS", 0)
    if kind == "eagle3_always":
        monkeypatch.setattr(steps_module, "AHEAD_GRAMMAR_ODDS", 0.0)
    specs = [TINY_SPECS[i % len(TINY_SPECS)] for i in range(4)]
    # Some end mid-run, with a step run ahead of them.
    ends = (7, 30, 13, 30)
    params = [dataclasses.replace(p, max_tokens=n) for p, n in zip(_constrained(specs), ends)]
    params.append(SamplingParams(temperature=0, max_tokens=48))
    batch = prompts[:5]

    def llm(async_scheduling: bool) -> LLM:
        if kind.startswith("plain") or not async_scheduling:
            return LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256,
                       async_scheduling=async_scheduling)  # fmt: skip
        out = eagle_llm(tiny_json_dir, async_scheduling=True)
        out.engine.speculator.controller = _ScriptedController([0] * 100_000)
        return out

    sync = llm(False)
    want = [o.outputs[0] for o in sync.generate(batch, params)]
    ahead = llm(True)
    got = [o.outputs[0] for o in ahead.generate(batch, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for spec, out in zip(specs, got):
        _check_valid(spec, out.text, out.finish_reason)
    engine = ahead.engine
    counters = engine.grammars.counters
    if masked:  # nothing guessed, nothing redone or dropped
        assert engine.num_steps_run_ahead >= 20 and counters.masked_ahead >= 20
        assert engine.num_rows_run_ahead_redone == engine.num_steps_run_ahead_dropped == 0
        # (steps not run ahead, after a prompt's, still pick from their top logits)
        assert counters.masked_ahead > 2 * counters.picked_rows
    # The tiny random model's argmax is mostly refused: without aux streams the batch runs
    # ahead and redoes the refused rows; beside them, guarded, it stops guessing after its
    # first steps (the unconstrained row runs ahead alone at the end); always, it drops steps.
    else:
        assert engine.grammar_steps.miss > 0.3 and counters.masked_ahead == 0
    assert engine.num_steps_run_ahead > 0
    if kind == "plain":
        assert engine.num_rows_run_ahead_redone > 5
        assert engine.num_steps_run_ahead_dropped == 0
        assert engine.num_steps_run_ahead >= 20
    elif kind == "eagle3_always":
        assert engine.num_steps_run_ahead_dropped > 5
        assert engine.num_rows_run_ahead_redone == 0
    else:
        assert engine.num_steps_run_ahead_dropped <= 2
    for i in (0, 3):
        alone = ahead.generate([batch[i]], params[i])[0].outputs[0].token_ids
        assert alone == want[i].token_ids
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("masks_ahead", [0, 16])
def test_a_constrained_row_whose_request_ended_is_left_out_of_the_grammars_picks(
    tiny_json_dir,
    prompts,  # noqa: F811
    monkeypatch,
    masks_ahead,
):
    """Run ahead whatever the refusals, on a grammar that allows nearly every argmax: the
    requests that reach max_tokens end while a step run ahead holds their rows; that step's
    read leaves their rows alone (their grammars are gone: picked from their top logits, or,
    masked on the device, masked by nothing) and the others keep going. The masked argmax
    the engine queues itself runs with autograd off, where the fused kernel serves it."""
    from outrider.engine import grammar_steps as steps_module

    monkeypatch.setattr(steps_module, "AHEAD_GRAMMAR_ODDS", 0.0)
    monkeypatch.setattr(steps_module, "MASKS_AHEAD_MAX_ROWS", masks_ahead)
    grad_on = []  # torch.is_grad_enabled() at each of the engine's masked argmaxes
    argmax = steps_module.masked_argmax_no_sync

    def spy(*args):
        grad_on.append(torch.is_grad_enabled())
        return argmax(*args)

    monkeypatch.setattr(steps_module, "masked_argmax_no_sync", spy)
    anything = {"regex": "[\\s\\S]*"}
    params = [
        SamplingParams(temperature=0, max_tokens=n, structured_outputs=anything)
        for n in (3, 9, 5, 16)
    ]

    def run(async_scheduling: bool):
        llm = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256,
                  async_scheduling=async_scheduling)  # fmt: skip
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params)]

    _, want = run(False)
    llm, got = run(True)
    assert got == want and [len(t) for t in got] == [3, 9, 5, 16]
    engine = llm.engine
    assert engine.num_steps_run_ahead >= 10
    assert (engine.grammars.counters.masked_ahead > 0) == bool(masks_ahead)
    assert bool(grad_on) == bool(masks_ahead) and not any(grad_on)
    assert not engine.grammars and engine._ahead is None
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
