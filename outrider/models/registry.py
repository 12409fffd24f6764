"""HF architecture name -> model class, imported lazily so a new model adds a file and a line
(and its config class a line in loaders/hf_config.py, which reads config.json by the same
names)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from outrider.loaders.hf_config import supported_architectures
from outrider.registry import Registry

if TYPE_CHECKING:
    from outrider.models.protocol import CausalLM

# name -> "module:Class"
_MODELS: Registry[type[CausalLM]] = Registry("architecture", {
    "LlamaForCausalLM": "outrider.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "outrider.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "outrider.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "outrider.models.llama:LlamaForCausalLM",
    "DeepseekV3ForCausalLM": "outrider.models.deepseek_v3:DeepseekV3ForCausalLM",
    # Kimi-K2.5's vision tower is not loaded: outrider serves its DeepSeek-V3 text model.
    "KimiK25ForConditionalGeneration": "outrider.models.deepseek_v3:DeepseekV3ForCausalLM",
})  # fmt: skip


def model_class(architecture: str) -> type[CausalLM]:
    """The class that serves `architecture`; it satisfies models/protocol.py's CausalLM."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}: outrider supports "
            f"{', '.join(supported_architectures())}"
        )
    return _MODELS.get(architecture)
