"""Tensor parallelism on the CPU: ranks are processes joined by gloo over loopback; one model
file at TP 1 and TP N gives the same logits, and every collective a forward runs is counted."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq
from outrider.distributed import TPGroup, single
from outrider.executor.tp_workers import init_tensor_parallel, leave_process
from outrider.layers.linear import RowParallelLinear
from outrider.loaders.hf_config import TransformerConfig, check_tp_size
from outrider.models.llama import LlamaForCausalLM
from tests.tiny import outrider_model, run_forward, tiny_hf_config

BLOCK = 16

# name -> (hf config, tensor-parallel sizes it runs at)
CASES = {
    # 8 heads, 2 KV heads: both split.
    "llama": tiny_hf_config(),
    # q/k/v bias (added before the split heads' attention) and tied embeddings.
    "qwen2_tied": tiny_hf_config("Qwen2ForCausalLM", tie_word_embeddings=True, num_hidden_layers=2),
    # q/k norms per head (rotary after them, unpacked), head_dim 32 apart from hidden / heads.
    "qwen3": tiny_hf_config("Qwen3ForCausalLM", num_hidden_layers=2),
    # 4 heads, 1 KV head at TP 2: the KV head replicated on both ranks.
    "kv_replicated": tiny_hf_config(num_attention_heads=4, num_key_value_heads=1),
    # The default model's head layout (9 heads, 3 KV heads) at TP 3: one KV head per rank.
    "heads9_kv3": tiny_hf_config(
        hidden_size=144,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=288,
        vocab_size=384,
        num_hidden_layers=3,
    ),  # fmt: skip
    # 3 heads, 1 KV head at TP 3: replicated on three ranks.
    "heads3_kv1": tiny_hf_config(
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        intermediate_size=192,
        vocab_size=384,
        num_hidden_layers=2,
    ),  # fmt: skip
}
TP2 = ("llama", "qwen2_tied", "qwen3", "kv_replicated")
TP3 = ("heads9_kv3", "heads3_kv1")


def checkpoint(hf_cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights under HF's tensor names (every rank builds the same ones)."""
    cfg = TransformerConfig.from_hf_dict(hf_cfg)
    g = torch.Generator().manual_seed(seed)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": w(cfg.vocab_size, h), "model.norm.weight": norm(h)}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = w(cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
        if cfg.qk_norm:
            sd |= {p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)}
        if cfg.attention_bias:
            sd |= {
                p + "self_attn.q_proj.bias": w(q),
                p + "self_attn.k_proj.bias": w(kv),
                p + "self_attn.v_proj.bias": w(kv),
            }
    return sd


def _batch(mode: ForwardMode, rows: list[tuple[list[int], int]]) -> ScheduledBatch:
    """Sequence i computes rows[i] = (tokens, start position) in its own block (< 16 tokens)."""
    seqs = []
    for i, (ids, start) in enumerate(rows):
        req = Request(prompt_token_ids=list(ids), params=SamplingParams(temperature=0))
        seqs.append(ScheduledSeq(req, list(ids), start, [i], sample=True))
    return ScheduledBatch(mode, seqs)


