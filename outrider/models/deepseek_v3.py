"""DeepSeek-V3 (and Kimi-K2 / K2.5's text model, the same architecture) on the flat-batch
forward: multi-head latent attention (MLA) over a latent paged cache, first_k_dense_replace
dense layers, then routed-MoE layers with shared experts. Module names follow HF so
checkpoints map 1:1, except the packed gate/up projections and the stacked experts
(`map_weight_name`).

MLA, per token (r = kv_lora_rank, d_n / d_r / d_v = qk_nope / qk_rope / v head dims):
    q       = q_b_proj(norm(q_a_proj(x)))  or q_proj(x)      [heads, d_n + d_r]
    c, k_r  = kv_a_proj_with_mqa(x)                           [r], [d_r] (one key for all heads)
    latent  = [kv_a_layernorm(c) | rope(k_r)]                 [r + d_r]   <- the cache holds this
    k, v    = [kv_b_proj(c) nope part | k_r], kv_b_proj(c) v part   per head, from the latent
Prefill chunks expand the latents so; decode and verify absorb kv_b_proj into the queries and
outputs instead and attend over the latents themselves (`LatentAttention`).
Rotary covers only the d_r dims, in DeepSeek's interleaved pair order ((2i, 2i + 1) rotate
together; `rope_interleave`), which equals rotate-half on [evens | odds].

Routed experts may be INT4 (compressed-tensors "pack-quantized", as Kimi-K2 and K2.5 ship
them: `experts.M.{gate,up,down}_proj.weight_packed` / `weight_scale` / `weight_shape`); they
stay packed in memory (`Int4FusedExperts`). Every other weight loads unquantized. DeepSeek-V3's
own release is FP8 blocks instead (`weight` float8_e4m3fn + `weight_scale_inv`, quant_method
"fp8"): those weights are dequantized as they stream in (loaders/fp8_blocks.py), before any
name reaches `map_weight_name`, so the model holds them as plain weights in its dtype.

One file for every tensor-parallel size, as llama.py: the model takes its `TPGroup` once and
hands it to each parallel layer. A rank holds heads / tp query heads (q_b_proj or q_proj and
kv_b_proj split by heads, o_proj reducing over them); q_a_proj, kv_a_proj_with_mqa and their
norms are whole on every rank, so every rank computes and caches the same latent (the latent
cache is replicated, not split: 576 values per token per layer on each rank for Kimi-K2). The
dense MLPs, the shared experts and every routed expert split their intermediate width; the
router is whole, so every rank routes alike. Two all-reduces per layer: o_proj's, and one
after the MLP or the MoE block (routed and shared experts' partial sums added first).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from outrider.distributed import TPGroup, single
from outrider.layers import fused
from outrider.layers.activation import SiluAndMul
from outrider.layers.attention import LatentAttention
from outrider.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from outrider.layers.kv_layout import KVLayout
from outrider.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from outrider.layers.moe import (
    FUSED_MAX_TOKENS,
    FusedExperts,
    GroupedTopkRouter,
    Int4FusedExperts,
)
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import Rope, RotaryEmbedding
from outrider.loaders.hf_config import DeepseekV3Config, check_tp_size
from outrider.models.llama import PrenormDecoderLayer, run_layers
from outrider.models.protocol import ModelDefaults, WeightName
from outrider.models.weights import SKIP

# The low-rank norms use the reference's fixed epsilon, not rms_norm_eps.
_LORA_NORM_EPS = 1e-6
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\."
    r"(weight|weight_packed|weight_scale|weight_shape)$"
)
_SHARED = re.compile(r"(model\.layers\.\d+\.mlp)\.shared_experts\.(gate|up|down)_proj\.weight$")
_QUANTIZED = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point")


def latent_kv_layout(cfg: DeepseekV3Config, dtype: torch.dtype) -> KVLayout:
    """One latent per token per layer: kv_lora_rank + qk_rope_head_dim values (576 for
    DeepSeek-V3 and Kimi-K2, against 128 heads x (192 + 128) for the expanded K/V)."""
    return KVLayout.latent(cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype)


class DeepseekV3Attention(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, tp: TPGroup | None = None) -> None:
        """tp: the group the heads split over (None: one rank)."""
        super().__init__()
        tp = tp or single()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = heads // tp.size  # this rank's
        self.kv_lora_rank, self.v_head_dim = cfg.kv_lora_rank, cfg.v_head_dim
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_head_dim
        self.interleaved = cfg.rope_interleave
        self.q_lora = cfg.q_lora_rank is not None
        # q_a_proj, kv_a_proj_with_mqa and their norms take no tp: whole on every rank, so
        # each rank computes (and caches) the same latent.
        if self.q_lora:
            self.q_a_proj = ColumnParallelLinear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * self.qk_head_dim, tp=tp)
        else:
            self.q_proj = ColumnParallelLinear(h, heads * self.qk_head_dim, tp=tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            h, cfg.kv_lora_rank + self.rope_dim, bias=cfg.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LORA_NORM_EPS)
        # Outputs heads-major ([heads, d_n + d_v]): an even split of the rows is one by heads.
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, heads * (self.nope_dim + self.v_head_dim), tp=tp
        )
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, h, bias=cfg.attention_bias, tp=tp)
        self.attn = LatentAttention(self.num_heads, self.v_head_dim, cfg.softmax_scale)
        # Both projections of the layer's input in one GEMM (after_load): [q_a_proj or this
        # rank's q_proj rows | kv_a_proj_with_mqa], whose weights become views of it.
        self.input_proj: torch.Tensor | None = None

    def after_load(self) -> None:
        first, kv_a = self.q_a_proj if self.q_lora else self.q_proj, self.kv_a_proj_with_mqa
        if first.bias is not None or kv_a.bias is not None:
            return  # biased projections keep their own GEMMs
        w = torch.cat([first.weight, kv_a.weight])
        first.weight.data, kv_a.weight.data = w[: first.weight.shape[0]], w[first.weight.shape[0] :]
        self.input_proj = w

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        first = self.q_a_proj if self.q_lora else self.q_proj
        if self.input_proj is not None:
            q, kv = F.linear(hidden, self.input_proj).split(
                [first.weight.shape[0], self.kv_lora_rank + self.rope_dim], dim=-1
            )
        else:
            q, kv = first(hidden), self.kv_a_proj_with_mqa(hidden)  # kv: [T, r + d_r]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.num_heads, self.qk_head_dim)
        if rope.fused:
            # One launch: the latent's norm and both rotaries, q's in place, and on absorbed
            # steps the latents' store into the cache.
            norm = self.kv_a_layernorm
            sink = self.attn.latent_sink()
            latent = fused.mla_prep_(
                q, kv, norm.weight, norm.eps, rope.positions, rope.cos, rope.sin,
                self.interleaved, sink,
            )  # fmt: skip
            q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
            out = self.attn(
                q_nope, q_pe, latent, self.expand, self.absorbed, written=sink is not None
            )
            return self.o_proj(out)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())  # [T, r]
        k_pe = k_pe.unsqueeze(1)  # [T, 1, d_r]: one rotary key shared by every head
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = RotaryEmbedding.apply(rope, q_pe, k_pe)
        latent = torch.cat([c_kv, k_pe.squeeze(1)], dim=-1)  # [T, r + d_r]
        return self.o_proj(self.attn(q_nope, q_pe, latent, self.expand, self.absorbed))

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents [n, r + d_r] -> keys [n, heads, d_n + d_r], values [n, heads, d_v]."""
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(-1, self.num_heads, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)], dim=-1)
        return k, v

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight ([heads * (d_n + d_v), r], this rank's heads) split per head for
        attention in the latent space: W_UK [heads, d_n, r] (q_nope @ W_UK is a latent-space
        query) and W_UV [heads, d_v, r] (out_lat @ W_UV^T lifts an output back). Views: no
        copy, and they always follow the loaded weight."""
        w = self.kv_b_proj.weight.view(
            self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank
        )
        return w[:, : self.nope_dim], w[:, self.nope_dim :]


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ... | x1, x3, ...]: interleaved rotary pairs become
    rotate-half pairs (i, i + d / 2). q and k are permuted alike, so q . k is unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepseekV3MLP(nn.Module):
    """SwiGLU MLP: the dense layers' and the shared experts' (reduce=False: this rank's
    partial sum, which the MoE block reduces with the routed experts')."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], tp=tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp=tp, reduce=reduce)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DeepseekV3MoE(nn.Module):
    """Routed experts plus shared experts. Unquantized, the shared MLP (width n_shared x
    moe_intermediate_size) is held as n_shared more experts in the routed experts' stack, which
    the router names for every token: one pair of grouped GEMMs runs both. INT4 routed experts
    keep a separate bf16 shared MLP, whose output the experts' weighted sum adds."""

    def __init__(self, cfg: DeepseekV3Config, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        folded = cfg.n_shared_experts if cfg.expert_quant is None else 0
        self.gate = GroupedTopkRouter(
            cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group,
            cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, always=folded,
        )  # fmt: skip
        sizes = (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = None
        if cfg.expert_quant is None:
            self.experts = FusedExperts(*sizes, tp=tp, num_shared=folded)
        else:
            self.experts = Int4FusedExperts(*sizes, cfg.expert_quant.group_size, tp=tp)
            self.shared_experts = DeepseekV3MLP(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, tp,
                reduce=False,
            )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] * (self.gate.top_k + self.gate.always)
        # the same on every rank
        weights, ids, layout = self.gate.route(x, self.experts.reads_layout(rows))
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        # Both partial sums over this rank's slice of the intermediate width; one all-reduce.
        return self.tp.all_reduce(self.experts(x, weights, ids, add=shared, layout=layout))


class DeepseekV3DecoderLayer(PrenormDecoderLayer):
    def __init__(self, cfg: DeepseekV3Config, index: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(cfg, tp)
        if index < cfg.first_k_dense_replace:
            self.mlp = DeepseekV3MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        else:
            self.mlp = DeepseekV3MoE(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, max_positions: int, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers)
        )
        self.rotary_emb = RotaryEmbedding(
            cfg.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rope = self.rotary_emb.lookup(positions)
        return run_layers(self.layers, self.norm, self.embed_tokens(input_ids), rope, aux_layers)


class DeepseekV3ForCausalLM(ModelDefaults):
    """Satisfies `outrider.models.protocol.CausalLM`."""

    config_class = DeepseekV3Config
    # CUDA graphs capture steps of at most this many tokens (what the fused MoE serves).
    graph_max_tokens = FUSED_MAX_TOKENS
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(
        self, cfg: DeepseekV3Config, max_positions: int | None = None, tp: TPGroup | None = None
    ) -> None:
        """tp: the tensor-parallel group this model is split over (None: one rank)."""
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or single()
        check_tp_size(cfg, tp.size)
        self.model = DeepseekV3Model(cfg, max_positions or cfg.max_position_embeddings, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [num_tokens] -> final hidden [num_tokens, hidden] and the
        residual stream entering each layer in `aux_layers`."""
        return self.model(input_ids, positions, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, vocab], whole on every rank

    @property
    def tie_word_embeddings(self) -> bool:
        return self.config.tie_word_embeddings

    @property
    def graph_safe(self) -> bool:
        """Whether decode and verify forwards read nothing on the host, as CUDA graphs need:
        attention and the router never do; the MoE's reference loop reads which experts were
        hit (CPU, or dtypes the fused kernel does not take), its fused path (CUDA, steps of at
        most graph_max_tokens) does not. True iff every MoE layer takes the fused path."""
        dtype = self.model.embed_tokens.weight.dtype  # the activations'
        return all(
            layer.mlp.experts.fused_serves(dtype)
            for layer in self.model.layers
            if isinstance(layer.mlp, DeepseekV3MoE)
        )

    def attention_layers(self) -> list[LatentAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """The whole latent on every rank, whatever the tensor-parallel size."""
        return latent_kv_layout(self.config, dtype)

    def map_weight_name(self, name: str) -> WeightName:
        """Checkpoint name -> what models/weights.py loads: the text model's names without a
        multimodal wrapper's prefix (other towers skipped), multi-token-prediction layers past
        num_hidden_layers skipped, per-expert tensors into the stacked experts."""
        prefix = self.config.weight_prefix
        if prefix:
            if not name.startswith(prefix):
                return SKIP  # Kimi-K2.5's vision tower and projector
            name = name[len(prefix) :]
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
            return SKIP  # DeepSeek-V3's MTP module (layer 61), not served
        expert = _EXPERT.match(name)
        quantized = self.config.expert_quant is not None
        if expert:
            stacked, index, part, kind = expert.groups()
            if (kind != "weight") != quantized:
                raise ValueError(
                    f"checkpoint tensor {name} is {'un' if quantized else ''}quantized but "
                    f"config.json's quantization_config says the routed experts are "
                    f"{'INT4' if quantized else 'unquantized'}: the config does not match "
                    f"the weights"
                )
            if kind == "weight_shape":
                return SKIP  # (out, in): the packed and scale shapes are checked on load
            param = "down_proj" if part == "down" else "gate_up_proj"
            suffix = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale"}[kind]
            return f"{stacked}.{param}{suffix}", (int(index), part)
        shared = _SHARED.match(name)
        if shared and not quantized:  # held in the routed experts' stack (DeepseekV3MoE)
            mlp, part = shared.groups()
            param = "down_proj" if part == "down" else "gate_up_proj"
            return f"{mlp}.experts.{param}", ("shared", part)
        if name.endswith(_QUANTIZED):
            raise ValueError(
                f"checkpoint tensor {name} is INT4-packed: outrider loads INT4 weights for the "
                f"routed experts only (as Kimi-K2 ships them), with attention, shared experts, "
                f"dense MLPs and lm_head unquantized (the quantization_config's ignore list), "
                f"and never beside FP8 blocks"
            )
        return name
