"""The Triton attention kernels' logic on the CPU, under Triton's interpreter, against
TorchRefBackend: decode (split-K, GQA), prefill over a cached prefix, chain and tree VERIFY.
The compact tree mask (AttentionMetadata.tree_mask) is itself checked against dense masks from
`verify_mask`: as build_inputs makes it, and through TorchRefBackend against a dense SDPA.

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
_RESULT = "@@triton-interpreter-result "
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
    tree_mask: torch.Tensor | None  # [T, M] bool over each sequence's last M keys
    trees: dict[int, list[int]]  # sequence -> draft parents, for the dense oracle

    def meta(self, rows: list[int] | None = None) -> AttentionMetadata:
        """Metadata for all sequences, or only `rows` of them (the reference skips padding)."""
        seqs = list(range(len(self.seq_lens))) if rows is None else rows
        starts = _starts(self.query_lens)
        tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
        qlens = [self.query_lens[i] for i in seqs]
        lens = [self.seq_lens[i] for i in seqs]
        dev = self.q.device
        mask = None if self.tree_mask is None else self.tree_mask[tokens.to(dev)]
        return AttentionMetadata(
            mode=self.mode,
            slot_mapping=self.slot_mapping[tokens.to(dev)],
            query_start_loc=torch.tensor(_starts(qlens), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=self.block_tables[torch.tensor(seqs, device=dev)],
            query_lens_cpu=qlens,
            seq_lens_cpu=lens,
            tree_mask=mask,
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
    mask_width: int | None = None,  # M of the tree mask; None: the longest query
) -> Case:
    """Random q/k/v and a random paged cache; each sequence owns scrambled blocks (so pages are
    never contiguous), the cache holds garbage beyond every sequence's length, and a sequence
    with seq_len 0 is a padded row (one query, slot -1, no blocks). With trees, the tree mask's
    columns that stand for no key (M > seq_len) hold random bits: kernels must ignore them."""
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
        width = mask_width or max(query_lens)
        mask = torch.ones(num_tokens, width, dtype=torch.bool)
        for i, (n, qlen, start) in enumerate(zip(seq_lens, query_lens, _starts(query_lens))):
            rows = slice(start, start + qlen)
            if i in trees:
                topology = TreeTopology.from_parents(trees[i])
                assert qlen == 1 + topology.num_nodes
                mask[rows, width - qlen :] = topology.ancestor_mask()
            else:
                mask[rows, width - qlen :] = torch.ones(qlen, qlen, dtype=torch.bool).tril()
            if width > n:
                mask[rows, : width - n] = torch.randint(0, 2, (qlen, width - n), generator=gen) > 0
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
        tree_mask=mask,
        trees=trees,
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


def dense_mask(case: Case, i: int) -> torch.Tensor:
    """The oracle for sequence i: [query_len, seq_len] bool, `verify_mask` for a tree, causal
    otherwise, built without the compact mask."""
    n, qlen = case.seq_lens[i], case.query_lens[i]
    if i in case.trees:
        return verify_mask(TreeTopology.from_parents(case.trees[i]), n - qlen)
    return torch.arange(n)[None, :] <= torch.arange(n - qlen, n)[:, None]


def dense_reference(case: Case, scale: float) -> torch.Tensor:
    """Per real sequence, one SDPA under `dense_mask` over its keys gathered from the paged
    cache (after this step's writes), KV heads repeated for GQA. [T, H, D]; padded rows 0."""
    num_heads, head_dim = case.q.shape[1:]
    block_size, kv_heads = case.k_cache.shape[1:3]
    group = num_heads // kv_heads
    out = torch.zeros_like(case.q)
    caches = []
    for cache, new in ((case.k_cache, case.k), (case.v_cache, case.v)):
        flat = cache.clone().view(-1, kv_heads, head_dim)
        ok = case.slot_mapping >= 0
        flat[case.slot_mapping[ok]] = new[ok]
        caches.append(flat.view(cache.shape))
    starts = _starts(case.query_lens)
    for i, n in enumerate(case.seq_lens):
        if n == 0:
            continue
        blocks = case.block_tables[i, : math.ceil(n / block_size)].long()
        k, v = (c[blocks].reshape(-1, kv_heads, head_dim)[:n] for c in caches)
        k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))  # [H, n, D]
        q = case.q[starts[i] : starts[i + 1]].transpose(0, 1)  # [H, qlen, D]
        mask = dense_mask(case, i).to(q.device)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
    return out