def steps(vocab: int) -> list[ScheduledBatch]:
    """A prefill of two prompts (5 and 9 tokens), two decodes, then a verify of 1 + 3 tokens."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [
        _batch(ForwardMode.PREFILL, [(ids(5), 0), (ids(9), 0)]),
        _batch(ForwardMode.DECODE, [(ids(1), 5), (ids(1), 9)]),
        _batch(ForwardMode.DECODE, [(ids(1), 6), (ids(1), 10)]),
        _batch(ForwardMode.VERIFY, [(ids(4), 7), (ids(4), 11)]),
    ]


def run_steps(hf_cfg: dict, tp: TPGroup) -> list[tuple[str, torch.Tensor, dict]]:
    """(mode, logits of every row, the step's collective counts) for each of `steps`. The
    logits are computed after the forward context closes, as the runner computes them."""
    model, _pool = outrider_model(hf_cfg, checkpoint(hf_cfg), num_blocks=4, tp=tp)
    out = []
    for batch in steps(hf_cfg["vocab_size"]):
        tp.reset_counts()
        hidden = run_forward(model, batch, BLOCK)
        with torch.inference_mode():
            logits = model.compute_logits(hidden)
        out.append((batch.mode.value, logits, tp.counts()))
    return out


def row_parallel_with_bias(tp: TPGroup) -> torch.Tensor:
    """A row-parallel linear with a bias (no model here has one) on the same input."""
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(8, 96, generator=g), torch.randn(8, generator=g)
    x = torch.randn(3, 96, generator=g)
    layer = RowParallelLinear(96, 8, bias=True, tp=tp)
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.weight_loader(layer.bias, bias)
    shard = x.narrow(1, tp.rank * layer.weight.shape[1], layer.weight.shape[1])
    return layer(shard)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, size: int, *args) -> None:
    """`fn(rank, size, port, *args)` on `size` processes. The port is free when probed but
    another process may take it before rank 0 binds it: then the job is started again on a new
    port (any other failure is raised)."""
    for attempt in range(3):
        try:
            mp.spawn(_rank, args=(fn, size, _free_port(), *args), nprocs=size, join=True)
            return
        except mp.ProcessRaisedException as e:
            if "address already in use" not in str(e).lower() or attempt == 2:
                raise


def _rank(rank: int, fn, *args) -> None:
    """One spawned rank: `fn`, then the engine's ranks' own exit (tp_workers.leave_process),
    not the interpreter's teardown, which aborted a rank that had finished its work. A raised
    error still reaches mp.spawn: leave_process runs only after `fn` returned."""
    fn(rank, *args)
    leave_process(0)


def gather_from_ranks(work, size: int, out_dir: Path, *args) -> list:
    """`work(tp, *args)` on `size` ranks over gloo (work: a module-level function, so a spawned
    process can import it) -> each rank's result, in rank order."""
    spawn_ranks(_saving_rank, size, str(out_dir), work, *args)
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(size)]


