"""The deterministic mode's Triton kernels on the CPU under Triton's interpreter: a row's bits
are the same alone and inside batches of other sizes.

- batch_invariant.matmul (every linear and the LM head on CUDA): row i of x @ W^T alone equals
  row i inside batches of 3, 17 and 70 rows, with K split and unsplit, with and without a
  bias; and the product is x @ W^T within rounding. The GPU test adds every tile schedule
  gemm_config picks at real shapes.
- the Triton backend built with deterministic=True (batch-invariant split attention,
  triton_chunked): a query row at position p gives the same bits as a one-token decode (alone
  and beside other sequences), as a row of a chain verify, as a row of a prefill chunk and of
  a whole prefill, at positions on both sides of the 256-key chunk boundary and within the
  first chunk; and matches the PyTorch reference.
- chunked_attention itself with 64-key chunks (three chunks at small contexts): the same
  forms, in decode batches of 2 and 4, verify batches, prefills cut into one-tile launches,
  under SM counts that change the programs per tile; plan_chunks covers every token once and
  keeps the workspace within its budget at Llama-3.1-8B's shapes.

`gemm_rows`, `attention_rows` and `chunked_rows` take a device, so
tests/gpu/test_deterministic_cuda.py runs the same checks on CUDA. As in test_triton_attention.py, TRITON_INTERPRET=1 has to be set
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
    splits = batch_invariant.gemm_config(
        dtype, n, k, sms or batch_invariant.num_sms(x.device)
    ).splits
    return {"equal": bool(equal), "scaled": scaled, "splits": splits}


def attention_rows(
    dtype: torch.dtype,
    device: str,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 32,
    context: int = 300,
    positions: tuple[int, ...] = (40, 255, 256, 290),
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

    # Every position of A, B and C in the cache, as their whole prefills would leave it (each
    # form below writes its own rows again, the same values); stored directly: three prefills
    # of the whole context were a third of this check's time under the interpreter.
    for s in range(3):
        pos = torch.arange(context)
        page = tables[s].long().cpu()[pos // block_size]
        k_cache[page, pos % block_size], v_cache[page, pos % block_size] = ks[s], vs[s]
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


def chunked_rows(
    dtype: torch.dtype,
    device: str,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    contexts: tuple[int, ...] = (200, 90, 150, 40),
    # The first key, both sides of the first chunk boundary, and near the third chunk's end
    # (a verify there reaches the fourth): a row deeper inside a chunk takes no path of its own.
    positions: tuple[int, ...] = (0, 63, 64, 65, 190),
    batches: tuple[int, ...] = (2, 4),
    chunk_keys: int = 64,
    block_size: int = 16,
    sms: tuple[int, ...] = (1, 4),
) -> dict:
    """triton_chunked.chunked_attention called directly. Sequence 0 (context contexts[0], K/V
    at scrambled pages) and others beside it; its query row at each position p computed as a
    decode alone (the reference form) and as: a decode in batches of `batches` sizes, the
    middle row of a 5-token chain verify (alone and batched), a row of a 40-token prefill
    chunk, a row of a whole prefill 0..p+3 batched with another sequence's prefill, the same
    prefill cut into launches of one query tile, a decode planned for 8x the context (as a
    CUDA graph plans for max_model_len), every form under each SM count in `sms` (which
    changes the programs per tile). -> {"equal": every form bitwise equal to the lone
    decode, "failed": the first form that was not, "scaled": the lone decodes' largest error
    against fp64 attention over the largest |value|, "padded_zero": a sequence with seq_len 0
    comes out 0, "chunks": the most chunks a row used}."""
    from outrider.layers.attn_backends.triton_chunked import chunked_attention, plan_chunks

    g = torch.Generator().manual_seed(11)
    n_seq = len(contexts)
    pages = -(-max(contexts) // block_size)
    order = torch.randperm(n_seq * pages, generator=g) + 1  # block 0 stays unused
    tables = order.view(n_seq, pages).to(torch.int32).to(device)
    span = max(contexts)
    # Sequence 0's queries, and one set every other sequence reads (their keys differ).
    qs = torch.randn(2, span, heads, head_dim, generator=g).to(dtype).to(device)
    blocks = n_seq * pages + 1
    k_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    for s, n in enumerate(contexts):  # one sequence at a time: 64 x 8K contexts fit a GPU
        k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype).to(device)
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype).to(device)
        pos = torch.arange(n, device=device)
        page = tables[s].long()[pos // block_size]
        k_cache[page, pos % block_size], v_cache[page, pos % block_size] = k, v
        if s == 0:
            k0, v0 = k.double().cpu(), v.double().cpu()
    scale = head_dim**-0.5

    def run(
        rows: list[tuple[int, int, int]], num_sms: int, max_rows=None, max_seq_len=None
    ) -> torch.Tensor:
        """rows: (sequence, first position, query length) -> out [tokens, heads, head_dim].
        max_seq_len: the host's bound on every context (a CUDA graph's is max_model_len)."""
        q = torch.cat([qs[min(s, 1), first : first + n] for s, first, n in rows])
        lens = [n for _, _, n in rows]
        seq_lens = [first + n for _, first, n in rows]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        plan = plan_chunks(
            lens, max_seq_len or max(seq_lens), heads, kv_heads, head_dim, dtype, num_sms,
            chunk_keys, max_rows,
        )  # fmt: skip
        i32 = dict(dtype=torch.int32, device=device)
        return chunked_attention(
            q, k_cache, v_cache, tables[torch.tensor([s for s, _, _ in rows]).to(device)],
            torch.tensor(seq_lens, **i32), torch.tensor(starts, **i32), plan, scale,
        )  # fmt: skip

    others = [(s, contexts[s] - 1, 1) for s in range(1, n_seq)]
    equal, failed, scaled = True, None, 0.0
    for p in positions:
        alone = run([(0, p, 1)], sms[0])[0]
        forms: dict[str, torch.Tensor] = {}
        for num_sms in sms:
            forms[f"decode-sms{num_sms}"] = run([(0, p, 1)], num_sms)[0]
            graph_sized = run([(0, p, 1)], num_sms, max_seq_len=8 * span)[0]
            forms[f"decode-graph-sized-sms{num_sms}"] = graph_sized
            for b in batches:
                batch = [*others[: b // 2], (0, p, 1), *others[b // 2 : b - 1]]
                forms[f"decode-b{b}-sms{num_sms}"] = run(batch, num_sms)[b // 2]
            vstart = max(p - 2, 0)
            forms[f"verify-sms{num_sms}"] = run([(0, vstart, 5)], num_sms)[p - vstart]
            verify = [(s, max(c - 5, 0), min(c, 5)) for s, c in enumerate(contexts)][1:]
            shift = sum(n for _, _, n in verify)
            forms[f"verify-batch-sms{num_sms}"] = run(verify + [(0, vstart, 5)], num_sms, 8)[
                shift + p - vstart
            ]
            c0 = max(p - 30, 0)
            forms[f"chunk-sms{num_sms}"] = run([(0, c0, 40)], num_sms)[p - c0]
            whole = [(1, 0, contexts[1]), (0, 0, p + 4)]
            forms[f"prefill-sms{num_sms}"] = run(whole, num_sms)[contexts[1] + p]
            forms[f"prefill-cut-sms{num_sms}"] = run(whole, num_sms, 1)[contexts[1] + p]
        for name, got in forms.items():
            if not torch.equal(got, alone):
                equal, failed = False, failed or f"{name} at position {p}"
        kf = k0[: p + 1].repeat_interleave(heads // kv_heads, 1)
        vf = v0[: p + 1].repeat_interleave(heads // kv_heads, 1)
        w = torch.einsum("hd,khd->hk", qs[0, p].double().cpu(), kf) * scale
        ref = torch.einsum("hk,khd->hd", w.softmax(-1), vf)
        err = (alone.double().cpu() - ref).abs().max() / ref.abs().max()
        scaled = max(scaled, err.item())
    # A padded sequence (seq_len 0, one query) beside a real decode: it comes out 0, and the
    # real row keeps its bits.
    p = positions[-1]
    i32 = dict(dtype=torch.int32, device=device)
    plan = plan_chunks([1, 1], p + 1, heads, kv_heads, head_dim, dtype, sms[0], chunk_keys)
    padded = chunked_attention(
        torch.cat([qs[0, p : p + 1], qs[1, :1]]), k_cache, v_cache, tables[:2],
        torch.tensor([p + 1, 0], **i32), torch.tensor([0, 1, 2], **i32), plan, scale,
    )  # fmt: skip
    zero = bool((padded[1] == 0).all())
    equal &= torch.equal(padded[0], run([(0, p, 1)], sms[0])[0])
    return {
        "equal": bool(equal), "failed": failed, "scaled": scaled, "padded_zero": zero,
        "chunks": -(-(max(positions) + 1) // chunk_keys),
    }  # fmt: skip


def tree_rows(
    dtype: torch.dtype,
    device: str,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    roots: tuple[int, ...] = (60, 130, 5),
    parents: tuple[int, ...] = (-1, -1, 0, 0, 1, 2, 5, -1),
    chunk_keys: int = 64,
    block_size: int = 16,
    sms: int = 4,
) -> dict:
    """chunked_attention under a tree mask: sequences whose roots sit at `roots` (60 and 130:
    paths that cross a 64-key chunk boundary) each verify the root and a tree of
    len(parents) nodes (parents[i]: node i's parent, -1 the root), batched beside a chain
    verify of the same length and 3 tokens of a sequence shorter than the mask. Node i's row
    must equal, bit for bit, the lone decode of its query at position root + depth(i) in a
    copy of the sequence whose keys after the context are the root's and its path's, in path
    order (what the cache holds once the path is accepted). -> {"equal", "failed": the first (root, node) that was not, "rows": rows
    compared, "chain_equal": the chain's and the short sequence's rows equal their decodes}."""
    from outrider.layers.attn_backends.triton_chunked import chunked_attention, plan_chunks

    g = torch.Generator().manual_seed(5)
    n = 1 + len(parents)  # query tokens a verify
    depth = [0]
    for par in parents:
        depth.append(depth[par + 1] + 1)
    paths = []  # each query token's path from the root (query indices), itself last
    for t in range(n):
        path = [t]
        while path[-1] != 0:
            path.append(parents[path[-1] - 1] + 1)
        paths.append(path[::-1])
    span = max(roots) + n
    pages = -(-span // block_size)
    # Pages: one set a tree sequence, one a chain, then one a (root, node) decode copy.
    n_tables = len(roots) + 1 + len(roots) * n
    order = torch.randperm(n_tables * pages, generator=g) + 1
    tables = order.view(n_tables, pages).to(torch.int32).to(device)
    k_cache = torch.zeros(n_tables * pages + 1, block_size, kv_heads, head_dim, dtype=dtype)
    k_cache, v_cache = k_cache.to(device), torch.zeros_like(k_cache).to(device)
    keys = torch.randn(len(roots) + 1, span, kv_heads, head_dim, generator=g).to(dtype)
    vals = torch.randn(len(roots) + 1, span, kv_heads, head_dim, generator=g).to(dtype)
    qs = torch.randn(len(roots) + 1, n, heads, head_dim, generator=g).to(dtype).to(device)

    def store(table: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        page = tables[table].long()[pos // block_size]
        k_cache[page, pos % block_size] = k.to(device)
        v_cache[page, pos % block_size] = v.to(device)

    chain_root = roots[0]
    seq_roots = [*roots, chain_root]
    for s, root in enumerate(seq_roots):  # context, root and the tree's slots in order
        pos = torch.arange(root + n, device=device)
        store(s, pos, keys[s, : root + n], vals[s, : root + n])
    # The tree mask over each sequence's last n keys; the chain's is causal. Last, SHORT
    # tokens of a sequence shorter than the mask (context 1, in the chain's table): its
    # columns before key 0 do not exist and are set, to be ignored.
    short = 3
    mask = torch.zeros(len(seq_roots) * n + short, n, dtype=torch.bool)
    for s in range(len(seq_roots)):
        for t in range(n):
            cols = paths[t] if s < len(roots) else range(t + 1)
            mask[s * n + t, list(cols)] = True
    for t in range(short):
        mask[len(seq_roots) * n + t, : n - short + t + 1] = True
    i32 = dict(dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    lens = [n] * len(seq_roots) + [short]
    starts = [0]
    for q_len in lens:
        starts.append(starts[-1] + q_len)
    plan = plan_chunks(lens, span, heads, kv_heads, head_dim, dtype, sms, chunk_keys, tree=True)
    verify = chunked_attention(
        torch.cat([qs[: len(seq_roots)].flatten(0, 1), qs[len(roots), :short]]), k_cache,
        v_cache, tables[[*range(len(seq_roots)), len(roots)]],
        torch.tensor([r + n for r in seq_roots] + [1 + short], **i32),
        torch.tensor(starts, **i32), plan, scale, tree_mask=mask.to(device),
    )  # fmt: skip

    def decode(table: int, q: torch.Tensor, position: int) -> torch.Tensor:
        plan = plan_chunks([1], span, heads, kv_heads, head_dim, dtype, sms, chunk_keys)
        return chunked_attention(
            q[None], k_cache, v_cache, tables[table : table + 1],
            torch.tensor([position + 1], **i32), torch.tensor([0, 1], **i32), plan, scale,
        )[0]  # fmt: skip

    equal, failed, rows, copy = True, None, 0, len(seq_roots)
    for s, root in enumerate(roots):
        for t in range(n):
            # The decode's sequence: the context, then the path's keys in path order.
            where = torch.tensor([root + i for i in paths[t]])
            at = torch.arange(root + len(paths[t]), device=device)
            k = torch.cat([keys[s, :root], keys[s, where]])
            v = torch.cat([vals[s, :root], vals[s, where]])
            store(copy, at, k, v)
            want = decode(copy, qs[s, t], root + depth[t])
            copy += 1
            rows += 1
            if not torch.equal(verify[s * n + t], want):
                equal, failed = False, failed or f"root {root} node {t}"
    base = len(roots) * n
    chain_equal = all(
        torch.equal(verify[base + t], decode(len(roots), qs[len(roots), t], chain_root + t))
        for t in range(n)
    ) and all(
        torch.equal(verify[base + n + t], decode(len(roots), qs[len(roots), t], 1 + t))
        for t in range(short)
    )  # fmt: skip
    return {"equal": bool(equal), "failed": failed, "rows": rows, "chain_equal": chain_equal}


def plan_cover(
    query_lens: list[int], max_seq_len: int, heads: int, kv_heads: int, head_dim: int, **kw
) -> dict:
    """plan_chunks' launches: {"covered": every token in exactly one launch's rows, "bytes":
    the workspace's size, "budget": WORKSPACE_BYTES, "launches": how many, "max_chunks", "programs": per launch}."""
    from outrider.layers.attn_backends.triton_chunked import WORKSPACE_BYTES, plan_chunks

    plan = plan_chunks(query_lens, max_seq_len, heads, kv_heads, head_dim, torch.bfloat16, **kw)
    seen = [0] * sum(query_lens)
    for ln in plan.launches:
        for t in range(ln.token0, ln.token0 + ln.rows):
            seen[t] += 1
    return {
        "covered": seen == [1] * len(seen),
        "bytes": plan.rows * heads * plan.max_chunks * (head_dim + 2) * 4,
        "budget": WORKSPACE_BYTES,
        "launches": len(plan.launches), "max_chunks": plan.max_chunks,
        "programs": [ln.programs for ln in plan.launches],
    }  # fmt: skip


def _worker(tag: str) -> None:  # runs in a subprocess per dtype, TRITON_INTERPRET=1
    from tests.unit.test_triton_attention import _patch_interpreter_index

    _patch_interpreter_index()  # numpy >= 2.4 against triton 3.6's interpreter: see there
    if tag != "plans":
        dtype = getattr(torch, tag)
        # K 2100: ragged against every BLOCK_K; sms 8 splits it (2 or more: a split keeps 8
        # K steps, 128 long for 16-bit inputs), sms 1 does not.
        for sms, bias in ((8, False), (8, True), (1, True)):
            out = gemm_rows((1, 3, 17, 70), 80, 2100, dtype, "cpu", bias, sms=sms)
            emit(name=f"gemm-{tag}-sms{sms}-bias{bias}", **out)
        if tag in ATTENTION_DTYPES:
            emit(name=f"attention-{tag}", **attention_rows(dtype, "cpu"))
        if tag in CHUNKED_DTYPES:
            emit(name=f"chunked-{tag}", **chunked_rows(dtype, "cpu"))
        emit(name=f"tree-{tag}", **tree_rows(dtype, "cpu"))
        return
    llama = dict(heads=32, kv_heads=8, head_dim=128, num_sms=132)
    for name, lens, ctx in (
        ("decode64", [1] * 64, 8192),
        ("verify64", [5] * 64, 8192),
        ("prefill8k", [8192], 8192),
        ("mixed", [3, 700, 1, 9000, 40], 131072),
        ("decode1", [1], 131072),
    ):
        emit(name=f"plan-{name}", **plan_cover(lens, ctx, **llama))


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    # In parallel, as the cores allow, the longest first (float16: 46 s on 2 shared cores,
    # float32 34, bfloat16 14, plans 2).
    parts = ["float16", "float32", "bfloat16", "plans"]
    return {r["name"]: r for r in run_worker("tests.unit.test_deterministic_kernels", parts=parts)}


# The largest error against the reference, over the largest |value|. None for bfloat16: numpy
# has no bfloat16 and the interpreter's bf16 dots come out as garbage (invariantly so), so the
# values are checked on a GPU (tests/gpu/test_deterministic_cuda.py) and float16 stands in here.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": None}
# The attention forms take most of the interpreter's time (13 s a dtype for the split
# attention, 20 for chunked_attention's many forms): the split attention in float32 and float16
# (the same kernels' 16-bit paths), chunked_attention in float16 (the 16-bit path served; a
# wrong chunk merge is far past its tolerance), in bfloat16 on a GPU at Llama-3.1-8B's heads
# (tests/gpu/test_deterministic_cuda.py), where its values are real.
ATTENTION_DTYPES = ("float32", "float16")
CHUNKED_DTYPES = ("float16",)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_gemm_rows_are_invariant(results, dtype):
    for sms, bias in ((8, False), (8, True), (1, True)):
        r = results[f"gemm-{dtype}-sms{sms}-bias{bias}"]
        assert r["equal"], r
        assert TOLERANCE[dtype] is None or r["scaled"] < TOLERANCE[dtype], r
        assert (r["splits"] > 1) == (sms == 8), r


@pytest.mark.parametrize("dtype", CHUNKED_DTYPES)
def test_chunked_rows_are_invariant(results, dtype):
    r = results[f"chunked-{dtype}"]
    assert r["equal"], r
    assert r["chunks"] >= 3, r  # positions cross two chunk boundaries
    assert r["padded_zero"], r
    assert TOLERANCE[dtype] is None or r["scaled"] < TOLERANCE[dtype], r


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_tree_rows_equal_their_paths_decodes(results, dtype):
    r = results[f"tree-{dtype}"]
    assert r["equal"], r
    assert r["chain_equal"], r
    assert r["rows"] == 3 * 9, r


def test_chunk_plans_cover_every_token_within_the_workspace_budget(results):
    plans = {n: results[f"plan-{n}"] for n in ("decode64", "verify64", "prefill8k", "mixed")}
    for name, r in plans.items():
        assert r["covered"], (name, r)
        assert r["bytes"] <= r["budget"], (name, r)
    assert plans["decode64"]["launches"] == 1 and plans["decode64"]["max_chunks"] == 32
    assert plans["verify64"]["launches"] == 1  # 320 rows x 532 KB: 170 MB
    assert plans["prefill8k"]["launches"] == 17  # 504 rows fit: 31 tiles of 16 a launch
    # One row at 128K context: 512 chunks over 8 KV heads, two programs each fill 2 x 132 SMs.
    assert results["plan-decode1"]["programs"] == [33]


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_attention_rows_are_invariant(results, dtype):
    r = results[f"attention-{dtype}"]
    assert r["equal"], r
    assert TOLERANCE[dtype] is None or r["scaled"] < TOLERANCE[dtype], r
