"""The Triton attention kernels' logic on the CPU, under Triton's interpreter, against
TorchRefBackend: decode (split-K, GQA), prefill over a cached prefix, chain and tree VERIFY.

TRITON_INTERPRET=1 must be set before `triton` itself is imported (its standard library,
tl.zeros and tl.cdiv included, is decorated at import), and it would change every later kernel
in the process. So the checks run in one worker subprocess per module, started with the
variable set and fed case descriptions as JSON lines; nothing leaks into other test modules,
whichever imported triton first. tests/gpu/test_triton_attention.py reuses `build_case` and
`compare` on CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from outrider.core import ForwardMode
from outrider.layers.attn_backends.torch_ref import TorchRefBackend
from outrider.layers.forward_context import AttentionMetadata
from outrider.speculative.tree import TreeTopology, verify_mask

ROOT = Path(__file__).resolve().parents[2]
_RESULT = "@@triton-attention-result "
TOL = 1e-4  # float32


# -- cases (shared with tests/gpu) ---------------------------------------------------------------


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, kvh, D]
    v: torch.Tensor  # [T, kvh, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, kvh, D], random stale contents
    v_cache: torch.Tensor
    mode: ForwardMode
    seq_lens: list[int]
    query_lens: list[int]
    block_tables: torch.Tensor  # [B, max_blocks + 1] int32, scrambled, padded with 0
    slot_mapping: torch.Tensor  # [T] int64; -1 for padded rows (seq_len 0)
    custom_mask: torch.Tensor | None  # [T, max seq_len] bool

    def meta(self, rows: list[int] | None = None) -> AttentionMetadata:
        """Metadata for all sequences, or only `rows` of them (the reference skips padding)."""
        seqs = list(range(len(self.seq_lens))) if rows is None else rows
        starts = _starts(self.query_lens)
        tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
        qlens = [self.query_lens[i] for i in seqs]
        lens = [self.seq_lens[i] for i in seqs]
        dev = self.q.device
        mask = None
        if self.custom_mask is not None:
            mask = self.custom_mask[tokens.to(dev)][:, : max(lens)]
        return AttentionMetadata(
            mode=self.mode,
            slot_mapping=self.slot_mapping[tokens.to(dev)],
            query_start_loc=torch.tensor(_starts(qlens), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=self.block_tables[torch.tensor(seqs, device=dev)],
            query_lens_cpu=qlens,
            seq_lens_cpu=lens,
            custom_mask=mask,
        )


def _starts(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def build_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    trees: dict[int, list[int]] | None = None,  # sequence -> draft parents (VERIFY under a mask)
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> Case:
    """Random q/k/v and a random paged cache; each sequence owns scrambled blocks (so pages are
    never contiguous), the cache holds garbage beyond every sequence's length, and a sequence
    with seq_len 0 is a padded row (one query, slot -1, no blocks)."""
    gen = torch.Generator().manual_seed(seed)  # the block layout, on the host
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # values, where they live
    trees = {int(i): parents for i, parents in (trees or {}).items()}  # JSON keys are strings
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need) + 1  # one more column than needed: padding must not be read
    tables, slots, next_free = [], [], 0
    for n, qlen, nb in zip(seq_lens, query_lens, need):
        blocks = perm[next_free : next_free + nb]
        next_free += nb
        tables.append(blocks + [0] * (max_blocks - nb))
        if n == 0:
            slots += [-1] * qlen
        else:
            slots += [
                blocks[p // block_size] * block_size + p % block_size for p in range(n - qlen, n)
            ]
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    mask = None
    mode = ForwardMode.DECODE if set(query_lens) == {1} else ForwardMode.VERIFY
    if trees:
        mask = torch.zeros(num_tokens, max(seq_lens), dtype=torch.bool)
        for i, (n, qlen, start) in enumerate(zip(seq_lens, query_lens, _starts(query_lens))):
            if i in trees:
                topology = TreeTopology.from_parents(trees[i])
                assert qlen == 1 + topology.num_nodes
                mask[start : start + qlen, :n] = verify_mask(topology, n - qlen)
            else:
                pos = torch.arange(n - qlen, n)
                mask[start : start + qlen, :n] = torch.arange(n)[None, :] <= pos[:, None]
        mask = mask.to(device)
    elif max(query_lens) > 1 and any(q == n for q, n in zip(query_lens, seq_lens)):
        mode = ForwardMode.PREFILL
    # q, k, v are views of one fused projection, as a model hands them over (rows strided).
    qkv = randn(num_tokens, (num_heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return Case(
        q=q.view(num_tokens, num_heads, head_dim),
        k=k.view(num_tokens, kv_heads, head_dim),
        v=v.view(num_tokens, kv_heads, head_dim),
        k_cache=randn(num_blocks, block_size, kv_heads, head_dim),
        v_cache=randn(num_blocks, block_size, kv_heads, head_dim),
        mode=mode,
        seq_lens=list(seq_lens),
        query_lens=list(query_lens),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        custom_mask=mask,
    )


def compare(case: Case, num_splits: int | None = None, scale: float | None = None) -> dict:
    """Run TritonBackend and TorchRefBackend on copies of the case's cache. Returns the worst
    output and cache differences on real rows, the largest |output| on padded rows, and the
    splits the backend chose."""
    from outrider.layers.attn_backends.triton import TritonBackend

    scale = scale or case.q.shape[-1] ** -0.5
    real = [i for i, n in enumerate(case.seq_lens) if n > 0]
    starts = _starts(case.query_lens)
    real_tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in real]).to(
        case.q.device
    )

    backend = TritonBackend(num_splits=num_splits)
    meta = case.meta()
    backend.prepare(meta)
    cache = {"k": case.k_cache.clone(), "v": case.v_cache.clone()}
    out = backend.forward(case.q, case.k, case.v, cache, meta, scale)

    ref_meta = case.meta(real)
    ref_cache = {"k": case.k_cache.clone(), "v": case.v_cache.clone()}
    q, k, v = (x[real_tokens] for x in (case.q, case.k, case.v))
    ref = TorchRefBackend().forward(q, k, v, ref_cache, ref_meta, scale)

    padded = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    padded[real_tokens] = False
    return {
        "max_err": (out[real_tokens].float() - ref.float()).abs().max().item(),
        "cache_err": max(
            (cache[n].float() - ref_cache[n].float()).abs().max().item() for n in ("k", "v")
        ),
        "padded_max": out[padded].float().abs().max().item() if padded.any() else 0.0,
        "finite": bool(torch.isfinite(out).all()),
        "splits": sorted(set(meta.backend_data["triton"].splits.values())),
    }


# -- the interpreter worker ----------------------------------------------------------------------


def _check_compare(case: dict, num_splits: int | None = None) -> dict:
    return compare(build_case(**case), num_splits)


def _check_choose_num_splits(calls: list[list[int]]) -> dict:
    from outrider.layers.attn_backends.triton_decode import choose_num_splits

    return {"splits": [choose_num_splits(*c) for c in calls]}


def _check_registry() -> dict:
    from outrider.layers.attn_backends.base import get_backend

    return {"triton": type(get_backend("triton")).__name__}


_CHECKS = {
    "compare": _check_compare,
    "choose_num_splits": _check_choose_num_splits,
    "registry": _check_registry,
}


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with int(array of shape (1,)),
    which numpy >= 2.4 refuses ('only 0-dimensional arrays...'): every kernel whose loop bounds
    come from a loaded length would fail. Take the one element instead (test-only shim)."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _serve() -> None:
    """Worker loop: one JSON request a line in, one marked JSON result a line out."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _patch_interpreter_index()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = _CHECKS[request.pop("check")](**request)
        except Exception:
            result = {"error": traceback.format_exc()}
        print(_RESULT + json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: pip install 'triton==3.6.*'")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tests.unit.test_triton_attention import _serve; _serve()"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def run(check: str, **kwargs) -> dict:
        proc.stdin.write(json.dumps({"check": check, **kwargs}) + "\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith(_RESULT):
                result = json.loads(line[len(_RESULT) :])
                assert "error" not in result, result["error"]
                return result
        raise RuntimeError(f"the interpreter worker exited (code {proc.wait()}); see stderr")

    try:
        yield run
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def _case(seq_lens, query_lens=None, heads=(4, 2), head_dim=64, block_size=16, **kw) -> dict:
    query_lens = query_lens or [1] * len(seq_lens)
    return dict(
        seq_lens=seq_lens,
        query_lens=query_lens,
        num_heads=heads[0],
        kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        **kw,
    )


def _assert_close(res: dict) -> None:
    assert res["finite"], res
    assert res["max_err"] < TOL, res
    assert res["cache_err"] == 0.0, res
    assert res["padded_max"] == 0.0, res


# -- decode --------------------------------------------------------------------------------------

# Contexts on both sides of page (16, 32) and tile (64) edges, up to ~300.
CONTEXTS = [1, 15, 16, 17, 33, 64, 65, 130, 257, 300]


@pytest.mark.parametrize(
    "heads, block_size, num_splits",
    [((2, 2), 16, 3), ((3, 1), 32, None), ((8, 2), 16, 1), ((8, 2), 32, 5)],
    ids=["gqa1-bs16-split3", "gqa3-bs32-auto", "gqa4-bs16-split1", "gqa4-bs32-split5"],
)
def test_decode_matches_reference(interpreter, heads, block_size, num_splits):
    res = interpreter(
        "compare", case=_case(CONTEXTS, heads=heads, block_size=block_size), num_splits=num_splits
    )
    _assert_close(res)


def test_heuristic_splits_few_sequences(interpreter):
    # Few (sequence, KV head) programs on the CPU's stand-in of 4 SMs: the backend's own choice
    # splits 300 keys in two (256 keys a split at least), for decode and for verify alike.
    decode = interpreter("compare", case=_case([300, 290], heads=(3, 1)))
    verify = interpreter("compare", case=_case([300], [5], heads=(8, 2)))
    for res in (decode, verify):
        _assert_close(res)
        assert res["splits"] == [2], res


def test_decode_padded_rows_are_zero(interpreter):
    # Rows with seq_len 0 (CUDA graph padding) write no KV (slot -1) and output 0, not NaN,
    # whether or not the context is split.
    for num_splits in (1, 4):
        res = interpreter(
            "compare", case=_case([0, 40, 0, 129], heads=(4, 1)), num_splits=num_splits
        )
        _assert_close(res)


@pytest.mark.slow
def test_decode_head_dim_128(interpreter):
    _assert_close(
        interpreter(
            "compare",
            case=_case([5, 100, 300], heads=(8, 2), head_dim=128, block_size=32),
            num_splits=2,
        )
    )


def test_choose_num_splits(interpreter):
    # (programs, max_seq_len, num_sms): fill ~2 waves, >= 256 keys a split, at most 32.
    calls = [
        [8, 8192, 132],
        [256, 1024, 132],
        [512, 8192, 132],
        [8, 100, 132],
        [8, 1 << 17, 132],
        [1, 0, 4],
    ]
    assert interpreter("choose_num_splits", calls=calls)["splits"] == [32, 2, 1, 1, 32, 1]


# -- prefill and verify --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads, block_size", [((3, 1), 16), ((8, 2), 32)], ids=["gqa3-bs16", "gqa4-bs32"]
)
def test_prefill_with_cached_prefix(interpreter, heads, block_size):
    # A fresh prompt, chunks behind a cached prefix (crossing pages and tiles), and a decode
    # riding along as a one-token query.
    case = _case([40, 100, 150, 17], [40, 37, 70, 1], heads=heads, block_size=block_size)
    _assert_close(interpreter("compare", case=case))


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_verify_chain(interpreter, num_splits):
    # 1 + k = 5 queries a sequence; contexts from 5 to ~300; a padded sequence (seq_len 0).
    case = _case([5, 18, 66, 0, 301], [5] * 5, heads=(8, 2))
    _assert_close(interpreter("compare", case=case, num_splits=num_splits))


@pytest.mark.slow
def test_verify_gqa1_block32(interpreter):
    case = _case([7, 33, 200], [4, 4, 4], heads=(2, 2), block_size=32)
    _assert_close(interpreter("compare", case=case, num_splits=2))


def test_tree_custom_mask(interpreter):
    # Sequence 0 verifies the module docstring's tree of speculative/tree.py (5 nodes behind its
    # prefix), sequence 1 a chain of 3 in the same mask, sequence 2 decodes; split and unsplit.
    case = _case(
        [70, 20, 131], [6, 4, 1], heads=(8, 2), trees={0: [-1, -1, 0, 0, 1], 1: [-1, 0, 1]}
    )
    for num_splits in (1, 2):
        _assert_close(interpreter("compare", case=case, num_splits=num_splits))


def test_registered_by_name(interpreter):
    names = interpreter("registry")
    assert names == {"triton": "TritonBackend"}