def _saving_rank(rank: int, size: int, port: int, out_dir: str, work, *args) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(
        size, rank=rank, world_size=size, master_addr="127.0.0.1", master_port=port
    )
    try:
        torch.save(work(tp, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        tp.close()


def _worker(rank: int, size: int, port: int, names: tuple[str, ...], out_dir: str) -> None:
    torch.set_num_threads(1)
    if size == 3:  # as torchrun starts a rank: everything from the environment
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        tp = init_tensor_parallel()
    else:
        tp = init_tensor_parallel(
            size, rank=rank, world_size=size, master_addr="127.0.0.1", master_port=port
        )
    try:
        x = torch.full((4,), float(rank))
        tp.broadcast(x, src=1)  # outside any forward: counted as "other"
        result = {"broadcast": (x, tp.counts(), tp.rank, tp.size)}
        result |= {name: run_steps(CASES[name], tp) for name in names}
        result["row_bias"] = row_parallel_with_bias(tp)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        tp.close()


def run_tp(size: int, names: tuple[str, ...], tmp_path: Path) -> list[dict]:
    """Every rank's run_steps for each case, TP `size` over gloo."""
    spawn_ranks(_worker, size, names, str(tmp_path))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]


def assert_matches_tp1(names: tuple[str, ...], ranks: list[dict]) -> None:
    for rank, result in enumerate(ranks):
        x, counts, tp_rank, tp_size = result["broadcast"]
        assert (tp_rank, tp_size) == (rank, len(ranks))
        assert x.tolist() == [1.0] * 4
        assert counts == {"other": {"broadcast": {"calls": 1, "bytes": 16}}}
    want = row_parallel_with_bias(single())  # the bias is added once, after the sum
    for rank, result in enumerate(ranks):
        err = (result["row_bias"] - want).abs().max().item()
        assert err < 1e-5, f"row-parallel linear with bias, rank {rank}: differs by {err}"
    for name in names:
        want = run_steps(CASES[name], single())
        for mode, _, counts in want:
            assert counts == {}, f"{name}: one rank counted collectives in {mode}: {counts}"
        for rank, result in enumerate(ranks):
            for (mode, got, _), (_, ref, _) in zip(result[name], want, strict=True):
                assert got.shape == ref.shape, (name, rank, mode)
                err = (got - ref).abs().max().item()
                assert err < 1e-5, f"{name} rank {rank} {mode}: logits differ by {err}"


@pytest.mark.slow
def test_tp2_equals_tp1_and_counts_every_collective(tmp_path):
    ranks = run_tp(2, TP2, tmp_path)
    assert_matches_tp1(TP2, ranks)
    # Per forward: two all-reduces a layer (o_proj, down_proj) and the embedding's, of
    # [tokens, hidden] fp32; the LM head's all-gather of [rows, vocab] fp32 (the gathered
    # output, the planner's convention) under the same mode, though it runs after the forward.
    for name in TP2:
        cfg = TransformerConfig.from_hf_dict(CASES[name])
        for rank, result in enumerate(ranks):
            for (mode, logits, counts), batch in zip(result[name], steps(cfg.vocab_size)):
                tokens = batch.num_tokens
                assert counts == {
                    mode: {
                        "all_reduce": {
                            "calls": 2 * cfg.num_hidden_layers + 1,
                            "bytes": (2 * cfg.num_hidden_layers + 1) * tokens * cfg.hidden_size * 4,
                        },
                        "all_gather": {"calls": 1, "bytes": tokens * cfg.vocab_size * 4},
                    }
                }, f"{name} rank {rank} {mode}"
                assert logits.shape == (tokens, cfg.vocab_size)
        modes = [mode for mode, _, _ in ranks[0][name]]
        assert modes == ["prefill", "decode", "decode", "verify"]


@pytest.mark.slow
def test_tp3_with_the_default_models_head_layout_equals_tp1(tmp_path):
    ranks = run_tp(3, TP3, tmp_path)
    assert_matches_tp1(TP3, ranks)


def test_shards_hold_their_slice_and_replicated_kv_heads(tmp_path):
    """Without processes: rank r's parameters are the slices the layout says (q heads split,
    a single KV head replicated, gate/up each split, the embedding's rows split)."""
    hf = CASES["kv_replicated"]  # 4 heads, 1 KV head, head_dim 32
    sd = checkpoint(hf)
    for rank in range(2):
        model, _ = outrider_model(hf, sd, num_blocks=1, tp=TPGroup(rank, 2, group=object()))
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        qkv = attn.qkv_proj.weight
        p = "model.layers.0."
        q = sd[p + "self_attn.q_proj.weight"]
        assert torch.equal(qkv[:64], q[rank * 64 : (rank + 1) * 64])
        assert torch.equal(qkv[64:96], sd[p + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[96:], sd[p + "self_attn.v_proj.weight"])
        gate_up = model.model.layers[0].mlp.gate_up_proj.weight  # [2 * 128, hidden]
        assert torch.equal(gate_up[:128], sd[p + "mlp.gate_proj.weight"][rank * 128 :][:128])
        assert torch.equal(gate_up[128:], sd[p + "mlp.up_proj.weight"][rank * 128 :][:128])
        down = model.model.layers[0].mlp.down_proj.weight  # [hidden, 128]
        assert torch.equal(down, sd[p + "mlp.down_proj.weight"][:, rank * 128 : (rank + 1) * 128])
        emb = model.model.embed_tokens.weight
        assert torch.equal(emb, sd["model.embed_tokens.weight"][rank * 256 : (rank + 1) * 256])


def test_one_rank_is_free():
    """A group of one: no torch.distributed, collectives hand back their input, nothing counted."""
    tp = single()
    x = torch.randn(3, 4)
    assert tp.all_reduce(x) is x and tp.all_gather(x) is x and tp.broadcast(x) is x
    assert tp.counts() == {}


def test_bad_tp_sizes_name_the_fix(monkeypatch):
    default = TransformerConfig.from_hf_dict(
        tiny_hf_config(
            hidden_size=576,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
        )  # fmt: skip
    )
    with pytest.raises(
        ValueError, match=r"9 attention heads.*use tensor_parallel_size in \[1, 3\]"
    ):
        check_tp_size(default, 2)
    # TP 9 would replicate each KV head 3 times, but the vocabulary (2^14 x 3) does not split.
    with pytest.raises(ValueError, match=r"vocabulary of 49152.*\[1, 3\]"):
        check_tp_size(default, 9)
    gqa = TransformerConfig.from_hf_dict(
        tiny_hf_config(num_attention_heads=8, num_key_value_heads=4)
    )
    with pytest.raises(ValueError, match=r"4 KV heads.*\[1, 2, 4, 8\]"):
        check_tp_size(gqa, 3)
    check_tp_size(gqa, 8)  # 8 ranks: each of the 4 KV heads on 2 ranks
    # The model refuses at construction, before any weight is allocated.
    with pytest.raises(ValueError, match="use tensor_parallel_size in"):
        LlamaForCausalLM(default, tp=TPGroup(0, 2, group=object()))
    # A world of 3 processes cannot run TP 2.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not match the world size 3"):
        init_tensor_parallel(2, rank=0, world_size=3)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="launch with torchrun, or pass master_addr"):
        init_tensor_parallel(2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="needs a process group"):
        TPGroup(0, 2)


DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 10.",
)
DEFAULT_NEW_TOKENS = 20


