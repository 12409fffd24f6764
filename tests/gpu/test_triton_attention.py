"""The Triton attention kernels == TorchRefBackend on CUDA at speed-sized shapes (fp32 and bf16,
contexts to 32K, head_dim 64/128, GQA 1/4/8, batches to 64), plus a decode timing print.
The CPU suite (tests/unit/test_triton_attention.py) checks the same logic on small shapes."""

from __future__ import annotations

import random

import pytest
import torch

from tests.unit.test_triton_attention import build_case, compare

pytestmark = pytest.mark.gpu

# fp32 runs IEEE dot products (no TF32); bf16 rounds P before P @ V, as every fast kernel does.
TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


def _lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def _check(res: dict, dtype: torch.dtype) -> None:
    assert res["finite"], res
    assert res["max_err"] < TOL[dtype], res
    assert res["cache_err"] == 0.0, res
    assert res["padded_max"] == 0.0, res


DTYPES = [torch.float32, torch.bfloat16]
DT_IDS = ["fp32", "bf16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [
        ((8, 8), 128, 16),
        ((32, 8), 128, 16),
        ((64, 8), 128, 32),
        ((16, 4), 64, 16),
        ((32, 4), 64, 64),
    ],
    ids=["gqa1-d128", "gqa4-d128", "gqa8-d128-bs32", "gqa4-d64", "gqa8-d64-bs64"],
)
def test_decode_batch(dtype, heads, head_dim, block_size):
    # 64 sequences of 1..4K keys, two of them padded rows (seq_len 0).
    lens = _lens(64, 1, 4096, seed=1)
    lens[5] = lens[40] = 0
    case = build_case(lens, [1] * 64, *heads, head_dim, block_size, dtype=dtype, device="cuda")
    for num_splits in (None, 1, 7):
        _check(compare(case, num_splits), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_decode_long_context(dtype):
    lens = [1, 8191, 16384, 32768]
    case = build_case(lens, [1] * 4, 32, 8, 128, 16, dtype=dtype, device="cuda")
    res = compare(case)
    _check(res, dtype)
    assert res["splits"][0] > 1, res


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("heads, head_dim", [((32, 8), 128), ((16, 16), 64)], ids=["gqa4", "gqa1"])
def test_prefill_chunks(dtype, heads, head_dim):
    # A fresh 2K prompt, a 512-token chunk behind a 3K cached prefix, a 1-token decode, and a
    # chunk ending exactly on a page edge.
    case = build_case(
        [2048, 3584, 900, 4096], [2048, 512, 1, 1000], *heads, head_dim, 16, dtype=dtype,
        device="cuda",
    )  # fmt: skip
    _check(compare(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("k", [1, 4, 7])
def test_verify_chain(dtype, k):
    lens = _lens(32, k + 1, 8192, seed=k)
    lens[3] = 0  # a padded sequence
    case = build_case(lens, [1 + k] * 32, 32, 8, 128, 16, dtype=dtype, device="cuda")
    for num_splits in (None, 1, 4):
        _check(compare(case, num_splits), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_verify_long_context_splits(dtype):
    case = build_case([32768, 20000], [5, 5], 64, 8, 128, 16, dtype=dtype, device="cuda")
    res = compare(case)
    _check(res, dtype)
    assert res["splits"][0] > 1, res


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_tree_verify(dtype):
    # Top-k-like tree of 8 nodes on two sequences, a chain on a third, a decode on a fourth.
    tree = [-1, -1, -1, 0, 0, 1, 3, 3]
    case = build_case(
        [4100, 9, 700, 3000], [9, 9, 4, 1], 32, 8, 128, 16, trees={0: tree, 1: tree, 2: [-1, 0, 1]},
        dtype=dtype, device="cuda",
    )  # fmt: skip
    for num_splits in (None, 1, 3):
        _check(compare(case, num_splits), dtype)


def test_decode_timing(capsys):
    """Not an assertion: Llama-3.1-8B attention shape (32 heads, 8 KV heads, dim 128), bf16,
    per-layer forward (cache write + attention) of TritonBackend vs TorchRefBackend."""
    from outrider.layers.attn_backends.torch_ref import TorchRefBackend
    from outrider.layers.attn_backends.triton import TritonBackend

    rows = []
    for batch in (1, 32, 64):
        for ctx in (1024, 8192):
            case = build_case(
                [ctx] * batch, [1] * batch, 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda"
            )
            tri, meta = _time_forward(TritonBackend(), case)
            ref, _ = _time_forward(TorchRefBackend(), case)
            splits = next(iter(meta.backend_data["triton"].splits.values()))
            rows.append((batch, ctx, splits, tri, ref))
            del case, meta
            torch.cuda.empty_cache()
    with capsys.disabled():
        print("\ndecode attention, one layer, Llama-8B shape, bf16 (us)")
        print(
            f"{'batch':>6} {'ctx':>6} {'splits':>6} {'triton':>9} {'torch_ref':>10} {'speedup':>8}"
        )
        for batch, ctx, splits, tri, ref in rows:
            print(f"{batch:>6} {ctx:>6} {splits:>6} {tri:>9.1f} {ref:>10.1f} {ref / tri:>7.1f}x")


def _time_forward(backend, case, warmup: int = 3, iters: int = 20):
    """Mean microseconds of one backend.forward (its per-step prepare done once, as a model's
    layers share it), and the metadata it used."""
    meta = case.meta()
    backend.prepare(meta)
    cache = {"k": case.k_cache, "v": case.v_cache}
    for _ in range(warmup):
        backend.forward(case.q, case.k, case.v, cache, meta, 0.088)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        backend.forward(case.q, case.k, case.v, cache, meta, 0.088)
    end.record()
    torch.cuda.synchronize()  # CPU-GPU sync point (timing only)
    return start.elapsed_time(end) * 1000 / iters, meta
