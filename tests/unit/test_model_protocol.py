"""Every model declares what the engine reads from it (models/protocol.py): each architecture the
registry serves builds a CausalLM, the EAGLE-3 draft is a PagedModel, and a model that states
only what differs from ModelDefaults loads through models/weights.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from outrider.layers.kv_layout import KVLayout
from outrider.loaders.hf_config import (
    DeepseekV3Config,
    TransformerConfig,
    config_from_hf,
    supported_architectures,
)
from outrider.models.eagle3 import Eagle3Config, Eagle3Draft
from outrider.models.protocol import CausalLM, ModelDefaults, PagedModel
from outrider.models.registry import model_class
from outrider.models.weights import load_weights
from tests.tiny import tiny_hf_config


def _hf_config(config_class: type, **over) -> dict:
    if config_class is TransformerConfig:
        return tiny_hf_config(**over)
    from tests.unit.test_deepseek_v3 import _hf_config as deepseek_hf_config

    return {**deepseek_hf_config().to_dict(), **over}


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_architecture_builds_a_causal_lm(arch):
    cls = model_class(arch)
    cfg = config_from_hf({**_hf_config(cls.config_class), "architectures": [arch]})
    model = cls(cfg, max_positions=64)
    assert isinstance(model, CausalLM), arch
    assert isinstance(model.graph_safe, bool)
    assert model.graph_max_tokens is None or model.graph_max_tokens > 0
    assert model.tie_word_embeddings is False
    assert isinstance(model.kv_layout(torch.float32), KVLayout)
    assert len(model.attention_layers()) == cfg.num_hidden_layers


@pytest.mark.parametrize("config_class", [TransformerConfig, DeepseekV3Config])
def test_tied_embeddings_come_from_the_config(config_class):
    arch = "LlamaForCausalLM" if config_class is TransformerConfig else "DeepseekV3ForCausalLM"
    cfg = config_from_hf(
        {**_hf_config(config_class, tie_word_embeddings=True), "architectures": [arch]}
    )
    assert model_class(arch)(cfg, max_positions=64).tie_word_embeddings is True


def test_the_eagle3_draft_is_a_paged_model():
    cfg = Eagle3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, draft_vocab_size=128, target_hidden_size=64,
        aux_layers=(1, 2, 3),
    )  # fmt: skip
    draft = Eagle3Draft(cfg)
    assert isinstance(draft, PagedModel) and not isinstance(draft, CausalLM)
    assert draft.config_class is Eagle3Config
    assert draft.map_weight_name("fc.weight") is None  # every name loads as it is


class _Tiny(ModelDefaults):
    """Declares only what differs from the defaults: its config class and its layers."""

    config_class = dict

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3, bias=False)

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        return KVLayout.multi_head(1, 4, dtype)

    def attention_layers(self) -> list[nn.Module]:
        return []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)


def test_a_model_on_the_defaults_loads_by_name():
    model = _Tiny()
    assert isinstance(model, PagedModel)
    weight = torch.arange(12.0).view(3, 4)
    load_weights(model, [("proj.weight", weight), ("lm_head.weight", torch.zeros(3, 4))])
    assert torch.equal(model.proj.weight, weight)
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*proj\.weight.*\(_Tiny\)"):
        load_weights(_Tiny(), [])
