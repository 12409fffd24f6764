"""N-gram lookup inside the speculative step (speculative/ngram_device.py, executor/
token_drafts.py): the device's drafts are the host lookup's (its drafts a prefix of them), the
token pool holds every computed token at its KV slot, and with async scheduling forced on the
CPU n-gram steps run ahead of their read while the output stays plain, greedy and seeded,
beside stops, arrivals and aborts."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.core import Request
from outrider.executor.token_drafts import TokenStepDrafter
from outrider.speculative.base import TokenDrafter
from outrider.speculative.ngram import DEVICE_WINDOW, NgramConfig, NgramProposer
from outrider.speculative.ngram_device import ngram_drafts_no_sync
from tests.interpreter import emit, run_worker
from tests.unit.test_async_speculation import _drive
from tests.unit.test_engine_tiny import prompts, reference, tiny_dir  # noqa: F401 (fixtures)


def _host(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    p = NgramProposer(NgramConfig(min_n=min_n, max_n=max_n, num_draft_tokens=k))
    req = Request(prompt_token_ids=tokens, params=SamplingParams(temperature=0))
    return list(p.propose([req], k)[0].token_ids)


def _window(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's last `width` tokens, right-aligned, and where they are real."""
    window = torch.full((len(rows), width), 7, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        n = min(len(row), width)
        window[i, width - n :] = torch.tensor(row[len(row) - n :])
        valid[i, width - n :] = True
    return window, valid


def test_the_lookup_drafts_what_the_host_lookup_drafts():
    rng = random.Random(0)
    hits = 0
    for _ in range(60):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        rows = [
            [rng.randrange(rng.randint(2, 9)) for _ in range(rng.randint(1, 40))] for _ in range(8)
        ]
        window, valid = _window(rows, 48)  # wider than every row: the whole sequence
        got = ngram_drafts_no_sync(window, valid, min_n, max_n, k).tolist()
        for row, drafts in zip(rows, got):
            want = _host(row, min_n, max_n, k)
            if want:  # the host's are cut at the sequence's end, the device's go on
                hits += 1
                assert drafts[: len(want)] == want, (row, min_n, max_n, k)
            else:  # nothing to draft from: the last token, k times
                assert drafts == [row[-1]] * k, (row, min_n, max_n, k)
    assert hits > 150


def _worker() -> None:  # runs in a subprocess, TRITON_INTERPRET=1
    """The one-launch lookup (layers/fused.py's ngram_drafts) against the torch ops, forced on
    the CPU: rows that match at several n, that match nothing, left-padded (invalid) rows,
    windows of 2 tokens, max_n past the window, k past the period."""
    from outrider.layers import fused

    gen = torch.Generator().manual_seed(5)
    cases = [
        (48, 1, 4, 4, 4),
        (48, 2, 3, 7, 3),
        (9, 1, 6, 5, 2),
        (2, 1, 2, 3, 5),
        (300, 1, 4, 4, 40),
    ]
    for width, min_n, max_n, k, vocab in cases:
        window = torch.randint(0, vocab, (6, width), generator=gen)
        valid = torch.ones(6, width, dtype=torch.bool)
        valid[1, : width // 2] = False  # a row shorter than the window
        valid[2, :-1] = False  # its last token alone
        window[3] = torch.arange(width) + 100  # nothing repeats
        fused.use_fused = lambda x: False
        want = ngram_drafts_no_sync(window, valid, min_n, max_n, k)
        fused.use_fused = lambda x: True
        got = fused.ngram_drafts(window, valid, min_n, max_n, k)
        emit(
            name=f"ngram-{width}-{min_n}-{max_n}-{k}",
            same=got is not None and torch.equal(got, want),
            found=int((want != window[:, -1:]).any(1).sum()),
        )


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_lookup_in_one_launch_drafts_what_the_torch_ops_draft():
    results = run_worker("tests.unit.test_ngram_device")
    assert len(results) == 5
    for r in results:
        assert r["same"], r
    assert sum(r["found"] for r in results) >= 10  # rows that found an occurrence


def test_drafts_past_the_end_repeat_the_period_and_a_narrow_window_sees_only_itself():
    tokens = [5, 1, 2, 3, 1, 2, 3, 1, 2]  # period 3: the host drafts [3, 1, 2], cut there
    window, valid = _window([tokens], 12)
    assert ngram_drafts_no_sync(window, valid, 1, 3, 7).tolist() == [[3, 1, 2, 3, 1, 2, 3]]
    # A window of the last 4 tokens: the only earlier (1, 2) in it is at its start.
    window, valid = _window([tokens], 4)
    assert ngram_drafts_no_sync(window, valid, 1, 3, 2).tolist() == [[3, 1]]
    assert _host(tokens[-4:], 1, 3, 2) == [3, 1]
    # No earlier occurrence in the window (the 5 before it is out of sight).
    window, valid = _window([[5, 6, 9, 5]], 2)
    assert ngram_drafts_no_sync(window, valid, 1, 2, 3).tolist() == [[5, 5, 5]]


def test_the_proposer_is_a_token_drafter_unless_the_shared_cache_is_on():
    p = NgramProposer(NgramConfig())
    assert isinstance(p, TokenDrafter) and p.token_window == DEVICE_WINDOW
    assert NgramProposer(NgramConfig(shared_cache=True)).token_window == 0
    with pytest.raises(ValueError, match="device_window=-1"):
        NgramConfig(device_window=-1)


def _ngram(tiny_dir, async_scheduling: bool, controller: str = "fixed", **options) -> LLM:  # noqa: F811
    options = {"num_blocks": 256, **options}
    return LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu",
        async_scheduling=async_scheduling,
        speculative={"method": "ngram", "controller": controller, "num_draft_tokens": 4},
        **options,
    )  # fmt: skip


@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
def test_ngram_steps_run_ahead_and_the_output_stays_plain(tiny_dir, prompts, controller):  # noqa: F811
    params = SamplingParams(temperature=0, max_tokens=40)
    sync = _ngram(tiny_dir, False, controller)
    assert sync.engine.runner.token_pool is None  # nothing runs ahead: the host drafts
    want = [o.token_ids for o in sync.generate(prompts, params)]
    llm = _ngram(tiny_dir, True, controller)
    engine = llm.engine
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    spec = engine.speculator
    if controller == "fixed":  # (the adaptive one's picks follow its timings)
        assert spec.stats.num_verify_steps > 20 and spec.stats.num_accepted_tokens > 0
        # Speculative steps ran ahead of their read, not only plain ones.
        assert engine.num_steps_run_ahead >= spec.steps_by_k[4] // 2 > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine._ahead is None


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_blocks": 20, "block_size": 8, "enable_prefix_caching": False},  # preemption
        {"num_blocks": 64, "block_size": 8},  # the second run's prompts hit cached blocks
        {"max_num_batched_tokens": 7},  # chunked prefill
    ],
)
def test_every_window_is_its_request_own_tokens(tiny_dir, prompts, monkeypatch, options):  # noqa: F811
    """What the step hands the lookup, row by row: the tokens of one request, up to its new
    last token, as the host has them at the end, whoever wrote them into the pool (a prompt
    chunk, a recompute after preemption, an earlier request whose cached blocks a prefix hit
    reuses). Rows of padding, and of requests that ended with the step before (their row
    kept, their blocks given back: TokenStepDrafter reads the scratch block there), hold no
    request's tokens; their drafts are never used."""
    seen: list[list[int]] = []
    owned: list[list[bool]] = []  # per call: whether each row has blocks of its own
    step, lookup = TokenStepDrafter.after_verify_no_sync, NgramProposer.draft_from_tokens_no_sync

    def spy_step(self, meta, next_ids, positions, aux, num_accepted, starts, tables, *rest):
        owned.append((tables[:, 0] != scratch).tolist())
        return step(self, meta, next_ids, positions, aux, num_accepted, starts, tables, *rest)

    def spy(self, tokens, valid, k):
        for row, ok, own in zip(tokens.tolist(), valid.tolist(), owned[-1]):
            if own:
                seen.append([t for t, v in zip(row, ok) if v])
        return lookup(self, tokens, valid, k)

    monkeypatch.setattr(TokenStepDrafter, "after_verify_no_sync", spy_step)
    monkeypatch.setattr(NgramProposer, "draft_from_tokens_no_sync", spy)
    llm = _ngram(tiny_dir, True, **options)
    scratch = llm.engine.runner.num_blocks
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    final = [o.prompt_token_ids + o.token_ids for o in llm.generate(prompts, params)]
    if options:  # again, the same prompts: prefix hits where blocks stay cached
        plain = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", **options)
        assert [o.prompt_token_ids + o.token_ids for o in plain.generate(prompts, params)] == final
        seen.clear()
        again = [o.prompt_token_ids + o.token_ids for o in llm.generate(prompts, params)]
        assert again == final
    assert len(seen) > 50
    for row in seen:
        # A request that ended in the step computed past its end: its tokens are a prefix.
        assert any(row[: len(f)] == f[: len(row)] for f in final), row
    engine = llm.engine
    if "enable_prefix_caching" in options:
        assert engine.scheduler.num_preemptions > 0
    if not options:
        return
    # A narrow window: 9 tokens of a request in a row (past its end for one that ended).
    seen.clear()
    llm.engine.speculator.use_proposer(NgramProposer(NgramConfig(device_window=8)))
    final = [o.prompt_token_ids + o.token_ids for o in llm.generate(prompts, params)]
    rows = [r for r in seen if len(r) == 9]
    assert len(rows) > 50
    for row in rows:
        assert any(row[: len(f) - i] == f[i : i + 9] for f in final for i in range(len(f))), row


def test_the_token_pool_holds_every_computed_token_at_its_slot(tiny_dir, prompts):  # noqa: F811
    llm = _ngram(tiny_dir, True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=40), request_id=f"r{i}")
    bs, checked = engine.runner.block_size, 0
    for _ in range(12):
        engine.step()
        pool = engine.runner.token_pool
        for req in engine.scheduler.running:
            n = req.num_computed_tokens
            pos = torch.arange(n)
            blocks = torch.tensor(req.block_ids)[pos // bs]
            assert pool[blocks * bs + pos % bs].tolist() == req.all_token_ids[:n]
            checked += n
    assert checked > 500


def test_stops_arrivals_aborts_and_sampled_rows_beside_ngram_steps_run_ahead(tiny_dir, prompts):  # noqa: F811
    for sampled in (False, True):
        want = _drive(_ngram(tiny_dir, False), prompts, sampled)
        llm = _ngram(tiny_dir, True)
        got = _drive(llm, prompts, sampled)
        a, b = sorted((got.pop("r1"), want.pop("r1")), key=len)  # aborted after a few calls
        assert a == b[: len(a)], sampled
        assert got == want, sampled
        assert llm.engine.num_steps_run_ahead > 0
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
