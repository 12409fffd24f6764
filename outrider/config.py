"""Engine configuration: frozen, composed dataclasses validated on construction.

The CLI and YAML files read their defaults from these classes; nothing mutates a config after
the engine starts. `EngineConfig.from_dict` takes the sectioned form

    model: {model: path/to/model.gguf, dtype: float32}
    cache: {block_size: 16, cpu_kv_bytes: 1073741824}
    scheduler: {max_num_seqs: 64}
    speculative: {method: ngram, num_draft_tokens: 4}
    parallel: {tensor_parallel_size: 2}

and the flat form vLLM's YAML files use, keyed by field or flag name (dashes or underscores),
vLLM's spellings included (`FLAT_ALIASES`, `SpecConfig.normalize`):

    model: path/to/model.gguf
    max-num-seqs: 64
    enforce-eager: true
    speculative-config: {method: EAGLE3, model: path/to/drafter, num_speculative_tokens: 3}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from outrider.config_fields import (
    build_section,
    check_types,
    check_value,
    close_matches,
    read_yaml,
)

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
    # Steps of prompt chunks of at most this many tokens in all replay CUDA graphs too,
    # captured at 32, 64, ... up to it; 0: they run eagerly. With decode rows beside the chunks
    # (a request arriving while others decode) too unless cuda_graph_mixed_prefill is False.
    cuda_graph_prefill_tokens: int = 512
    cuda_graph_mixed_prefill: bool = True
    seed: int = 0
    # Batch-invariant kernels (layers/batch_invariant.py): each row's reduction order depends
    # on that row alone, so a verify row equals a one-token decode row bit for bit and greedy
    # speculative output equals plain output in bf16 too; costs speed, see docs/architecture.md.
    deterministic: bool = False

    def __post_init__(self) -> None:
        check_types(self)
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
        if self.cuda_graph_prefill_tokens < 0:
            raise ValueError(
                f"invalid cuda_graph_prefill_tokens={self.cuda_graph_prefill_tokens}: use an "
                "integer >= 0 (0: steps with prompt chunks run eagerly)"
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
        check_types(self)
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


# The long-prefill threshold on a CPU, where a step's time follows its tokens and a request that
# arrives waits for the step in flight before its own: 64 keeps a step of the default model on 2
# cores near a second at a 7k context, without slowing the long prompt's own prefill
# (benchmarks/results/fair_prefill.json).
CPU_LONG_PREFILL_TOKENS = 64


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. Prompts longer than the token budget are prefilled in chunks.

    With chunked prefill, a prompt with more than long_prefill_token_threshold tokens still to
    compute is long: it computes at most that many a step, and only after the decodes and the
    short prompts (new or mid-prefill) have had their share of the budget; only the
    max_long_partial_prefills long prompts with the fewest tokens left advance in a step (the
    others keep their KV and wait; short prompts queued behind them go first). A short request
    arriving during a long prefill then gets its first token within a step or two. None:
    CPU_LONG_PREFILL_TOKENS on a CPU, the whole budget on CUDA (long prompts there only yield
    the budget others need); 0: no prompt is long (prompts take the budget in admission
    order)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    max_long_partial_prefills: int = 1
    # Launch the next plain decode step before reading this one's tokens, so the host's
    # bookkeeping overlaps the device's work (engine/overlap.py). None: on where the model runs
    # on CUDA (benchmarks/results/moe_gpu.json: +11% at one stream for the Moonlight shape on
    # the H200, +36% for Kimi-K2.5's), off on the CPU, which gains nothing from it.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        check_types(self)
        if self.max_num_seqs < 1:
            raise ValueError(f"invalid max_num_seqs={self.max_num_seqs}: use an integer >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"invalid max_num_batched_tokens={self.max_num_batched_tokens}: use an integer >= 1"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"invalid long_prefill_token_threshold={self.long_prefill_token_threshold}: use "
                "an integer >= 0 (0: no prompt counts as long) or None (chosen by device)"
            )
        if self.max_long_partial_prefills < 1:
            raise ValueError(
                f"invalid max_long_partial_prefills={self.max_long_partial_prefills}: use an "
                "integer >= 1"
            )

    def long_prefill_tokens(self, device_type: str) -> int:
        """The long-prefill threshold in force on `device_type` ("cpu", "cuda"): the setting,
        or its default there; 0 (no prompt is long) without chunked prefill."""
        if not self.enable_chunked_prefill:
            return 0
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        if device_type == "cpu":
            return min(CPU_LONG_PREFILL_TOKENS, self.max_num_batched_tokens)
        return self.max_num_batched_tokens


SPEC_CONTROLLERS = ("adaptive", "fixed")


# vLLM's speculative_config keys -> SpecConfig fields
VLLM_SPEC_KEYS = {
    "num_speculative_tokens": "num_draft_tokens",
    "model": "draft",
    "prompt_lookup_min": "ngram_min_n",
    "prompt_lookup_max": "ngram_max_n",
}


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. method names a proposer registered in outrider/engine/proposers.py
    (an engine refuses one that is not, before it loads the model), None decodes plainly;
    "ngram" drafts by prompt-and-output lookup; "eagle3" runs an EAGLE-3 draft network (`draft`:
    its directory; None picks the one shipped for the default model). num_draft_tokens is k,
    the drafts verified per sequence per step. EAGLE-3 trees: `topk` candidates per step over
    `num_steps` steps, the best num_draft_tokens nodes kept; topk 1 is a chain of
    num_draft_tokens.

    controller "adaptive" chooses, before every decode step, how many drafts (0..k; 0 is a
    plain step) to verify, from step costs measured at start-up on this machine and the live
    acceptance (speculative/controller.py), so speculation runs only where it wins; "fixed"
    verifies k every step (trees are always fixed).

    draft_tensor_parallel_size (vLLM's key) places an EAGLE-3 drafter under tensor
    parallelism: 1 runs it whole on rank 0 (no collective in a draft forward); the target's
    tensor_parallel_size splits it like the target, every rank running each draft forward
    (two all-reduces a layer, the embedding's and fc's, and the head's all-gather).

    grammar_drafts: a constrained request's chain drafts start with the tokens its grammar
    forces (engine/structured.py); False leaves the proposer's drafts as they are, only cut
    where the grammar refuses them (to measure what forced drafts gain)."""

    method: str | None = None
    num_draft_tokens: int = 4
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    draft: str | None = None
    num_steps: int | None = None  # EAGLE-3: default num_draft_tokens for a chain
    topk: int = 1
    controller: str = "adaptive"
    draft_tensor_parallel_size: int = 1
    grammar_drafts: bool = True
    # The other spellings `normalize` takes, and whose they are (build_section's message).
    SPELLINGS: ClassVar[dict[str, str]] = dict.fromkeys(VLLM_SPEC_KEYS, "vLLM's")

    def __post_init__(self) -> None:
        check_types(self)
        d = self.draft_tensor_parallel_size
        if isinstance(d, bool) or not (isinstance(d, int) and d >= 1):
            raise ValueError(
                f"invalid draft_tensor_parallel_size={d!r}: use 1 (the drafter whole on rank "
                "0) or the tensor_parallel_size (split like the target)"
            )
        if d > 1 and self.method != "eagle3":
            raise ValueError(
                f"draft_tensor_parallel_size={d} applies to method='eagle3' (a draft network), "
                f"not method={self.method!r}: use 1"
            )
        if self.controller not in SPEC_CONTROLLERS:
            raise ValueError(
                f"unknown speculative controller={self.controller!r}: use 'adaptive' (choose k per "
                "step, 0 where speculation would lose) or 'fixed' (always k)"
            )
        if self.method is not None and not (isinstance(self.method, str) and self.method):
            raise ValueError(
                f"invalid speculative method={self.method!r}: name a proposer (ngram, eagle3, "
                "or one registered with outrider.engine.proposers.register_proposer), or None "
                "to decode without speculation"
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

    @staticmethod
    def normalize(values: dict[str, Any]) -> dict[str, Any]:
        """SpecConfig fields from a speculative section in outrider's or vLLM's keys
        (`speculative_config`: method, model, num_speculative_tokens, prompt_lookup_min/max),
        method names in any case ("EAGLE3", "[ngram]"); a key both ways with two values is an
        error. Keys neither knows are left for the section's unknown-key error."""
        out: dict[str, Any] = {}
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name == "draft_tensor_parallel_size" and value is None:
                continue  # vLLM's default: the drafter's own choice, here 1
            name = VLLM_SPEC_KEYS.get(name, name)
            if name in out and out[name] != value:
                raise ValueError(
                    f"speculative {name} is given twice ({out[name]!r} and {value!r} as {key!r}): "
                    "keep one"
                )
            out[name] = value
        method = out.get("method")
        if isinstance(method, str):
            m = method.strip().strip("[]").lower().replace("-", "").replace("_", "")
            m = {"promptlookup": "ngram"}.get(m, m)
            if m in ("eagle", "eagle2", "medusa", "mlpspeculator", "draftmodel", "deepseekmtp"):
                raise ValueError(
                    f"speculative method {method!r} is not supported: use eagle3 (an EAGLE-3 "
                    "drafter; `outrider drafter train` makes one for any model) or ngram"
                )
            out["method"] = m
        return out


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the model split over `tensor_parallel_size` processes, one per GPU
    (NCCL) or CPU processes (gloo). Outside torchrun the engine starts the other ranks itself
    on this machine; under torchrun (`--nnodes N --nproc-per-node M`, N x M ranks) every rank
    runs the same command and the world size must equal tensor_parallel_size.

    collective_timeout_s bounds one eager collective inside a step (a rank that stops answering
    fails the step after it); a collective inside a replayed CUDA graph has no such limit (a
    rank dying mid-replay is caught by NCCL's watchdog or torchrun); ranks waiting for the next step between requests wait without
    limit, and a rank whose process ends is noticed at once (executor/tp_workers.py)."""

    tensor_parallel_size: int = 1
    collective_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        check_types(self)
        if isinstance(self.tensor_parallel_size, bool) or not (
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1
        ):
            raise ValueError(
                f"invalid tensor_parallel_size={self.tensor_parallel_size!r}: use an integer "
                ">= 1 (the number of GPUs, or CPU processes, the model is split over)"
            )
        if not self.collective_timeout_s > 0:
            raise ValueError(
                f"invalid collective_timeout_s={self.collective_timeout_s!r}: use seconds > 0"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        draft, tp = self.speculative.draft_tensor_parallel_size, self.parallel.tensor_parallel_size
        if draft not in (1, tp):
            raise ValueError(
                f"draft_tensor_parallel_size={draft} with tensor_parallel_size={tp}: use 1 (the "
                f"drafter whole on rank 0) or {tp} (split like the target)"
            )
        if draft > 1 and self.model.cuda_graphs:
            raise ValueError(
                f"cuda_graphs=True with draft_tensor_parallel_size={draft}: the other ranks "
                "follow a split drafter eagerly only; set cuda_graphs=False (--enforce-eager), "
                "or draft_tensor_parallel_size=1"
            )
        if self.model.deterministic and tp > 1:
            raise ValueError(
                f"deterministic=True with tensor_parallel_size={tp}: an all-reduce sums in an "
                "order its message size picks (NCCL chooses ring or tree by bytes), so rows "
                "would depend on the batch; use tensor_parallel_size=1, or deterministic=False"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from YAML's dict: sections (a mapping under a section's name) and flat keys
        (any field by its name or flag name, and FLAT_ALIASES) may mix. Unknown keys are
        errors naming the close matches, not silently dropped."""
        if not isinstance(data, dict):
            raise ValueError(f"an engine config is a mapping of keys, got {type(data).__name__}")
        nested: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        flat: dict[str, Any] = {}
        for key, value in data.items():
            if key in SECTIONS and (value is None or isinstance(value, dict)):
                nested[key].update(value or {})
            elif key in SECTIONS and key != "model":  # `model: path` is the flat model field
                raise ValueError(
                    f"config section {key!r} must be a mapping of keys, got {value!r}: e.g. "
                    f"`{key}: {{{dataclasses.fields(SECTIONS[key])[0].name}: ...}}`"
                )
            else:
                flat[key] = value
        for section, values in flat_sections(flat).items():
            for name, value in values.items():
                have = nested[section].get(name, value)
                if have != value:
                    raise ValueError(
                        f"{section}.{name} is given twice, {have!r} in its section and "
                        f"{value!r} as a flat key: keep one"
                    )
                nested[section][name] = value
        return cls(**{name: build_section(c, nested[name], name) for name, c in SECTIONS.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        """From a YAML file; every error names the file."""
        data = read_yaml(path)
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"config file {str(path)!r}: {e}") from None

    def replace(self, **sections: dict[str, Any]) -> EngineConfig:
        """A copy with some fields of some sections changed: replace(model={"dtype": "float32"})."""
        kwargs = {}
        for f in dataclasses.fields(self):
            current = getattr(self, f.name)
            changes = {str(k).replace("-", "_"): v for k, v in (sections.get(f.name) or {}).items()}
            normalize = getattr(type(current), "normalize", None)
            if normalize is not None:  # another spelling of a field replaces that field
                changes = normalize(changes)
            kwargs[f.name] = build_section(
                type(current), {**dataclasses.asdict(current), **changes}, f.name
            )
        return EngineConfig(**kwargs)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpecConfig,
    "parallel": ParallelConfig,
}

# Flat keys other than a field's own name -> (section, field), as vLLM and the CLI spell them.
FLAT_ALIASES: dict[str, tuple[str, str]] = {
    "spec": ("speculative", "method"),
    "spec_controller": ("speculative", "controller"),
    "num_gpu_blocks": ("cache", "num_blocks"),
    "num_gpu_blocks_override": ("cache", "num_blocks"),
    "model_path": ("model", "model"),
    "tp": ("parallel", "tensor_parallel_size"),
    "enable_deterministic_inference": ("model", "deterministic"),  # SGLang's spelling
}


def flat_sections(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat keys (vLLM-style YAML, `LLM(**options)`) -> {section: {field: value}}.

    A key is a field's name or flag name (dashes or underscores), a FLAT_ALIASES key, or one of
    vLLM's: speculative_config (a mapping or its JSON text, SpecConfig.normalize's keys),
    enforce_eager (no CUDA graphs); tensor_parallel_size is a field of the parallel section."""
    owners = {f.name: s for s, c in SECTIONS.items() for f in dataclasses.fields(c)}
    out: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    unknown = []
    for key, value in flat.items():
        name = str(key).replace("-", "_")
        if name == "speculative_config":
            out["speculative"].update(speculative_config(value))
        elif name == "enforce_eager":
            out["model"]["cuda_graphs"] = False if value else None
        elif name in FLAT_ALIASES:
            section, field_name = FLAT_ALIASES[name]
            out[section][field_name] = value
        elif name in owners:
            out[owners[name]][name] = value
        else:
            unknown.append(str(key))
    if unknown:
        known = flat_names()
        raise ValueError(
            f"unknown config key(s) {sorted(unknown)}{close_matches(sorted(unknown), known)}: "
            f"use a section ({', '.join(SECTIONS)}) or a field name, e.g. max_num_seqs"
        )
    return out


def flat_names() -> list[str]:
    """Every key flat_sections takes (besides their spellings with dashes)."""
    fields = [f.name for c in SECTIONS.values() for f in dataclasses.fields(c)]
    return list(dict.fromkeys([*fields, *FLAT_ALIASES, "speculative_config", "enforce_eager"]))


def speculative_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """SpecConfig fields from vLLM's speculative_config, a mapping or its JSON text, in its keys
    or outrider's. An unknown key (with the close matches among both) or a value of the wrong
    kind is an error naming the key as written."""
    example = '\'{"method": "eagle3", "num_speculative_tokens": 3}\''
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"speculative_config {value!r} is not JSON ({e.msg}): e.g. {example}"
            ) from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a mapping, got {value!r}: e.g. {example}")
    fields = [f.name for f in dataclasses.fields(SpecConfig)]
    for key, item in value.items():
        name = str(key).replace("-", "_")
        name = VLLM_SPEC_KEYS.get(name, name)
        if name in fields and item is not None:  # None: vLLM's default, normalize's to judge
            check_value(SpecConfig, name, item, str(key), " in speculative_config")
    spec = SpecConfig.normalize(value)
    unknown = sorted(set(spec) - set(fields))
    if unknown:
        vllm = ["method", *VLLM_SPEC_KEYS, "draft_tensor_parallel_size"]
        raise ValueError(
            f"unknown key(s) {unknown} in speculative_config"
            f"{close_matches(unknown, vllm + fields)}: "
            f"vLLM's keys are {', '.join(vllm)}; outrider's {', '.join(sorted(fields))}"
        )
    return spec
