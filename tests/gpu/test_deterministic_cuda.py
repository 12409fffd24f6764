"""The deterministic mode on CUDA (issue 38): a row's bits do not depend on the batch.

- the batch-invariant GEMM and attention at Llama-3.1-8B's shapes (the checks of
  tests/unit/test_deterministic_kernels.py, on the GPU, in bfloat16): split attention with
  256-key chunks at contexts 1..8192, rows on both sides of chunk boundaries, decode batches
  of 2..64, chain verifies, chunked and whole prefills, cut launches;
- CUDA graphs of the split attention (decode and a 4-token chain verify, 16 sequences),
  captured once for max_model_len 8192, replay any context with an eager call's bits;
- a Llama-3.1-8B-shaped model (hidden 4096, intermediate 14336, 32 heads / 8 KV heads, vocab
  128256, two layers of random bf16 weights): the logits of one row are bitwise equal computed
  as a decode alone, in decode batches of 2..64, as a row of chain verifies of 1 + 3 tokens in
  batches of 1..64, and as the last row of a prefill chunk;
- tree verifies at Llama-3.1-8B's heads: each node's row equals the decode of its path;
- the default model in bf16: greedy speculative output (n-gram, an EAGLE-3 chain and tree)
  equals plain output, and batched output equals each prompt alone.
"""

from __future__ import annotations

import pytest
import torch

from outrider.core import ForwardMode
from tests.unit.test_deterministic_kernels import attention_rows, chunked_rows, gemm_rows

pytestmark = pytest.mark.gpu

# (N, K) of every Llama-3.1-8B GEMM: qkv, o_proj, gate_up, down, lm_head.
LLAMA8B_GEMMS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
# The default model's and its drafter's: narrow small-weight tiles, the wide LM head's, the
# drafter's middle-sized one.
DEFAULT_GEMMS = [(960, 576), (576, 1536), (576, 1728), (49152, 576), (16384, 576)]
BATCHES = (1, 2, 3, 4, 5, 8, 13, 16, 32, 48, 64)
LLAMA8B_ATTENTION = dict(heads=32, kv_heads=8, head_dim=128)


@pytest.mark.parametrize(("n", "k"), LLAMA8B_GEMMS + DEFAULT_GEMMS)
def test_gemm_rows_invariant_at_real_shapes(n, k):
    out = gemm_rows(BATCHES + (320, 2048), n, k, torch.bfloat16, "cuda", bias=False)
    assert out["equal"], out
    assert out["scaled"] < 1e-2, out


def test_attention_rows_invariant_at_llama8b_heads():
    out = attention_rows(
        torch.bfloat16, "cuda", **LLAMA8B_ATTENTION, context=8192,
        positions=(40, 255, 256, 257, 511, 4096, 8150),
    )  # fmt: skip
    assert out["equal"], out
    assert out["scaled"] < 2e-2, out


def test_chunked_rows_invariant_at_llama8b_heads():
    g = torch.Generator().manual_seed(3)
    edges = [1, 2, 255, 256, 257, 511, 512, 513]
    others = edges + torch.randint(1, 8193, (63 - len(edges),), generator=g).tolist()
    out = chunked_rows(
        torch.bfloat16, "cuda", **LLAMA8B_ATTENTION, contexts=(8192, *others),
        positions=(0, 1, 254, 255, 256, 257, 511, 512, 1000, 4095, 4096, 8100, 8188),
        batches=(2, 3, 5, 8, 16, 32, 48, 64), chunk_keys=256, sms=(132, 1),
    )  # fmt: skip
    assert out["equal"], out
    assert out["scaled"] < 2e-2, out


