"""DeepSeek-V3 (MLA + routed MoE) equals HF transformers on the same checkpoint (fp32): chunked
prefill, decode, chain and tree verify, greedy generation, n-gram speculation; the latent KV
cache holds kv_lora_rank + qk_rope_head_dim values per token per layer."""

import json
import shutil

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.core import ForwardMode, Request, ScheduledBatch, ScheduledSeq
from outrider.executor.kv_cache import KVPool
from outrider.loaders.checkpoint import open_checkpoint
from outrider.loaders.hf_config import DeepseekV3Config
from outrider.models.deepseek_v3 import latent_kv_layout
from outrider.models.registry import model_class
from outrider.models.weights import load_weights
from outrider.speculative.base import SeqDrafts
from tests.tiny import run_forward
from tests.unit.test_spec_engine import OracleProposer

VOCAB = 512
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 0.8,
}  # fmt: skip
VARIANTS = {
    # q through a low-rank projection, plain rope
    "q_lora": dict(q_lora_rank=48),
    # q_proj straight from the hidden state; YaRN (softmax scale and cos/sin scaled)
    "q_proj_yarn": dict(q_lora_rank=None, rope_parameters=YARN, max_position_embeddings=128),
}
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _hf_config(**over):
    from transformers import DeepseekV3Config as HFConfig

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    kw.update(over)
    return HFConfig(**kw)


def _hf_model(config, seed=0):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection differs from the scores'
                b.copy_(0.1 * torch.randn_like(b))
    return model


def _save_tokenizer(path):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 8, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_ds(request, tmp_path_factory):
    """(checkpoint dir saved by transformers, the transformers model)."""
    path = tmp_path_factory.mktemp(f"tiny-ds3-{request.param}")
    ref = _hf_model(_hf_config(**VARIANTS[request.param]))
    ref.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return path, ref


def _outrider(path, num_blocks=32, block_size=16):
    ckpt = open_checkpoint(path)
    model = model_class(ckpt.config.architecture)(ckpt.config).float().eval()
    load_weights(model, ckpt.iter_tensors())
    layers = model.attention_layers()
    pool = KVPool(model.kv_layout(torch.float32), len(layers), num_blocks, block_size, "cpu")
    for i, attn in enumerate(layers):
        attn.kv_cache = pool.layer(i)
    return model, pool


def _seq(ids, tokens, start, blocks, drafts=None):
    req = Request(prompt_token_ids=list(ids), params=SamplingParams(temperature=0))
    return ScheduledSeq(req, list(tokens), start, blocks, sample=True, drafts=drafts)


def _logits(model, mode, seqs):
    return model.compute_logits(run_forward(model, ScheduledBatch(mode, seqs)))


def _hf_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def _hf_greedy(ref, prompts, max_new_tokens):
    """transformers' greedy continuation of each prompt (ids), one at a time."""
    want = []
    for ids in prompts:
        with torch.inference_mode():
            out = ref.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False,
            )  # fmt: skip
        want.append(out[0, len(ids) :].tolist())
    return want


