"""HF architecture name -> model class, imported lazily so a new model adds a file and a line."""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:Class"
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "outrider.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "outrider.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "outrider.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "outrider.models.llama:LlamaForCausalLM",
    "DeepseekV3ForCausalLM": "outrider.models.deepseek_v3:DeepseekV3ForCausalLM",
    # Kimi-K2.5 nests a DeepSeek-V3 text model (`text_config`) beside a vision tower, which
    # is not loaded: outrider serves the text model.
    "KimiK25ForConditionalGeneration": "outrider.models.deepseek_v3:DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: dict[str, Any]) -> str:
    """The first supported name in config.json's `architectures`, or a clear error."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _MODELS:
            return name
    raise ValueError(
        f"unsupported architecture {names or hf_config.get('model_type')!r}: outrider supports "
        f"{', '.join(supported_architectures())}"
    )


def config_from_hf(hf_config: dict[str, Any]) -> Any:
    """config.json -> the config class its model declares (`config_class`), filled in."""
    return model_class(resolve_architecture(hf_config)).config_class.from_hf_dict(hf_config)


def model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}: outrider supports "
            f"{', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
