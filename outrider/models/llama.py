"""The Llama family (Llama 2/3, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norms, SmolLM2)
on one flat-batch forward: tokens of all sequences in one [num_tokens] row, positions beside
them, paged KV through the attention layer. Module names follow HF so checkpoints map 1:1,
except the packed projections listed in `packed_modules_mapping`.

One file for every tensor-parallel size: the model takes its `TPGroup` once and hands it to
each parallel layer, which slices its weights and reduces its own output. A rank holds
heads / tp query heads and kv_heads / tp KV heads (one replicated KV head when there are fewer
KV heads than ranks); the residual stream, norms and logits are whole on every rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from outrider.distributed import TPGroup, kv_heads_per_rank, single
from outrider.layers.activation import SiluAndMul
from outrider.layers.attention import Attention
from outrider.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from outrider.layers.kv_layout import KVLayout
from outrider.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import Rope, RotaryEmbedding
from outrider.loaders.hf_config import TransformerConfig, check_tp_size
from outrider.models.protocol import ModelDefaults


class LlamaAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig, tp: TPGroup) -> None:
        super().__init__()
        # This rank's heads.
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(cfg.num_key_value_heads, tp.size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            self.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.attention_bias,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=False, tp=tp
        )
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        rotated = not self.qk_norm and RotaryEmbedding.apply_packed_(
            rope, qkv, self.num_heads, self.num_kv_heads, self.head_dim
        )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotated:
            q, k = RotaryEmbedding.apply(rope, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: TransformerConfig, tp: TPGroup) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], bias=False, tp=tp
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False, tp=tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class PrenormDecoderLayer(nn.Module):
    """norm -> self_attn -> norm -> mlp, each sublayer's output added to the residual stream;
    subclasses build `self_attn`, `mlp`, `input_layernorm` and `post_attention_layernorm`
    (Llama's layer, DeepSeek-V3's)."""

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm: (hidden, residual) together carry the
        # residual stream, which equals hidden + residual (or hidden alone before layer 0).
        # RowParallelLinear(x, residual, norm) would make o_proj's reduce and the add + norm
        # after it one call, but it launches the same kernels as these two calls, and the
        # norm would have to travel into self_attn (MLA's too), which HF's layer never sees;
        # down_proj's sum meets the *next* layer's norm, across the boundary where run_layers
        # reads the stream entering a layer (HF hidden_states[i]). Worth wiring in when a
        # kernel reduces, adds and normalises in one pass.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaDecoderLayer(PrenormDecoderLayer):
    def __init__(self, cfg: TransformerConfig, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: TransformerConfig, max_positions: int, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers)
        )
        # One rotary table for all layers; cos/sin are looked up once per forward.
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rope = self.rotary_emb.lookup(positions)
        return run_layers(self.layers, self.norm, self.embed_tokens(input_ids), rope, aux_layers)


def run_layers(
    layers: Sequence[nn.Module],
    norm: nn.Module,
    hidden: torch.Tensor,
    rope: Rope,
    aux_layers: Sequence[int],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The decoder stack with the residual add fused into each next norm -> (final normed
    hidden, the residual stream entering each of `aux_layers`, in the order asked, repeats
    kept). Every model whose layers take (rope, hidden, residual) runs through here."""
    residual = None
    captured = {}
    for i, layer in enumerate(layers):
        if i in aux_layers:
            # The residual stream entering layer i == HF hidden_states[i] (EAGLE-3 capture).
            captured[i] = hidden if residual is None else hidden + residual
        hidden, residual = layer(rope, hidden, residual)
    hidden, _ = norm(hidden, residual)
    return hidden, [captured[i] for i in aux_layers]


class LlamaForCausalLM(ModelDefaults):
    """Satisfies `outrider.models.protocol.CausalLM`."""

    config_class = TransformerConfig
    # checkpoint name -> (packed parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, cfg: TransformerConfig, max_positions: int | None = None, tp: TPGroup | None = None
    ) -> None:
        """tp: the tensor-parallel group this model is split over (None: one rank)."""
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or single()
        check_tp_size(cfg, tp.size)
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [num_tokens] -> final hidden [num_tokens, hidden] and the
        residual stream entering each layer in `aux_layers` (same shape each)."""
        return self.model(input_ids, positions, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, vocab], whole on every rank

    @property
    def tie_word_embeddings(self) -> bool:
        return self.config.tie_word_embeddings

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """What one token slot of one attention layer holds: this rank's K and V heads."""
        attn = self.model.layers[0].self_attn
        return KVLayout.multi_head(attn.num_kv_heads, attn.head_dim, dtype)
