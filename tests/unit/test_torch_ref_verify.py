"""The reference backend's batched verify (torch_ref._uniform): every sequence querying the same
number of rows, chain or tree, gives what the per-sequence loop gives, and the backend takes
it exactly for such steps."""

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
    "contexts, qlen",
    [([9, 30, 4, 17], 4), ([2, 13], 2), ([40], 5), ([5, 5, 21], 5)],
)
def test_a_uniform_verify_equals_the_per_sequence_loop(contexts, qlen, tree):
    q, k, v, meta = _step(contexts, [qlen] * len(contexts), tree, seed=sum(contexts) + qlen)
    scale = DIM**-0.5
    assert torch_ref._uniform_len(meta) == qlen
    got = torch_ref._uniform(q, k, v, meta, scale, qlen)
    want = torch_ref._per_sequence(
        q, k, v, AttentionMetadata(**{**vars(meta), "backend_data": {}}), scale
    )
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "qlens, uniform",
    [([3, 3, 3], 3), ([3, 2, 3], 0), ([1, 1], 0), ([65, 65], 0), ([64], 64)],
)
def test_the_backend_batches_only_steps_of_one_query_length(qlens, uniform, monkeypatch):
    q, k, v, meta = _step([70] * len(qlens), qlens, tree=False, seed=1)
    calls = []
    for name in ("_uniform", "_per_sequence", "_decode"):
        real = getattr(torch_ref, name)
        monkeypatch.setattr(
            torch_ref, name, lambda *a, name=name, real=real: calls.append(name) or real(*a)
        )
    cache = {"k": k, "v": v}
    torch_ref.TorchRefBackend().forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache, meta, 0.25)
    want = "_decode" if max(qlens) == 1 else "_uniform" if uniform else "_per_sequence"
    assert calls == [want]