# -- the interpreter worker ----------------------------------------------------------------------


def _check_compare(case: dict, num_splits: int | None = None) -> dict:
    return compare(build_case(**case), num_splits)


def _check_choose_num_splits(calls: list[list[int]]) -> dict:
    from outrider.layers.attn_backends.triton_decode import choose_num_splits

    return {"splits": [choose_num_splits(*c) for c in calls]}


def _check_bad_tree_mask(case: dict) -> dict:
    """The ValueError message of each malformed mask, through the backend and the kernel's
    own entry point."""
    from outrider.layers.attn_backends.triton import TritonBackend
    from outrider.layers.attn_backends.triton_prefill import prefill_attention

    c = build_case(**case)
    good = c.tree_mask
    bad = {"rows": good[:-1], "width": good[:, :0], "dim": good[0], "dtype": good.to(torch.uint8)}
    errors = {}
    for name, mask in bad.items():
        meta = c.meta()
        meta.tree_mask = mask
        cache = {"k": c.k_cache.clone(), "v": c.v_cache.clone()}
        try:
            TritonBackend().forward(c.q, c.k, c.v, cache, meta, 1.0)
        except ValueError as e:
            errors[name] = str(e)
    try:
        prefill_attention(
            c.q, c.k_cache, c.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            max(c.query_lens), 1.0, tree_mask=good[:-1],
        )  # fmt: skip
    except ValueError as e:
        errors["kernel_rows"] = str(e)
    return errors


def _check_registry() -> dict:
    from outrider.layers.attn_backends.base import get_backend

    return {"triton": type(get_backend("triton")).__name__}


_CHECKS = {
    "compare": _check_compare,
    "choose_num_splits": _check_choose_num_splits,
    "bad_tree_mask": _check_bad_tree_mask,
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


def serve(checks: dict) -> None:
    """Worker loop, in a process under TRITON_INTERPRET=1: one JSON request a line in (its
    "check" names one of `checks`), one marked JSON result a line out."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _patch_interpreter_index()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = checks[request.pop("check")](**request)
        except Exception:
            result = {"error": traceback.format_exc()}
        print(_RESULT + json.dumps(result), flush=True)


def interpreter_worker(module: str):
    """A generator for a module-scoped fixture: starts `module`'s _serve() in a worker process
    under the interpreter and yields run(check, **kwargs) -> its result; stops it after."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: pip install 'triton==3.6.*'")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from {module} import _serve; _serve()"],
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


def _serve() -> None:
    serve(_CHECKS)


@pytest.fixture(scope="module")
def interpreter():
    yield from interpreter_worker("tests.unit.test_triton_attention")


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


# The module docstring's tree of speculative/tree.py: 5 nodes, two branches.
BRANCHY = [-1, -1, 0, 0, 1]


def test_tree_mask_mixed_batch(interpreter):
    # Sequence 0 verifies BRANCHY behind its prefix, sequence 1 a chain of 3 as a tree, 2 is a
    # prefill chunk and 3 a decode (causal rows in the same M = 6 mask), 4 a padded row; with
    # and without splitting the keys.
    case = _case(
        [70, 20, 45, 131, 0], [6, 4, 3, 1, 1], heads=(8, 2), trees={0: BRANCHY, 1: [-1, 0, 1]}
    )
    for num_splits in (1, 3):
        _assert_close(interpreter("compare", case=case, num_splits=num_splits))


def test_tree_mask_wider_than_a_sequence(interpreter):
    # M = 9 covers more keys than sequences 1..3 have: a fresh 3-token prompt, a tree verified
    # from position 0 (its root is the first token), a 1-key decode. Their columns that stand for
    # no key hold random bits and must be ignored.
    case = _case(
        [70, 3, 4, 1], [6, 3, 4, 1], heads=(4, 1), trees={0: BRANCHY, 2: [-1, 0, 0]},
        mask_width=9,
    )  # fmt: skip
    for num_splits in (1, 2):
        _assert_close(interpreter("compare", case=case, num_splits=num_splits))


