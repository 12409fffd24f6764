"""The deterministic mode's Triton kernels on the CPU under Triton's interpreter: a row's bits
are the same alone and inside batches of other sizes.

- batch_invariant.matmul (every linear and the LM head on CUDA): row i of x @ W^T alone equals
  row i inside batches of 3, 17 and 70 rows, with K split and unsplit, with and without a
  bias; and the product is x @ W^T within rounding.
- the Triton backend built with deterministic=True: a query row at position p gives the same
  bits as a one-token decode (alone and beside other sequences), as a row of a chain verify,
  as a row of a prefill chunk and of a whole prefill; and matches the PyTorch reference.

`gemm_rows` and `attention_rows` take a device, so tests/gpu/test_deterministic_cuda.py runs
the same checks on CUDA. As in test_triton_attention.py, TRITON_INTERPRET=1 has to be set
before triton is imported, so the checks run in one worker subprocess (tests/interpreter.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.interpreter import emit, run_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
]


def gemm_rows(
    m_sizes: tuple[int, ...],
    n: int,
    k: int,
    dtype: torch.dtype,
    device: str,
    bias: bool,
    sms: int | None = None,
) -> dict:
    """Rows 0, M//2 and M-1 of the largest batch, computed alone and inside every batch of
    m_sizes that holds them: {"equal": all bitwise equal, "scaled": the largest error against
    x @ W^T in fp64 over the largest |value|, "splits": K splits used}."""
    from outrider.layers import batch_invariant

    g = torch.Generator().manual_seed(n * 31 + k)
    big = max(m_sizes)
    x = torch.randn(big, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    full = batch_invariant.matmul(x, w, b, sms=sms)
    equal = True
    for m in m_sizes:
        part = batch_invariant.matmul(x[:m].clone(), w, b, sms=sms)
        equal &= torch.equal(part, full[:m])
    for i in {0, big // 2, big - 1}:
        equal &= torch.equal(
            batch_invariant.matmul(x[i : i + 1].clone(), w, b, sms=sms), full[i : i + 1]
        )
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    scaled = ((full.double() - ref).abs().max() / ref.abs().max()).item()
    block_n, block_k = batch_invariant.gemm_config(dtype)[1:3]
    splits = batch_invariant.split_k(
        n, k, sms or batch_invariant.num_sms(x.device), block_n, block_k
    )[0]
    return {"equal": bool(equal), "scaled": scaled, "splits": splits}


def attention_rows(
    dtype: torch.dtype,
    device: str,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 32,
    context: int = 150,
    positions: tuple[int, ...] = (40, 97, 140),
    block_size: int = 16,
) -> dict:
    """One sequence A whose K/V sit at scrambled pages, and B, C beside it; query row q[p] at
    position p of A computed by the deterministic Triton backend as: a decode alone, a decode
    in a batch of 3, the middle row of a chain verify of 5 (batched with B's), a row of a
    40-token prefill chunk, a row of the whole prefill 0..p. -> {"equal": every form of every
    p bitwise equal to the lone decode, "scaled": the lone decode's largest error against the
    PyTorch reference over its largest |value|}."""
    from outrider.core import ForwardMode
    from outrider.layers.attn_backends.base import get_backend
    from outrider.layers.attn_backends.torch_ref import TorchRefBackend
    from outrider.layers.forward_context import AttentionMetadata

    g = torch.Generator().manual_seed(7)
    pages = -(-context // block_size) + 1
    num_blocks = 3 * pages + 1
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = order[: 3 * pages].view(3, pages).to(torch.int32).to(device)  # A, B, C
    qs = torch.randn(3, context, heads, head_dim, generator=g).to(dtype).to(device)
    ks = torch.randn(3, context, kv_heads, head_dim, generator=g).to(dtype).to(device)
    vs = torch.randn(3, context, kv_heads, head_dim, generator=g).to(dtype).to(device)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    cache = {"k": k_cache, "v": v_cache}
    backend = get_backend("triton", "cuda", deterministic=True)

    def run(backend, rows: list[tuple[int, int, int]], mode: ForwardMode) -> torch.Tensor:
        """rows: (sequence, first position, query length) -> out [tokens, heads, head_dim]."""
        q, k, v, slots, starts, lens = [], [], [], [], [0], []
        for s, first, n in rows:
            pos = torch.arange(first, first + n)
            q.append(qs[s, pos]), k.append(ks[s, pos]), v.append(vs[s, pos])
            page = tables[s].long().cpu()[pos // block_size]
            slots.append(page * block_size + pos % block_size)
            starts.append(starts[-1] + n)
            lens.append(first + n)
        meta = AttentionMetadata(
            mode, torch.cat(slots).to(device), torch.tensor(starts, dtype=torch.int32).to(device),
            torch.tensor(lens, dtype=torch.int32).to(device),
            tables[torch.tensor([s for s, _, _ in rows]).to(device)],
            [n for _, _, n in rows], lens,
        )  # fmt: skip
        backend.prepare(meta)
        return backend.forward(
            torch.cat(q), torch.cat(k), torch.cat(v), cache, meta, head_dim**-0.5
        )

    # Fill the caches: every position of A, B and C (a whole prefill each).
    for s in range(3):
        run(backend, [(s, 0, context)], ForwardMode.PREFILL)
    equal, scaled = True, 0.0
    for p in positions:
        alone = run(backend, [(0, p, 1)], ForwardMode.DECODE)[0]
        forms = [
            run(backend, [(1, 20, 1), (0, p, 1), (2, 130, 1)], ForwardMode.DECODE)[1],
            run(backend, [(1, 60, 5), (0, p - 2, 5)], ForwardMode.VERIFY)[5 + 2],
            run(backend, [(0, p - 30, 40)], ForwardMode.PREFILL)[30],
            run(backend, [(2, 0, 9), (0, 0, p + 1)], ForwardMode.PREFILL)[9 + p],
        ]
        equal &= all(torch.equal(f, alone) for f in forms)
        ref = run(TorchRefBackend(), [(0, p, 1)], ForwardMode.DECODE)[0].double()
        scaled = max(scaled, ((alone.double() - ref).abs().max() / ref.abs().max()).item())
    return {"equal": bool(equal), "scaled": scaled}


def _worker() -> None:  # runs in the subprocess, TRITON_INTERPRET=1
    from tests.unit.test_triton_attention import _patch_interpreter_index

    _patch_interpreter_index()  # numpy >= 2.4 against triton 3.6's interpreter: see there
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        # K 1100: ragged against BLOCK_K; sms 8 splits it (2 or more), sms 1 does not.
        for sms, bias in ((8, False), (8, True), (1, True)):
            out = gemm_rows((1, 3, 17, 70), 80, 1100, dtype, "cpu", bias, sms=sms)
            emit(name=f"gemm-{tag}-sms{sms}-bias{bias}", **out)
        emit(name=f"attention-{tag}", **attention_rows(dtype, "cpu"))


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return {r["name"]: r for r in run_worker("tests.unit.test_deterministic_kernels")}


# The largest error against the reference, over the largest |value|. None for bfloat16: numpy
# has no bfloat16 and the interpreter's bf16 dots come out as garbage (invariantly so), so the
# values are checked on a GPU (tests/gpu/test_deterministic_cuda.py) and float16 stands in here.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": None}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_gemm_rows_are_invariant(results, dtype):
    for sms, bias in ((8, False), (8, True), (1, True)):
        r = results[f"gemm-{dtype}-sms{sms}-bias{bias}"]
        assert r["equal"], r
        assert TOLERANCE[dtype] is None or r["scaled"] < TOLERANCE[dtype], r
        assert (r["splits"] > 1) == (sms == 8), r


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_attention_rows_are_invariant(results, dtype):
    r = results[f"attention-{dtype}"]
    assert r["equal"], r
    assert TOLERANCE[dtype] is None or r["scaled"] < TOLERANCE[dtype], r
