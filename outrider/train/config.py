"""Drafter training configuration: frozen dataclasses validated on construction; the
`outrider drafter` flags read their defaults from them."""

from __future__ import annotations

from dataclasses import dataclass

from outrider.config import DEVICES, DTYPES


def _check(ok: bool, name: str, value, hint: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: {hint}")


@dataclass(frozen=True)
class DatagenConfig:
    """Which conversations to build and how the target answers them."""

    out: str = "drafter-data.jsonl"
    model: str | None = None  # the target; None: the embedded default
    num_samples: int = 1000
    max_new_tokens: int = 512
    seed_prompts: bool = True
    composed: int = 0  # requests composed from templates and topic lists (train/composed.py)
    self_generated: int = 0  # Magpie-style user turns written by the target itself
    # JSON or JSONL prompts or conversations: ShareGPT, role/content lists, prompt strings
    # (outrider/conversations.py); the target regenerates every answer
    user_file: str | None = None
    batch_size: int = 32
    temperature: float = 0.0
    seed: int = 0
    shard: int = 0  # with num_shards N: this process generates every N-th sample from here
    num_shards: int = 1

    def __post_init__(self) -> None:
        _check(self.num_shards >= 1, "num_shards", self.num_shards, "use an integer >= 1")
        _check(0 <= self.shard < self.num_shards, "shard", self.shard,
               f"use 0..{self.num_shards - 1} (one per process, with the same --num-shards)")  # fmt: skip
        _check(self.num_samples >= 1, "num_samples", self.num_samples, "use an integer >= 1")
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "use >= 1")
        _check(self.composed >= 0, "composed", self.composed, "use >= 0")
        _check(self.self_generated >= 0, "self_generated", self.self_generated, "use >= 0")
        _check(self.batch_size >= 1, "batch_size", self.batch_size, "use an integer >= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, "use >= 0 (0 = greedy)")


@dataclass(frozen=True)
class TrainConfig:
    data: str = "drafter-data.jsonl"
    output_dir: str = "drafter-run"
    model: str | None = None  # the target; None: the embedded default
    device: str = "auto"
    dtype: str = "auto"  # the target's compute dtype; the draft keeps fp32 master weights
    draft_vocab_size: int | None = None  # None: min(32000, target vocab)
    ttt_steps: int = 7
    step_decay: float = 0.8
    # Step j learns only where steps < j had the target's argmax in their top k (0: off; 1
    # for chains, topk for trees): serving never reaches past a miss (train/ttt.py).
    align_topk: int = 0
    hard_label: float = 0.0  # weight of the target argmax's cross-entropy beside the soft one
    intermediate_size: int | None = None  # the drafter's MLP width; None: the target's
    # The 3 target layers whose entering residual streams the drafter fuses (outrider's
    # convention: HF hidden_states[i]); None: EAGLE-3's (2, L//2, L-3). Exported as explicit
    # ids in each engine's convention, so SGLang and vLLM capture the same ones.
    aux_layers: tuple[int, ...] | None = None
    max_len: int = 2048  # tokens per packed row
    batch_rows: int = 1  # rows per micro-batch
    grad_accum: int = 1
    holdout: int = 0  # the dataset's last samples, kept out for `drafter eval`
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; None: epochs decide
    # Wall-clock budget for this output_dir's training (resumes continue its clock); the LR
    # schedule follows the clock when it is ahead of the steps. None: steps / epochs decide.
    max_minutes: float | None = None
    lr: float = 1e-4
    warmup_ratio: float = 0.02
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    init_std: float = 0.02
    # Start lm_head (draft-vocabulary rows) and the final norm from the target's own.
    head_from_target: bool = False
    seed: int = 0
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = False
    # A drafter directory to fine-tune (any layout load_drafter reads): its weights and its
    # draft vocabulary are kept (a regenerated d2t would no longer match its lm_head rows).
    init_from: str | None = None
    # auto: flex on CUDA (skips masked blocks), sdpa (torch's fused kernel) elsewhere; dense
    # keeps (j + 1) T x T scores of step j for the backward, GiBs past T ~ 2048.
    attention: str = "auto"
    feature_cache: str | None = None  # directory of captured target features (bf16 shards)
    layout: str = "sglang"  # of the final drafter
    log_every: int = 10
    target_num_blocks: int = 16  # the serving engine's own pool; capture uses a private one

    def __post_init__(self) -> None:
        _check(self.device in DEVICES or self.device.startswith("cuda:"), "device",
               self.device, f"use one of {', '.join(DEVICES)} or cuda:N")  # fmt: skip
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"use one of {', '.join(DTYPES)}")
        _check(self.draft_vocab_size is None or self.draft_vocab_size >= 1,
               "draft_vocab_size", self.draft_vocab_size, "use >= 1, or None for min(32000, vocab)")  # fmt: skip
        _check(1 <= self.ttt_steps <= 16, "ttt_steps", self.ttt_steps, "use 1..16 (7 is usual)")
        _check(0 < self.step_decay <= 1, "step_decay", self.step_decay, "use (0, 1], e.g. 0.8")
        _check(self.align_topk >= 0, "align_topk", self.align_topk,
               "use 0 (off), 1 for chains or the serving topk for trees")  # fmt: skip
        _check(0 <= self.hard_label <= 1, "hard_label", self.hard_label,
               "use [0, 1]: 0 soft targets only, 1 the target's argmax only")  # fmt: skip
        _check(self.intermediate_size is None or self.intermediate_size >= 1,
               "intermediate_size", self.intermediate_size,
               "use >= 1, or None for the target's own MLP width")  # fmt: skip
        if (aux := self.aux_layers) is not None:
            ok = isinstance(aux, (list, tuple)) and all(type(i) is int and i >= 0 for i in aux)
            _check(ok and len(aux) == 3 and len(set(aux)) == 3, "aux_layers", aux,
                   "use 3 distinct layer indices >= 0 (the residual stream entering each), or "
                   "None for EAGLE-3's (2, L//2, L-3)")  # fmt: skip
            object.__setattr__(self, "aux_layers", tuple(aux))
        _check(self.max_len >= 4, "max_len", self.max_len, "use >= 4 tokens per row")
        _check(self.batch_rows >= 1, "batch_rows", self.batch_rows, "use an integer >= 1")
        _check(self.grad_accum >= 1, "grad_accum", self.grad_accum, "use an integer >= 1")
        _check(self.holdout >= 0, "holdout", self.holdout, "use an integer >= 0")
        _check(self.epochs >= 1, "epochs", self.epochs, "use an integer >= 1")
        _check(self.max_steps is None or self.max_steps >= 1, "max_steps", self.max_steps,
               "use >= 1, or None to run `epochs` epochs")  # fmt: skip
        _check(self.max_minutes is None or self.max_minutes > 0, "max_minutes",
               self.max_minutes, "use a positive number of minutes, or None")  # fmt: skip
        _check(self.lr > 0, "lr", self.lr, "use a positive learning rate, e.g. 1e-4")
        _check(0 <= self.warmup_ratio < 1, "warmup_ratio", self.warmup_ratio, "use [0, 1)")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "use [0, 1]")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "use >= 0")
        _check(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "use > 0, e.g. 0.5")
        _check(self.init_std > 0, "init_std", self.init_std, "use > 0, e.g. 0.02")
        _check(not (self.intermediate_size and self.init_from), "intermediate_size",
               self.intermediate_size, "init_from keeps the drafter's own shape: drop one of them")  # fmt: skip
        _check(not (self.aux_layers and self.init_from), "aux_layers", self.aux_layers,
               "init_from keeps the drafter's own aux layers: drop one of them")  # fmt: skip
        _check(not (self.head_from_target and self.init_from), "head_from_target",
               self.head_from_target, "init_from keeps the drafter's own head: drop one of them")  # fmt: skip
        _check(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, "use >= 1")
        _check(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, "use >= 1")
        # Imported here: both modules import torch, and `drafter <cmd> --help` reads this file.
        from outrider.models.eagle3_format import LAYOUTS
        from outrider.train.ttt import ATTENTION_BACKENDS

        _check(self.attention in ATTENTION_BACKENDS, "attention", self.attention,
               f"use one of {', '.join(ATTENTION_BACKENDS)}")  # fmt: skip
        _check(self.layout in LAYOUTS, "layout", self.layout, f"use one of {', '.join(LAYOUTS)}")
        _check(self.log_every >= 1, "log_every", self.log_every, "use >= 1")
        _check(self.target_num_blocks >= 2, "target_num_blocks", self.target_num_blocks,
               "use >= 2")  # fmt: skip


@dataclass(frozen=True)
class EvalConfig:
    drafter: str = "drafter-run/drafter"
    data: str = "drafter-data.jsonl"
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    num_samples: int = 64  # held-out samples scored (the file's last ones)
    ttt_steps: int = 7
    max_len: int = 2048
    chain: int = 4  # the greedy chain replayed offline (exact on greedy datagen samples)

    def __post_init__(self) -> None:
        _check(self.num_samples >= 1, "num_samples", self.num_samples, "use an integer >= 1")
        _check(1 <= self.chain <= 16, "chain", self.chain, "use 1..16 draft tokens")
        _check(1 <= self.ttt_steps <= 16, "ttt_steps", self.ttt_steps, "use 1..16")
        _check(self.max_len >= 4, "max_len", self.max_len, "use >= 4")