def test_chunked_prefill_decode_and_verify_match_hf(tiny_ds):
    path, ref = tiny_ds
    model, _ = _outrider(path)
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (40, 21))
    a_blocks, b_blocks = [0, 1, 2, 3], [4, 5, 6]
    want_a, want_b = _hf_logits(ref, a), _hf_logits(ref, b)
    # 1. Chunked prefill: a in chunks of 16, 16 and 8 (the later ones read earlier chunks'
    #    latents from the cache); b whole beside a's first chunk.
    got = _logits(
        model, ForwardMode.PREFILL, [_seq(a, a[:16], 0, a_blocks), _seq(b, b, 0, b_blocks)]
    )
    assert (got[:16] - want_a[:16]).abs().max() < 1e-3
    assert (got[16:] - want_b).abs().max() < 1e-3
    for lo, hi in ((16, 32), (32, 40)):
        got = _logits(model, ForwardMode.PREFILL, [_seq(a, a[lo:hi], lo, a_blocks)])
        assert (got - want_a[lo:hi]).abs().max() < 1e-3
    # 2. Decode: one token each, batched (the padded one-pass path).
    ta, tb = 7, 9
    got = _logits(
        model, ForwardMode.DECODE, [_seq(a, [ta], 40, a_blocks), _seq(b, [tb], 21, b_blocks)]
    )
    assert (got[0] - _hf_logits(ref, a + [ta])[-1]).abs().max() < 1e-3
    assert (got[1] - _hf_logits(ref, b + [tb])[-1]).abs().max() < 1e-3
    a, b = a + [ta], b + [tb]
    # 3. Verify: a checks a chain of 3 drafts; b a tree (root r; n0, n1 children of r; n2 of
    #    n0), each node seeing only its ancestors. Every row's logits == HF on its path.
    chain = [11, 12, 13]
    tree = SeqDrafts([21, 22, 23], [-1, -1, 0])
    got = _logits(
        model, ForwardMode.VERIFY,
        [_seq(a, [5] + chain, 41, a_blocks, SeqDrafts.chain(chain)),
         _seq(b, [6] + tree.token_ids, 22, b_blocks, tree)],
    )  # fmt: skip
    want = _hf_logits(ref, a + [5] + chain)[-4:]
    assert (got[:4] - want).abs().max() < 1e-3
    paths = [[6], [6, 21], [6, 22], [6, 21, 23]]
    for row, path in zip(got[4:], paths):
        assert (row - _hf_logits(ref, b + path)[-1]).abs().max() < 1e-3


def test_greedy_generation_and_ngram_speculation_equal_hf(tiny_ds):
    path, ref = tiny_ds
    g = torch.Generator().manual_seed(3)
    # Repeating prompts give n-gram lookup something to draft.
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 17)]
    prompts.append(prompts[1] * 3)
    want = _hf_greedy(ref, prompts, 12)
    plain = LLM(str(path), dtype="float32", device="cpu", num_blocks=64)
    assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == want
    spec = LLM(
        str(path), dtype="float32", device="cpu", num_blocks=64,
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 4},
    )  # fmt: skip
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want
    assert spec.engine.speculator.stats.num_verify_steps > 0
    pool = spec.engine.runner.kv_pool
    assert list(pool.tensors) == ["latent"] and pool.tensors["latent"].shape[-1] == 32 + 8
    # Drafts that are right: a random model rarely repeats itself, so an oracle drafts its own
    # greedy continuation, as a chain and as a tree (wrong sibling first: the accepted nodes'
    # latents move into path order).
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    for tree in (False, True):
        spec.engine.speculator.use_proposer(
            OracleProposer({tuple(p): w for p, w in zip(prompts, want)}, tree)
        )
        outs = spec.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        for o in outs:  # every right draft accepted (a tree's wrong siblings never)
            m = o.metrics
            right = m["num_draft_tokens"] // 2 - 1 if tree else m["num_draft_tokens"]
            assert m["num_accepted_tokens"] >= right and m["num_accepted_tokens"] >= 4


def test_latent_cache_bytes_per_token_at_real_ranks():
    """DeepSeek-V3 / Kimi-K2 ranks: (512 + 64) x 2 bytes per token per layer in bf16, not the
    expanded K/V (128 heads x (192 + 128) x 2 = 81,920 bytes)."""
    real = dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096},
    )  # fmt: skip
    cfg = DeepseekV3Config.from_hf_dict(real)
    layout = latent_kv_layout(cfg, torch.bfloat16)
    assert layout.bytes_per_token == (512 + 64) * 2
    # YaRN's mscale(40, 1.0)^2 scales the softmax: 0.1 ln 40 + 1 = 1.3689 -> 1.8739 / sqrt(192).
    assert cfg.softmax_scale == pytest.approx(
        (0.1 * torch.tensor(40.0).log().item() + 1) ** 2 / 192**0.5
    )


def test_kimi_k25_nesting_loads_the_text_model(tiny_ds, tmp_path):
    """A multimodal wrapper (config text_config, weights under language_model.) serves its text
    model: same logits, the vision tower's tensors skipped."""
    from safetensors.torch import load_file, save_file

    path, ref = tiny_ds
    text = json.loads((path / "config.json").read_text())
    wrapped = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": {"hidden_size": 8}, "eos_token_id": 2,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    tensors = {f"language_model.{k}": v for k, v in load_file(path / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    model, _ = _outrider(tmp_path)
    ids = list(range(5, 25))
    got = _logits(model, ForwardMode.PREFILL, [_seq(ids, ids, 0, [0, 1])])
    assert (got - _hf_logits(ref, ids)).abs().max() < 1e-3


