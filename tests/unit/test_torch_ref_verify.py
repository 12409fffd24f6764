"""The reference backend's batched verify (torch_ref._batched): sequences querying their last
rows, as many or fewer than the longest's (right-aligned, padded), chain or tree, give what the
per-sequence loop gives, and the backend takes it for such steps, not for prefill-sized ones."""

from __future__ import annotations

import pytest
import torch

from outrider.core import ForwardMode
from outrider.layers.attn_backends import torch_ref
from outrider.layers.forward_context import AttentionMetadata

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def _step(contexts: list[int], qlens: list[int], tree: bool, seed: int):
    """q, a K/V cache with each sequence's keys at scrambled pages, and the metadata of a step
    whose sequence b computes its last qlens[b] positions; a random tree mask over each
    sequence's last max(qlens) keys (each row sees itself) if tree."""
    g = torch.Generator().manual_seed(seed)
    pages = max(-(-c // BLOCK) for c in contexts)
    n_blocks = len(contexts) * pages + 1
    order = torch.randperm(len(contexts) * pages, generator=g) + 1  # block 0 unused
    tables = order.view(len(contexts), pages).to(torch.int32)
    k_cache = torch.randn(n_blocks, BLOCK, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(n_blocks, BLOCK, KV_HEADS, DIM, generator=g)
    q = torch.randn(sum(qlens), HEADS, DIM, generator=g)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    mask = None
    if tree:
        width = max(qlens)
        mask = torch.rand(sum(qlens), width, generator=g) < 0.5
        for b, n in enumerate(qlens):  # row t of a sequence sits at column width - n + t
            for t in range(n):
                mask[starts[b] + t, width - n + t] = True
    meta = AttentionMetadata(
        ForwardMode.VERIFY, torch.zeros(sum(qlens), dtype=torch.long),
        torch.tensor(starts, dtype=torch.int32), torch.tensor(contexts, dtype=torch.int32),
        tables, list(qlens), list(contexts), tree_mask=mask,
    )  # fmt: skip
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize(
    "contexts, qlens",
    [
        ([9, 30, 4, 17], [4, 4, 4, 4]),
        ([2, 13], [2, 2]),
        ([40], [5]),
        ([5, 5, 21], [5, 5, 5]),
        ([9, 30, 4, 17], [4, 1, 3, 4]),  # drafts cut, a row verifying none
        ([3, 12, 20], [1, 5, 2]),  # the first sequence's padding sees a key it does not own
    ],
)
def test_a_verify_in_one_call_equals_the_per_sequence_loop(contexts, qlens, tree):
    q, k, v, meta = _step(contexts, qlens, tree, seed=sum(contexts) + sum(qlens))
    scale = DIM**-0.5
    span = torch_ref._query_span(meta)
    assert span == max(qlens)
    got = torch_ref._batched(q, k, v, meta, scale, span)
    fresh = AttentionMetadata(**{**vars(meta), "backend_data": {}})
    want = torch_ref._per_sequence(q, k, v, fresh, scale)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "qlens, batched",
    [([3, 3, 3], True), ([3, 2, 3], True), ([1, 1], False), ([65, 1], False), ([64], True)],
)
def test_the_backend_batches_steps_without_a_prefill_sized_query(qlens, batched, monkeypatch):
    q, k, v, meta = _step([70] * len(qlens), qlens, tree=False, seed=1)
    calls = []
    for name in ("_batched", "_per_sequence", "_decode"):
        real = getattr(torch_ref, name)
        monkeypatch.setattr(
            torch_ref, name, lambda *a, name=name, real=real: calls.append(name) or real(*a)
        )
    cache = {"k": k, "v": v}
    torch_ref.TorchRefBackend().forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache, meta, 0.25)
    want = "_decode" if max(qlens) == 1 else "_batched" if batched else "_per_sequence"
    assert calls == [want]
