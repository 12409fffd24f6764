"""What the engine needs from a model, declared: `PagedModel` for every network it loads from a
checkpoint and keeps paged KV for (a target or an EAGLE-3 draft), `CausalLM` for a target the
runner serves. `ModelDefaults` gives the members most models answer the same way, so a model
states only where it differs; the engine reads every member directly, never probing for one."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from outrider.distributed import TPGroup
    from outrider.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from outrider.layers.kv_layout import KVLayout
    from outrider.loaders.hf_config import ModelConfig

# What `map_weight_name` answers for a checkpoint name: (parameter name, shard id), a new
# checkpoint name (the packed table then applies to it), models/weights.py's SKIP, or None (the
# name as it is, through the packed table).
WeightName = tuple[str, Any] | str | None


@runtime_checkable
class PagedModel(Protocol):
    """A network models/weights.py loads and the executor gives a paged KV pool.

    Invariants: `attention_layers()` lists every layer that keeps KV, in the pool's layer
    order, each taking the `kv_cache` the pool assigns it; `kv_layout(dtype)` is what one token
    slot of any of them holds on this rank; `packed_modules_mapping` applies only to names
    `map_weight_name` leaves alone (None) or renames (a str)."""

    config_class: ClassVar[type]  # the config its constructor takes
    # checkpoint module name -> (packed parameter's module name, shard id its weight_loader takes)
    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, Any]]]

    @property
    def tie_word_embeddings(self) -> bool:
        """lm_head is the token embedding: a checkpoint's lm_head.weight is neither loaded nor
        expected."""
        ...

    def map_weight_name(self, name: str) -> WeightName:
        """A checkpoint tensor's name -> where it loads (WeightName says how)."""
        ...

    def kv_layout(self, dtype: torch.dtype) -> KVLayout: ...

    def attention_layers(self) -> Sequence[nn.Module]: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final hidden -> [N, vocab] logits, whole on every rank."""
        ...

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]: ...


class DecoderStack(Protocol):
    """A target's decoder stack (HF's `model.model`): the parts read outside its forward."""

    embed_tokens: VocabParallelEmbedding  # the drafter embeds with it
    norm: nn.Module  # the final norm (drafter training starts a draft's norm from it)


@runtime_checkable
class CausalLM(PagedModel, Protocol):
    """A target model the runner builds by architecture name (models/registry.py) as
    `cls(config, max_positions=..., tp=...)`, and runs in every mode: one flat batch of tokens,
    attention metadata from the forward context.

    Invariants: the hidden states `forward` returns are whole on every rank (tensor
    parallelism lives inside the layers); the aux streams are the residual stream *entering*
    each asked layer (HF hidden_states[i]), in the order asked, repeats kept; with `graph_safe`
    a decode or verify forward of at most `graph_max_tokens` tokens (None: any) reads nothing
    on the host, so a CUDA graph can capture it."""

    config: ModelConfig
    tp: TPGroup
    model: DecoderStack
    lm_head: ParallelLMHead

    @property
    def graph_safe(self) -> bool: ...

    @property
    def graph_max_tokens(self) -> int | None: ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        aux_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # [num_tokens, H], each [num_tokens, H]
        ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`, through nn.Module's hooks."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def eval(self) -> CausalLM: ...


class ModelDefaults(nn.Module):
    """The answers most models share: nothing packed, checkpoint names as they are, untied
    embeddings, graph-safe at any step size. A model overrides what differs."""

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, Any]]] = {}
    graph_safe: bool = True
    graph_max_tokens: int | None = None

    @property
    def tie_word_embeddings(self) -> bool:
        return False

    def map_weight_name(self, name: str) -> WeightName:
        return None