def test_stacked_expert_checkpoints_load(tiny_ds, tmp_path):
    """Experts saved stacked ([E, 2I, H] gate then up, [E, H, I]) load as per-expert ones do."""
    import re

    from safetensors.torch import load_file, save_file

    path, ref = tiny_ds
    tensors = load_file(path / "model.safetensors")
    stacked = {}
    for name in list(tensors):
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:
            stacked.setdefault(m[1], {})[(int(m[2]), m[3])] = tensors.pop(name)
    for prefix, parts in stacked.items():
        experts = range(1 + max(e for e, _ in parts))
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in experts]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in experts])
    save_file(tensors, tmp_path / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    model, _ = _outrider(tmp_path)
    ids = list(range(5, 25))
    got = _logits(model, ForwardMode.PREFILL, [_seq(ids, ids, 0, [0, 1])])
    assert (got - _hf_logits(ref, ids)).abs().max() < 1e-3


def test_router_matches_hf_with_correction_bias():
    """Selection uses the biased scores, weights the unbiased ones; group-limited."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from outrider.layers.moe import GroupedTopkRouter

    config = _hf_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    hf = DeepseekV3TopkRouter(config)
    torch.manual_seed(5)
    with torch.no_grad():
        hf.weight.normal_()
        hf.e_score_correction_bias.copy_(torch.randn(16))  # large: it changes the choice
    ours = GroupedTopkRouter(64, 16, 4, 4, 2, True, config.routed_scaling_factor)
    ours.load_state_dict(
        {"weight": hf.weight, "e_score_correction_bias": hf.e_score_correction_bias}
    )
    x = torch.randn(50, 64)
    outs = hf(x)  # (logits, weights, ids) here; other transformers versions order them apart
    want_ids = next(t for t in outs if t.dtype == torch.int64)
    want_w = next(t for t in outs if t.is_floating_point() and t.shape == want_ids.shape)
    got_w, got_ids = ours(x)
    order_w, order_g = want_ids.argsort(-1), got_ids.argsort(-1)
    assert torch.equal(want_ids.gather(1, order_w), got_ids.gather(1, order_g))
    assert torch.allclose(want_w.gather(1, order_w), got_w.gather(1, order_g), atol=1e-6)
    # The bias decides: without it some tokens pick other experts.
    ours.e_score_correction_bias.zero_()
    assert not torch.equal(ours(x)[1].sort(-1).values, got_ids.sort(-1).values)


def test_config_missing_a_field_names_it():
    d = json.loads(json.dumps(_hf_config().to_dict()))
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    del d["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeepseekV3Config.from_hf_dict(d)
    d = json.loads(json.dumps(_hf_config().to_dict()))
    d.update(architectures=["DeepseekV3ForCausalLM"], n_routed_experts=9)
    with pytest.raises(ValueError, match="n_routed_experts=9"):
        DeepseekV3Config.from_hf_dict(d)
    # Quantized weights would load as garbage without their scales: refused by name.
    d.update(n_routed_experts=8, quantization_config={"quant_method": "compressed-tensors"})
    with pytest.raises(ValueError, match="compressed-tensors"):
        DeepseekV3Config.from_hf_dict(d)


def test_a_checkpoint_that_is_no_drafter_is_refused_by_the_doctor(tiny_ds):
    # EAGLE-3 serves this family (test_deepseek_v3_eagle3.py); the target's own checkpoint,
    # passed as the drafter, fails the doctor's checks before anything is built.
    with pytest.raises(ValueError, match="(?s)refusing EAGLE-3 drafter.*second decoder layer"):
        LLM(str(tiny_ds[0]), dtype="float32", device="cpu", num_blocks=8,
            speculative={"method": "eagle3", "draft": str(tiny_ds[0])})  # fmt: skip


def test_auto_backend_serves_the_latent_cache():
    pytest.importorskip("triton")
    from outrider.layers.attn_backends.base import get_backend

    assert get_backend("auto", "cuda", latent=True).name == "triton"
    assert get_backend("triton", "cuda", latent=True).supports_latent
    assert get_backend("auto", "cpu", latent=True).name == "torch_ref"


def test_both_input_projections_load_into_one_gemms_weight(tiny_ds):
    """After loading, q_a_proj (or q_proj) and kv_a_proj_with_mqa are views of one weight that
    a single GEMM reads (DeepseekV3Attention.after_load), holding the checkpoint's values."""
    model, _ = _outrider(tiny_ds[0])
    for layer, hf_layer in zip(model.model.layers, tiny_ds[1].model.layers):
        attn, hf = layer.self_attn, hf_layer.self_attn
        first, hf_first = (attn.q_a_proj, hf.q_a_proj) if attn.q_lora else (attn.q_proj, hf.q_proj)
        w = attn.input_proj
        want = torch.cat([hf_first.weight, hf.kv_a_proj_with_mqa.weight]).float()
        assert w is not None and torch.equal(w, want)
        assert first.weight.data_ptr() == w.data_ptr()
        assert attn.kv_a_proj_with_mqa.weight.data_ptr() == w[len(first.weight) :].data_ptr()


def test_graph_safe_iff_every_moe_layer_takes_the_fused_path(tiny_ds, monkeypatch):
    from outrider.layers import moe_fused

    model, _ = _outrider(tiny_ds[0])
    assert not model.graph_safe  # CPU: the experts' reference loop reads the host
    seen = []

    def serves(device, dtype):
        seen.append((device.type, dtype))
        return True

    monkeypatch.setattr(moe_fused, "moe_gemm_serves", serves)
    assert model.graph_safe
    assert seen == [("cpu", torch.float32)] * 2  # layers 1 and 2 (layer 0 is dense)
    monkeypatch.setattr(moe_fused, "moe_gemm_serves", lambda device, dtype: dtype != torch.float32)
    assert not model.graph_safe


def test_moe_gemm_serves_cuda_in_model_dtypes(monkeypatch):
    pytest.importorskip("triton")
    from outrider.layers import moe_fused

    cuda = torch.device("cuda")
    assert all(moe_fused.moe_gemm_serves(cuda, d) for d in (torch.bfloat16, torch.float16))
    assert moe_fused.moe_gemm_serves(cuda, torch.float32)
    assert not moe_fused.moe_gemm_serves(torch.device("cpu"), torch.bfloat16)
    assert not moe_fused.moe_gemm_serves(cuda, torch.float8_e4m3fn)
    monkeypatch.setenv("OUTRIDER_FUSED_KERNELS", "0")
    assert not moe_fused.moe_gemm_serves(cuda, torch.bfloat16)


def test_graphs_refused_past_the_models_step_limit():
    """Graph steps past graph_max_tokens would meet the MoE's host read while capturing: off
    when graphs are automatic, a clear error when asked for."""
    from types import SimpleNamespace

    from outrider.config import EngineConfig, ModelConfig, SpecConfig
    from outrider.executor.model_runner import ModelRunner

    runner = SimpleNamespace(
        model=SimpleNamespace(graph_safe=True, graph_max_tokens=1024),
        spec_ks=(16,), device=torch.device("cuda"), tp=SimpleNamespace(size=1),
        backend=SimpleNamespace(
            name="triton", graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.VERIFY})
        ),
        model_config=SimpleNamespace(architecture="DeepseekV3ForCausalLM"),
        _graph_batch_sizes=lambda: (1, 2, 4, 64),
    )  # fmt: skip
    spec = SpecConfig(method="ngram", num_draft_tokens=16)  # 64 x 17 = 1088 tokens
    auto = EngineConfig(model=ModelConfig(cuda_graphs=None), speculative=spec)
    runner.config = auto
    assert ModelRunner.graph_runner(runner) is None
    runner.config = EngineConfig(model=ModelConfig(cuda_graphs=True), speculative=spec)
    limit = "graph steps of up to 1088 tokens, the model's limit 1024"
    with pytest.raises(ValueError, match=limit):
        ModelRunner.graph_runner(runner)
