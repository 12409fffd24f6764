"""Engine configuration: frozen, composed dataclasses validated on construction.

The CLI and YAML files read their defaults from these classes; nothing mutates a config after
the engine starts. `EngineConfig.from_dict` takes the nested form YAML gives:

    model: {model: path/to/model.gguf, dtype: float32}
    cache: {block_size: 16, cpu_kv_bytes: 1073741824}
    scheduler: {max_num_seqs: 64}
    speculative: {method: ngram, num_draft_tokens: 4}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to serve and how. `model` None means the embedded default model."""

    model: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    max_model_len: int | None = None  # None: the checkpoint's context length
    attention_backend: str = "auto"  # auto: triton on CUDA, torch_ref on CPU
    # CUDA graphs for decode (and chain verify) steps. None: on for CUDA with a backend that
    # supports them; False forces eager execution (debugging, profiling).
    cuda_graphs: bool | None = None
    cuda_graph_max_batch: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"invalid dtype={self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(
                f"invalid device={self.device!r}: use one of {', '.join(DEVICES)} or cuda:N"
            )
        if self.cuda_graph_max_batch < 1:
            raise ValueError(
                f"invalid cuda_graph_max_batch={self.cuda_graph_max_batch}: use an integer >= 1"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(
                f"invalid max_model_len={self.max_model_len}: use an integer >= 1 or None"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool. On CPU its size is a byte budget; on CUDA a fraction of free memory."""

    block_size: int = 16
    cpu_kv_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    num_blocks: int | None = None  # fixes the pool size, overriding both budgets (tests use this)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"invalid block_size={self.block_size}: use a power of two, e.g. 16")
        if self.cpu_kv_bytes < 1:
            raise ValueError(f"invalid cpu_kv_bytes={self.cpu_kv_bytes}: use a positive byte count")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"invalid gpu_memory_utilization={self.gpu_memory_utilization}: use a value in (0, 1]"
            )
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"invalid num_blocks={self.num_blocks}: use at least 2, or None")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. Prompts longer than the token budget are prefilled in chunks."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Launch the next plain decode step before reading this one's tokens, so the host's
    # bookkeeping overlaps the device's work (engine/overlap.py). None: off for now (on CUDA
    # once measured there); the CPU gains nothing from it.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"invalid max_num_seqs={self.max_num_seqs}: use an integer >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"invalid max_num_batched_tokens={self.max_num_batched_tokens}: use an integer >= 1"
            )


SPEC_METHODS = ("ngram", "eagle3")
SPEC_CONTROLLERS = ("adaptive", "fixed")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. method None decodes plainly; "ngram" drafts by prompt-and-output
    lookup; "eagle3" runs an EAGLE-3 draft network (`draft`: its directory; None picks the one
    shipped for the default model). num_draft_tokens is k, the drafts verified per sequence per
    step. EAGLE-3 trees: `topk` candidates per step over `num_steps` steps, the best
    num_draft_tokens nodes kept; topk 1 is a chain of num_draft_tokens.

    controller "adaptive" chooses, before every decode step, how many drafts (0..k; 0 is a
    plain step) to verify, from step costs measured at start-up on this machine and the live
    acceptance (speculative/controller.py), so speculation runs only where it wins; "fixed"
    verifies k every step (trees are always fixed)."""

    method: str | None = None
    num_draft_tokens: int = 4
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    draft: str | None = None
    num_steps: int | None = None  # EAGLE-3: default num_draft_tokens for a chain
    topk: int = 1
    controller: str = "adaptive"

    def __post_init__(self) -> None:
        if self.controller not in SPEC_CONTROLLERS:
            raise ValueError(
                f"unknown speculative controller={self.controller!r}: use 'adaptive' (choose k per "
                "step, 0 where speculation would lose) or 'fixed' (always k)"
            )
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(
                f"unknown speculative method={self.method!r}: use one of {', '.join(SPEC_METHODS)}, "
                f"or None to decode without speculation"
            )
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"invalid num_draft_tokens={self.num_draft_tokens}: use 1..64")
        if not 1 <= self.topk <= 16:
            raise ValueError(f"invalid topk={self.topk}: use 1..16 (1 drafts a chain)")
        if self.num_steps is not None and not 1 <= self.num_steps <= self.num_draft_tokens:
            raise ValueError(
                f"invalid num_steps={self.num_steps}: use 1..num_draft_tokens "
                f"({self.num_draft_tokens}); a tree of depth s holds at most k nodes"
            )
        if self.method != "eagle3" and (self.draft is not None or self.topk != 1):
            raise ValueError(
                f"draft={self.draft!r} / topk={self.topk} only apply to method='eagle3', "
                f"not method={self.method!r}"
            )
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(
                f"invalid n-gram range min_n={self.ngram_min_n}, max_n={self.ngram_max_n}: "
                f"use 1 <= min_n <= max_n"
            )

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpecConfig = field(default_factory=SpecConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from the nested dict form (YAML); unknown keys are errors, not silently dropped."""
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(data) - set(sections)
        if unknown:
            raise ValueError(f"unknown config section(s) {sorted(unknown)}: use {sorted(sections)}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            section_cls = f.default_factory  # type: ignore[misc]
            values = data.get(f.name) or {}
            kwargs[f.name] = build_section(section_cls, values, f.name)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} not found: pass an existing YAML path")
        return cls.from_dict(yaml.safe_load(p.read_text()) or {})

    def replace(self, **sections: dict[str, Any]) -> EngineConfig:
        """A copy with some fields of some sections changed: replace(model={"dtype": "float32"})."""
        kwargs = {}
        for f in dataclasses.fields(self):
            current = getattr(self, f.name)
            changes = sections.get(f.name) or {}
            kwargs[f.name] = build_section(
                type(current), {**dataclasses.asdict(current), **changes}, f.name
            )
        return EngineConfig(**kwargs)


def build_section(section_cls: type, values: dict[str, Any], section: str) -> Any:
    """A config dataclass from one YAML section; an unknown key is an error naming it."""
    names = {f.name for f in dataclasses.fields(section_cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)} in config section {section!r}: use {sorted(names)}"
        )
    return section_cls(**values)


def defaults(section_cls: type) -> dict[str, Any]:
    """Field defaults of a config section, for CLI flags."""
    return {f.name: f.default for f in dataclasses.fields(section_cls)}
