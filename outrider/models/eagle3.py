"""The EAGLE-3 draft network, one module for serving (speculative/eagle3.py) and training (train/).

    target residual streams entering layers (2, L//2, L-3)   [T, 3 * Ht]
        -> fc (no bias)                                        [T, H]      (skipped for a hidden
                                                                            that is already H wide:
                                                                            the draft's own output
                                                                            fed back, steps >= 2)
    embed(next token) --input_layernorm--+
    hidden ------------hidden_norm-------+-> cat [T, 2H] -> attention (q/k/v from 2H) -> + hidden
        -> post_attention_layernorm -> MLP -> + residual -> norm -> lm_head over the draft vocab

Tensor parallelism (`tp`, the target's group when draft_tensor_parallel_size equals the target's
tensor_parallel_size): fc, q/k/v and gate/up split like the target's layers, o_proj, down_proj
and fc reduce their own outputs, the head is vocabulary-parallel over the draft vocabulary, and
the bound embedding is the target's own shard. A forward then runs an all-reduce for the
embedding, one for fc (when it reads the target's streams), o_proj's and down_proj's, and the
head one all-gather; every rank runs it in lockstep (executor/tp_draft.py). Without `tp` the
draft is whole and reduces nothing.

The embedding is the target's (bound, never trained). Draft token i is target token
i + d2t[i]; t2d[v] says whether target token v is in the draft vocabulary. `forward` returns
both the normed hidden (for logits) and the pre-norm sum, which is the hidden the next draft
step takes (EAGLE feeds its own features back).

Aux layer ids are stored in outrider's convention, the index of the layer whose *input* is
captured (HF hidden_states[i]); the SGLang and vLLM spellings are converted in models/eagle3_io.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from outrider.distributed import TPGroup, kv_heads_per_rank, single
from outrider.layers.activation import SiluAndMul
from outrider.layers.attention import Attention
from outrider.layers.embedding import ParallelLMHead
from outrider.layers.kv_layout import KVLayout
from outrider.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import Rope, RotaryEmbedding
from outrider.loaders.hf_config import ModelConfig
from outrider.models.llama import LlamaForCausalLM
from outrider.models.protocol import ModelDefaults

# q, k, v: [T, heads, dim], [T, kv_heads, dim] x2 -> [T, heads * dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # outrider convention: input of layer i is captured
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    # The layer's residual is the normed hidden (vLLM's and the speculators library's variant,
    # which speculators trains by default) instead of the hidden as it came (SGLang's,
    # SpecForge's and outrider's own drafters).
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses 3 target layers, got aux_layers={self.aux_layers}")

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None) -> Eagle3Config:
        """The usual drafter for a target: one Llama-style decoder layer as wide as the target,
        its heads, MLP width and rotary as the target's config says (`eagle3_draft_layer`; for
        an MLA target, multi-head attention over v_head_dim-wide heads)."""
        return cls(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or min(32000, target.vocab_size),
            target_hidden_size=target.hidden_size,
            aux_layers=tuple(target.aux_hidden_layers),
            rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings,
            **target.eagle3_draft_layer,
        )


class Eagle3Layer(nn.Module):
    """The one decoder layer; module names follow the published checkpoints (`midlayer.*`)."""

    def __init__(self, cfg: Eagle3Config, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or single()
        h = cfg.hidden_size
        # This rank's heads.
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(cfg.num_key_value_heads, tp.size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * h, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, tp=tp
        )
        self.self_attn.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, h, bias=False, tp=tp
        )
        self.self_attn.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )
        self.mlp = nn.Module()
        inter = cfg.intermediate_size
        self.mlp.gate_up_proj = MergedColumnParallelLinear(h, [inter, inter], bias=False, tp=tp)
        self.mlp.down_proj = RowParallelLinear(inter, h, bias=False, tp=tp)
        self.act = SiluAndMul()

    def forward(
        self, rope: Rope, embeds: torch.Tensor, hidden: torch.Tensor, attend: Attend | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden: [T, H] -> (mlp output, residual); their sum is the layer output."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        qkv = self.self_attn.qkv_proj(x)
        rotated = RotaryEmbedding.apply_packed_(
            rope, qkv, self.num_heads, self.num_kv_heads, self.head_dim
        )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = RotaryEmbedding.apply(rope, q, k)
        attn = (attend or self.self_attn.attn)(q, k, v)
        attn = attn.reshape(q.shape[0], self.q_size)
        x, residual = self.self_attn.o_proj(attn, residual, self.post_attention_layernorm)
        return self.mlp.down_proj(self.act(self.mlp.gate_up_proj(x))), residual


class Eagle3Draft(ModelDefaults):
    """Satisfies `outrider.models.protocol.PagedModel`; its embedding is the target's, so
    there is no head to tie."""

    config_class = Eagle3Config
    # The decoder layer packs q/k/v and gate/up as the target's layers do.
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(
        self, cfg: Eagle3Config, max_positions: int | None = None, tp: TPGroup | None = None
    ) -> None:
        """tp: the group the draft is split over (None: whole, one rank)."""
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or single()
        check_draft_tp_size(cfg, tp.size)
        h = cfg.hidden_size
        # Its input, the target's streams, is whole on every rank: each multiplies its columns.
        self.fc = RowParallelLinear(
            len(cfg.aux_layers) * cfg.target_hidden_size, h, bias=False, tp=tp,
            input_is_parallel=False,
        )  # fmt: skip
        self.midlayer = Eagle3Layer(cfg, tp)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, h, tp=tp)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim,
            max_positions or cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
        )
        self._embed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def bind_embedding(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Use the target's token embedding (ids [T] -> [T, H]); not a parameter of the draft."""
        self._embed = embed

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] the token after each position
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, 3 * Ht] target aux streams, or [T, H] the draft's own
        attend: Attend | None = None,  # None: the paged Attention of the forward context
        embeds: torch.Tensor | None = None,  # [T, H] precomputed embeddings (training)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed [T, H] for compute_logits, pre-norm [T, H] for the next draft step)."""
        if embeds is None:
            if self._embed is None:
                raise RuntimeError(
                    "the drafter has no embedding: call bind_embedding(target embed)"
                )
            embeds = self._embed(input_ids)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        rope = self.rotary_emb.lookup(positions)
        out, residual = self.midlayer(rope, embeds.to(hidden.dtype), hidden, attend)
        normed, summed = self.norm(out, residual)
        return normed, summed

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed)  # [T, draft_vocab], whole on every rank

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """What one token slot of the draft's one layer holds: its K and V heads."""
        layer = self.midlayer
        return KVLayout.multi_head(layer.num_kv_heads, layer.head_dim, dtype)


def check_draft_tp_size(cfg: Eagle3Config, tp_size: int) -> None:
    """Fail, naming what does not split, when the draft `cfg` cannot be split over `tp_size`
    ranks (heads, KV heads unless they replicate, MLP width, the draft vocabulary, fc's input)."""
    if tp_size == 1:
        return
    found = [
        f"{n} {what}"
        for n, what in (
            (cfg.num_attention_heads, "attention heads"),
            (cfg.intermediate_size, "MLP width"),
            (cfg.draft_vocab_size, "draft vocabulary"),
            (len(cfg.aux_layers) * cfg.target_hidden_size, "fc inputs"),
        )
        if n % tp_size
    ]
    kv = cfg.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        found.append(f"{kv} KV heads (nor is it a multiple of them)")
    if found:
        raise ValueError(
            f"draft_tensor_parallel_size={tp_size} does not divide the drafter's "
            f"{' or '.join(found)}: use draft_tensor_parallel_size=1 (the drafter whole on "
            "rank 0)"
        )