def default_model_greedy(tp: TPGroup) -> list[list[int]]:
    """Greedy tokens of the real default model for DEFAULT_PROMPTS (chat-templated): one
    batched prefill, then batched decodes, driven through the model's forward."""
    from outrider.executor.kv_cache import KVPool
    from outrider.layers.kv_layout import KVLayout
    from outrider.loaders.checkpoint import open_checkpoint
    from outrider.models.weights import load_weights

    ckpt = open_checkpoint(None)
    cfg, tok = ckpt.config, ckpt.tokenizer
    model = LlamaForCausalLM(cfg, max_positions=256, tp=tp).float().eval()
    load_weights(model, ckpt.iter_tensors())
    kv_heads = model.attention_layers()[0].num_kv_heads
    blocks_per_seq = 4  # 64 tokens: prompt and new tokens
    pool = KVPool(
        KVLayout.multi_head(kv_heads, cfg.head_dim, torch.float32),
        cfg.num_hidden_layers,
        blocks_per_seq * len(DEFAULT_PROMPTS),
        BLOCK,
        torch.device("cpu"),
    )
    for i, attn in enumerate(model.attention_layers()):
        attn.kv_cache = pool.layer(i)
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
        )
        for p in DEFAULT_PROMPTS
    ]
    assert max(len(p) for p in prompts) + DEFAULT_NEW_TOKENS <= blocks_per_seq * BLOCK

    def step(mode: ForwardMode, rows: list[tuple[list[int], int]]) -> list[int]:
        seqs = []
        for i, (ids, start) in enumerate(rows):
            req = Request(prompt_token_ids=list(ids), params=SamplingParams(temperature=0))
            blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            seqs.append(ScheduledSeq(req, list(ids), start, blocks, sample=True))
        hidden = run_forward(model, ScheduledBatch(mode, seqs), BLOCK)
        last = torch.tensor([len(ids) for ids, _ in rows]).cumsum(0) - 1
        with torch.inference_mode():
            return model.compute_logits(hidden[last]).argmax(-1).tolist()

    out = [[t] for t in step(ForwardMode.PREFILL, [(p, 0) for p in prompts])]
    for n in range(DEFAULT_NEW_TOKENS - 1):
        rows = [([o[-1]], len(p) + n) for p, o in zip(prompts, out)]
        for o, t in zip(out, step(ForwardMode.DECODE, rows)):
            o.append(t)
    return out


@pytest.mark.slow
def test_default_model_tp3_greedy_equals_tp1(tmp_path):
    """The real default model (9 heads, 3 KV heads: one KV head per rank) split over 3 ranks
    picks TP 1's greedy tokens."""
    from outrider.loaders.checkpoint import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    want = default_model_greedy(single())
    for rank, got in enumerate(gather_from_ranks(default_model_greedy, 3, tmp_path)):
        assert got == want, f"rank {rank} diverged from TP 1"
    assert all(len(o) == DEFAULT_NEW_TOKENS for o in want)