@pytest.mark.parametrize("tokens_per_seq", [1, 4])
def test_chunked_attention_graph_replays_any_context(tokens_per_seq):
    from outrider.layers.attn_backends.triton_chunked import (
        ChunkWorkspace,
        chunked_attention,
        plan_chunks,
    )

    heads, kv_heads, head_dim = 32, 8, 128
    batch, block_size, max_len, t = 16, 16, 8192, tokens_per_seq
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    pages = max_len // block_size
    k_cache = torch.randn(batch * pages + 1, block_size, kv_heads, head_dim, device=dev).to(bf16)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(batch * pages, device=dev) + 1).view(batch, pages).to(torch.int32)
    q = torch.randn(batch * t, heads, head_dim, device=dev).to(bf16)
    seq_lens = torch.full((batch,), t, dtype=torch.int32, device=dev)
    starts = (torch.arange(batch + 1, device=dev) * t).to(torch.int32)
    plan = plan_chunks([t] * batch, max_len, heads, kv_heads, head_dim, bf16, sms)
    workspace = ChunkWorkspace.allocate(plan, heads, head_dim, dev)

    def attend(p):
        return chunked_attention(
            q, k_cache, v_cache, tables, seq_lens, starts, p, head_dim**-0.5, workspace
        )

    attend(plan)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(plan)
    g = torch.Generator().manual_seed(5)
    edges = [t, 255, 256, 257, 512, 513, 4096, max_len]
    for trial in range(4):
        lens = edges + torch.randint(t, max_len + 1, (batch - len(edges),), generator=g).tolist()
        lens = lens[trial:] + lens[:trial]
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        want = chunked_attention(
            q, k_cache, v_cache, tables, seq_lens, starts,
            plan_chunks([t] * batch, max(lens), heads, kv_heads, head_dim, bf16, sms),
            head_dim**-0.5,
        )  # fmt: skip
        assert torch.equal(out, want), f"replay at contexts {lens}"


def _llama8b(layers: int = 2, block_size: int = 16, num_blocks: int = 64 * 64 + 1):
    from outrider.device import default_dtype
    from outrider.executor.kv_cache import KVPool
    from outrider.layers.attn_backends.base import get_backend
    from outrider.loaders.hf_config import TransformerConfig
    from outrider.models.deterministic import make_batch_invariant
    from outrider.models.registry import model_class

    cfg = TransformerConfig.from_hf_dict(
        dict(
            architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
            rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, hidden_act="silu",
        )
    )  # fmt: skip
    device = torch.device("cuda")
    with torch.device(device), default_dtype(torch.bfloat16):
        model = model_class(cfg.architecture)(cfg, max_positions=4096)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=device))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g, device=device))
    model.eval()
    make_batch_invariant(model)
    attention = model.attention_layers()
    pool = KVPool(model.kv_layout(torch.bfloat16), len(attention), num_blocks, block_size, device)
    for i, attn in enumerate(attention):
        attn.kv_cache = pool.layer(i)
    return model, get_backend("triton", "cuda", deterministic=True), block_size