def test_bad_tree_mask_shape_raises(interpreter):
    case = _case([70, 20, 131], [6, 4, 1], heads=(4, 1), trees={0: BRANCHY})
    errors = interpreter("bad_tree_mask", case=case)
    assert errors.keys() == {"rows", "width", "dim", "dtype", "kernel_rows"}, errors
    assert "shape (10, 6) for 11 query tokens; build it [11, M] with M >= 1" in errors["rows"]
    assert "shape (11, 0) for 11 query tokens" in errors["width"]
    assert "shape (6,) for 11 query tokens" in errors["dim"]
    assert "tree_mask must be torch.bool, got torch.uint8" in errors["dtype"]
    assert "shape (10, 6) for 11 query tokens" in errors["kernel_rows"]


@pytest.mark.parametrize("mask_width", [None, 12], ids=["M=max-query", "M=12"])
def test_torch_ref_tree_mask_matches_dense_verify_mask(mask_width):
    # The reference backend expands the compact mask: it must attend exactly as SDPA under the
    # dense masks `verify_mask` builds. Sequence 3 (seq_len 4) is shorter than M = 12.
    case = _case(
        [70, 20, 45, 4, 131], [6, 4, 3, 4, 1], heads=(6, 2),
        trees={0: BRANCHY, 1: [-1, 0, 1], 3: [-1, 0, 0]}, mask_width=mask_width,
    )  # fmt: skip
    case = build_case(**case)
    scale = case.q.shape[-1] ** -0.5
    want = dense_reference(case, scale)
    cache = {"k": case.k_cache.clone(), "v": case.v_cache.clone()}
    got = TorchRefBackend().forward(case.q, case.k, case.v, cache, case.meta(), scale)
    assert (got - want).abs().max().item() < 1e-5


def test_build_inputs_tree_mask_expands_to_verify_mask():
    # A verify of BRANCHY at position 10, a chain verify, a fresh 3-token prompt (shorter than
    # M = 6) and a decode: each sequence's rows, read over its last M keys with every earlier
    # key visible, must give `verify_mask` for the tree and causal masks for the rest.
    from outrider.core import Request, SamplingParams, ScheduledBatch, ScheduledSeq, SeqDrafts
    from outrider.executor.inputs import build_inputs

    def seq(start_pos: int, n: int, drafts: SeqDrafts | None = None) -> ScheduledSeq:
        req = Request(prompt_token_ids=list(range(start_pos + 1)), params=SamplingParams())
        return ScheduledSeq(req, list(range(n)), start_pos, [0, 1, 2], True, drafts)

    tree = SeqDrafts(list(range(5)), BRANCHY)
    seqs = [seq(10, 6, tree), seq(7, 4, SeqDrafts.chain([1, 2, 3])), seq(0, 3), seq(20, 1)]
    mask = build_inputs(ScheduledBatch(ForwardMode.VERIFY, seqs), 16, torch.device("cpu"))
    mask = mask.attn.tree_mask
    assert mask.shape == (14, 6) and mask.dtype == torch.bool
    starts = _starts([s.query_len for s in seqs])
    for s, start in zip(seqs, starts):
        n, qlen = s.context_len, s.query_len
        tail = min(6, n)
        dense = torch.ones(qlen, n, dtype=torch.bool)
        dense[:, n - tail :] = mask[start : start + qlen, 6 - tail :]
        if s.drafts is not None and not s.drafts.is_chain:
            want = verify_mask(TreeTopology.from_parents(s.drafts.parents), s.start_pos)
        else:
            want = torch.arange(n)[None, :] <= torch.arange(n - qlen, n)[:, None]
        assert torch.equal(dense, want), (s.start_pos, dense, want)


def test_registered_by_name(interpreter):
    names = interpreter("registry")
    assert names == {"triton": "TritonBackend"}