def _logits(model, backend, block_size, rows, mode: ForwardMode, pages: int = 64) -> torch.Tensor:
    """rows: (sequence, first position, token ids): each computes its tokens' KV at their
    positions (sequence s owns blocks s * pages + 1 ..), as one forward -> logits [tokens, V]."""
    from outrider.layers.forward_context import AttentionMetadata, ForwardContext, forward_context

    ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
    for s, first, toks in rows:
        p = torch.arange(first, first + len(toks))
        blocks = torch.arange(pages) + s * pages + 1
        ids.append(torch.tensor(toks)), pos.append(p)
        slots.append(blocks[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + len(toks))
        lens.append(first + len(toks))
        tables.append(blocks)
    dev = torch.device("cuda")
    meta = AttentionMetadata(
        mode, torch.cat(slots).to(dev), torch.tensor(starts, dtype=torch.int32, device=dev),
        torch.tensor(lens, dtype=torch.int32, device=dev),
        torch.stack(tables).to(torch.int32).to(dev), [len(t) for _, _, t in rows], lens,
    )  # fmt: skip
    backend.prepare(meta)
    with torch.inference_mode(), forward_context(ForwardContext(meta, backend)):
        hidden, _ = model(torch.cat(ids).to(dev), torch.cat(pos).to(dev))
        return model.compute_logits(hidden)


def test_llama8b_row_logits_invariant_in_decode_and_verify():
    model, backend, bs = _llama8b()
    g = torch.Generator().manual_seed(1)
    ctx = [int(n) for n in torch.randint(40, 1000, (64,), generator=g)]  # up to 4 chunks
    prompts = [torch.randint(0, 128256, (n + 4,), generator=g).tolist() for n in ctx]
    for s in range(64):  # every sequence's context, prefilled alone
        _logits(model, backend, bs, [(s, 0, prompts[s][: ctx[s]])], ForwardMode.PREFILL)
    a = 0  # the row under test: sequence 0's token at position ctx[0]

    def decode_row(batch: int) -> torch.Tensor:
        rows = [(s, ctx[s], [prompts[s][ctx[s]]]) for s in range(batch)]
        return _logits(model, backend, bs, rows, ForwardMode.DECODE)[a]

    def verify_rows(batch: int) -> torch.Tensor:
        rows = [(s, ctx[s], prompts[s][ctx[s] : ctx[s] + 4]) for s in range(batch)]
        return _logits(model, backend, bs, rows, ForwardMode.VERIFY)[:4]  # sequence 0's rows

    alone = decode_row(1)
    for batch in BATCHES[1:]:
        assert torch.equal(decode_row(batch), alone), f"decode batch {batch}"
    chain = verify_rows(1)
    assert torch.equal(chain[0], alone), "verify row 0 against the decode"
    for batch in BATCHES[1:]:
        assert torch.equal(verify_rows(batch), chain), f"verify batch {batch}"
    # Verify row 2 (position ctx + 2) against decodes that walk there token by token.
    for j in range(1, 3):
        row = [(a, ctx[a] + j, [prompts[a][ctx[a] + j]])]
        step = _logits(model, backend, bs, row, ForwardMode.DECODE)[0]
        assert torch.equal(step, chain[j]), f"verify row {j} against its decode"
    # The last row of a prefill chunk that ends at position ctx[0].
    row = [(a, ctx[a] - 20, prompts[a][ctx[a] - 20 : ctx[a] + 1])]
    chunk = _logits(model, backend, bs, row, ForwardMode.PREFILL)
    assert torch.equal(chunk[-1], alone), "prefill chunk row against the decode"


def test_tree_rows_equal_their_paths_decodes_at_llama8b_heads():
    from tests.unit.test_deterministic_kernels import tree_rows

    out = tree_rows(
        torch.bfloat16, "cuda", **LLAMA8B_ATTENTION, roots=(250, 4090, 7),
        chunk_keys=256, sms=132,
    )  # fmt: skip
    assert out["equal"] and out["chain_equal"], out


def _default_model_or_skip():
    try:
        from outrider.env import default_model
        from outrider.loaders.checkpoint import open_checkpoint

        open_checkpoint(default_model())  # OUTRIDER_MODEL first, as LLM() takes it
    except (ImportError, FileNotFoundError, ValueError) as e:
        pytest.skip(f"the default model is not installed: {e}")


@pytest.mark.parametrize("method", ["ngram", "eagle3", "eagle3_tree"])
def test_default_model_bf16_speculative_equals_plain(method, request):
    from outrider import LLM, SamplingParams
    from outrider.bench.datasets import GROUNDED, OPEN

    _default_model_or_skip()
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:8] + OPEN[:8]]
    params = SamplingParams(temperature=0, max_tokens=128)
    common = dict(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, deterministic=True)
    plain = LLM(**common)
    want = [o.token_ids for o in plain.chat(convs, params)]
    alone = [plain.chat([c], params)[0].token_ids for c in convs[:4]]
    assert alone == want[:4], "batched plain output differs from alone"
    del plain
    spec = {"method": method.removesuffix("_tree"), "controller": "fixed", "num_draft_tokens": 4}
    if method.startswith("eagle3"):
        spec["draft"] = request.getfixturevalue("drafter_path")
    if method == "eagle3_tree":
        spec.update(topk=3, num_steps=3)  # a tree of 4 nodes, as test_eagle3_cuda.py grows
    llm = LLM(**common, speculative=spec)
    outs = llm.chat(convs, params)
    same = sum(o.token_ids == w for o, w in zip(outs, want))
    assert same == len(want), f"{same}/{len(want)} speculative outputs equal plain"
    assert llm.engine.speculator.stats.num_verify_steps > 0
