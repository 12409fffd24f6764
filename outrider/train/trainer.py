"""`train(config)`: an EAGLE-3 drafter for the target outrider serves, trained on features the
serving code computes (capture.py), with the TTT unroll (ttt.py).

One optimizer step = grad_accum micro-batches per rank x world_size ranks (torchrun: DDP, one
GPU per rank). Micro-batch k of an epoch goes to rank k % world_size. Data order is a function
of (seed, epoch) alone, so a checkpoint records (epoch, next micro-batch) and resume continues
exactly where the run stopped: same batches, same weights, same optimizer moments, same RNG.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from outrider import env
from outrider.device import resolve_device
from outrider.models.eagle3 import Eagle3Draft
from outrider.models.eagle3_io import save_drafter
from outrider.speculative.eagle3_vocab import build_draft_vocab
from outrider.train import checkpoint as ckpt
from outrider.train.batch import DraftVocabMaps, build_batch
from outrider.train.capture import FeatureCache, TargetCapture, cache_cost_bytes
from outrider.train.config import TrainConfig
from outrider.train.dataset import count_tokens, micro_batches, pack_rows, read_samples
from outrider.train.draft import head_from_target, new_draft
from outrider.train.ttt import TTTModel, resolve_attention

log = logging.getLogger(__name__)

# (step, metrics) -> None; raising stops the run (tests interrupt a run this way).
StepCallback = Callable[[int, dict[str, Any]], None]


@dataclass
class TrainResult:
    step: int  # optimizer steps done, over all runs of this output_dir
    losses: list[float] = field(default_factory=list)  # this run's loss per optimizer step
    step_acc: list[float] = field(default_factory=list)  # last step's top-1 accuracy per TTT step
    drafter: Path | None = None  # the saved drafter directory (rank 0)
    draft: torch.nn.Module | None = None  # the trained Eagle3Draft itself


def lr_at(step: int, total: int, config: TrainConfig, time_frac: float = 0.0) -> float:
    """Linear warmup over warmup_ratio * total steps, then cosine down to min_lr_ratio * lr.
    With a time budget, `time_frac` (elapsed / budget) drives the same schedule whenever it is
    further along than the steps are: a run cut by the clock still ends on a decayed rate."""
    warmup = int(config.warmup_ratio * total)
    if time_frac > 0 and time_frac > step / max(total, 1):
        if time_frac < config.warmup_ratio:
            return config.lr * time_frac / config.warmup_ratio
        frac = (time_frac - config.warmup_ratio) / max(1e-9, 1 - config.warmup_ratio)
    elif step < warmup:
        return config.lr * (step + 1) / warmup
    else:
        frac = (step - warmup) / max(1, total - warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cos)


def target_fingerprint(capture: TargetCapture, model: str | None) -> dict[str, Any]:
    cfg = capture.config
    rows = capture.model.model.embed_tokens.weight[:16].detach().float().cpu()
    return {
        "model": model,
        "architecture": cfg.architecture,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "embed_abs_sum": round(float(rows.abs().sum()), 2),
        "embed_sha": hashlib.sha256(rows.to(torch.bfloat16).view(torch.int16).numpy()).hexdigest()[
            :16
        ],
    }


def _check_same_target(saved: dict[str, Any], now: dict[str, Any], where: Path) -> None:
    keys = ("architecture", "hidden_size", "num_hidden_layers", "vocab_size", "embed_sha")
    diff = {k: (saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)}
    if diff:
        raise ValueError(
            f"checkpoint {str(where)!r} was trained for another target ({saved.get('model')!r}; "
            f"differs in {', '.join(f'{k}: {a!r} vs {b!r}' for k, (a, b) in diff.items())}): "
            f"resume with the same model, or use a new output_dir / resume=False"
        )


def target_llm(config: TrainConfig, device: torch.device | str):
    """The target engine whose forwards the capture borrows. Its own KV pool
    (target_num_blocks) serves no request: capture runs in a private pool sized to each batch,
    up to the target's full context. The engine's warning that so small a pool lowers its
    serving context, and that gpu_memory_utilization / cpu_kv_bytes / num_blocks would raise
    it, is therefore silenced: it names flags `drafter train` does not have, for a limit that
    does not bind here."""
    from outrider.llm import LLM

    limits = logging.getLogger("outrider.engine.limits")
    level = limits.level
    limits.setLevel(logging.ERROR)
    try:
        return LLM(
            config.model, dtype=config.dtype, device=str(device),
            num_blocks=config.target_num_blocks, cuda_graphs=False, enable_prefix_caching=False,
        )  # fmt: skip
    finally:
        limits.setLevel(level)


class Trainer:
    def __init__(self, config: TrainConfig, llm=None) -> None:
        self.config = c = config
        self.world, self.rank = env.world_size(), env.rank()
        self.owns_process_group = False
        device = resolve_device(c.device)
        if self.world > 1:
            import torch.distributed as dist

            if device.type == "cuda":
                device = torch.device("cuda", env.local_rank())
                torch.cuda.set_device(device)
            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
                self.owns_process_group = True
        if llm is None:
            llm = target_llm(c, device)
        # The drafter to fine-tune (init_from) brings its own aux layers; else the config's.
        init = self._init_drafter(c.init_from, llm.engine.checkpoint) if c.init_from else None
        self.capture = TargetCapture(llm, init.config.aux_layers if init else c.aux_layers)
        self.device = self.capture.device
        self.attention = resolve_attention(c.attention, self.device)
        target = self.capture.config
        self.samples = read_samples(c.data, target.vocab_size, chat=llm)
        if c.holdout:
            if c.holdout >= len(self.samples):
                raise ValueError(
                    f"holdout={c.holdout} leaves nothing to train on: the dataset has "
                    f"{len(self.samples)} samples; lower holdout or generate more"
                )
            self.samples = self.samples[: -c.holdout]
        self.fingerprint = target_fingerprint(self.capture, c.model)
        self.out = Path(c.output_dir)
        self.resume_from = ckpt.list_checkpoints(self.out)[-1:] if c.resume else []
        # 1. The draft vocabulary: the checkpoint's on resume, the fine-tuned drafter's with
        #    init_from, else the most frequent learned tokens (every rank counts the same file,
        #    so all agree without a broadcast).
        if self.resume_from:
            d2t, t2d = self._vocab_from_checkpoint(self.resume_from[0])
        elif init is not None:
            d2t, t2d = init.d2t, init.t2d
        else:
            size = c.draft_vocab_size or min(32000, target.vocab_size)
            if size > target.vocab_size:
                raise ValueError(
                    f"draft_vocab_size={size} exceeds the target vocabulary of "
                    f"{target.vocab_size}: use <= {target.vocab_size}"
                )
            d2t, t2d = build_draft_vocab(count_tokens(self.samples, target.vocab_size), size)
        if init is not None:  # its own shape (a published drafter's may differ from ours)
            self.draft = init.to(self.device).requires_grad_(True).train()
        else:
            self.draft = new_draft(
                target, d2t, t2d, max_positions=c.max_len + c.ttt_steps, std=c.init_std,
                seed=c.seed, device=self.device, intermediate_size=c.intermediate_size,
                aux_layers=self.capture.aux_layers,
            )  # fmt: skip
            if c.head_from_target:
                head_from_target(self.draft, self.capture.model)
        self.vocab = DraftVocabMaps.from_d2t(d2t, target.vocab_size, self.device)
        self.module: torch.nn.Module = TTTModel(
            self.draft, c.ttt_steps, c.step_decay, self.attention, c.align_topk, c.hard_label
        )
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.module = DistributedDataParallel(self.module, device_ids=ids)
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(), lr=c.lr, betas=(0.9, 0.95), weight_decay=c.weight_decay
        )
        self.cache = (
            FeatureCache(c.feature_cache, self.rank, self.capture.aux_layers)
            if c.feature_cache
            else None
        )
        if self.cache is not None and self.rank == 0:
            tokens = sum(min(len(s), c.max_len) for s in self.samples)
            print(
                f"feature cache {c.feature_cache}: {tokens} tokens x 4 x {target.hidden_size} x "
                f"2 bytes = {cache_cost_bytes(tokens, target.hidden_size) / 2**30:.2f} GiB of disk"
            )

    def _init_drafter(self, path: str, checkpoint) -> Eagle3Draft:
        """The drafter to fine-tune, after the doctor's static checks against the target (a
        drafter serving would refuse is refused here, before any training)."""
        from outrider.models.eagle3_io import load_drafter
        from outrider.speculative.eagle3_doctor import require_fit

        c = self.config
        require_fit(path, checkpoint, f"init_from={path!r} does not fit this target",
                    "fine-tune a drafter trained for this model, or train a new one (no init_from)")  # fmt: skip
        draft = load_drafter(path, checkpoint.config, device="cpu", dtype=torch.float32,
                             max_positions=c.max_len + c.ttt_steps)  # fmt: skip
        vd = draft.config.draft_vocab_size
        if c.draft_vocab_size is not None and c.draft_vocab_size != vd:
            raise ValueError(
                f"draft_vocab_size={c.draft_vocab_size} but init_from={path!r} has a draft "
                f"vocabulary of {vd}: fine-tuning keeps the drafter's vocabulary; drop "
                f"draft_vocab_size (or set it to {vd})"
            )
        return draft

    def _vocab_from_checkpoint(self, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import SafetensorError, safe_open

        state_file = path / "state.json"
        try:
            state = json.loads(state_file.read_text())
            with safe_open(str(path / "model.safetensors"), framework="pt") as f:
                d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        except (OSError, json.JSONDecodeError, SafetensorError, KeyError) as e:
            raise ValueError(
                f"checkpoint {str(path)!r} is corrupt or incomplete ({e}): delete it to resume "
                f"from the previous checkpoint, or start over with resume=False"
            ) from e
        _check_same_target(state.get("target", {}), self.fingerprint, path)
        saved = state.get("aux_layers")
        if saved is not None and tuple(saved) != self.capture.aux_layers:
            raise ValueError(
                f"checkpoint {str(path)!r} was trained on aux layers {saved}, but this run "
                f"captures {list(self.capture.aux_layers)}: resume with aux_layers={saved}, or "
                f"use a new output_dir / resume=False"
            )
        return d2t, t2d

    # -- the loop ---------------------------------------------------------------------------

    def run(self, callback: StepCallback | None = None) -> TrainResult:
        from tqdm import tqdm

        c = self.config
        per_step = c.grad_accum * self.world
        batches_per_epoch = len(micro_batches(pack_rows(self.samples, c.max_len, c.seed, 0),
                                              c.batch_rows))  # fmt: skip
        steps_per_epoch = batches_per_epoch // per_step
        if steps_per_epoch == 0:
            raise ValueError(
                f"the dataset packs into {batches_per_epoch} micro-batches but one optimizer step "
                f"needs grad_accum x world_size = {per_step}: lower grad_accum / batch_rows / "
                f"max_len, or generate more samples"
            )
        total = c.max_steps or c.epochs * steps_per_epoch
        step, epoch, pos = 0, 0, 0
        if self.resume_from:
            state = ckpt.load_checkpoint(self.resume_from[0], self.draft, self.optimizer)
            step, epoch, pos = state["step"], state["epoch"], state["batch"]
            log.info("resumed from %s at step %d", self.resume_from[0], step)
        elapsed_before = state.get("elapsed_s", 0.0) if self.resume_from else 0.0
        budget = c.max_minutes * 60 if c.max_minutes else None
        started = time.perf_counter() - elapsed_before
        out_of_time = False
        result = TrainResult(step=step)
        bar = tqdm(total=total, initial=step, disable=self.rank != 0, desc="drafter", unit="step")
        autocast = torch.autocast("cuda", torch.bfloat16) if self.device.type == "cuda" else None
        pending: list[torch.Tensor] = []  # per step [1 + 3 * ttt_steps] stats, on the device
        while step < total:
            # Each epoch reshuffles before packing, so its micro-batch count varies a little:
            # the epoch ends when its own batches run out, not after epoch 0's count.
            batches = micro_batches(pack_rows(self.samples, c.max_len, c.seed, epoch), c.batch_rows)
            while pos + per_step <= len(batches) and step < total:
                # 1. Learning rate: a function of the step alone (nothing else to checkpoint).
                elapsed = time.perf_counter() - started
                lr = lr_at(step, total, c, elapsed / budget if budget else 0.0)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                # 2. grad_accum micro-batches; DDP all-reduces gradients on the last one only.
                stats = torch.zeros(1 + 3 * c.ttt_steps, device=self.device)
                for a in range(c.grad_accum):
                    mb = batches[pos + a * self.world + self.rank]
                    batch = build_batch(
                        self.capture, self.samples, mb, c.max_len, self.vocab, self.cache
                    )
                    sync = contextlib.nullcontext()
                    if self.world > 1 and a < c.grad_accum - 1:
                        sync = self.module.no_sync()
                    with sync:
                        with autocast or contextlib.nullcontext():
                            loss, step_loss, correct, count = self.module(batch)
                        (loss / c.grad_accum).backward()
                    stats += torch.cat([loss.detach()[None] / c.grad_accum, step_loss / c.grad_accum,
                                        correct, count])  # fmt: skip
                # 3. Update.
                torch.nn.utils.clip_grad_norm_(self.draft.parameters(), c.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                step, pos = step + 1, pos + per_step
                # 4. Report (host sync only every log_every steps), checkpoint.
                pending.append(stats)
                if step % c.log_every == 0 or step == total or callback is not None:
                    metrics = self._flush(pending, result, lr, step)
                    acc = "/".join(f"{a:.2f}" for a in metrics["acc"][:4])
                    bar.set_postfix_str(f"loss {metrics['loss']:.3f} acc {acc}")
                bar.update(1)
                # 5. The clock (a budget ends the run like the last step does).
                elapsed = time.perf_counter() - started
                out_of_time = budget is not None and elapsed >= budget
                if step % c.checkpoint_every == 0 or step == total or out_of_time:
                    self._checkpoint(step, epoch, pos, total_steps=total, elapsed_s=elapsed)
                if callback is not None:
                    callback(step, metrics)
                if out_of_time:
                    break
            if out_of_time:
                break
            epoch, pos = epoch + 1, 0
        bar.close()
        if pending:  # steps not reported yet (a run stopped by the clock between reports)
            self._flush(pending, result, lr, step)
        result.step, result.draft = step, self.draft
        if self.rank == 0:
            extra = {"trained_steps": step, "target": self.fingerprint}
            result.drafter = save_drafter(self.draft, self.out / "drafter", c.layout, extra)
        return result

    def _flush(
        self, pending: list[torch.Tensor], result: TrainResult, lr: float, step: int
    ) -> dict[str, Any]:
        """Move the buffered per-step stats to the host (one transfer for several steps)."""
        c = self.config
        stats = torch.stack(pending)  # [n, 1 + 3 * ttt_steps]
        pending.clear()
        if self.world > 1:
            import torch.distributed as dist

            stats[:, : 1 + c.ttt_steps] /= self.world
            dist.all_reduce(stats)
        stats = stats.cpu()  # CPU-GPU sync point
        k = c.ttt_steps
        result.losses += stats[:, 0].tolist()
        correct, count = stats[-1, 1 + k : 1 + 2 * k], stats[-1, 1 + 2 * k :]
        result.step_acc = (correct / count.clamp(min=1)).tolist()
        metrics = {
            "step": step,
            "lr": lr,
            "loss": result.losses[-1],
            "step_loss": stats[-1, 1 : 1 + k].tolist(),
            "acc": result.step_acc,
        }
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
        return metrics

    def _checkpoint(
        self, step: int, epoch: int, pos: int, total_steps: int, elapsed_s: float = 0.0
    ) -> None:
        if self.rank == 0:
            state = {
                "epoch": epoch,
                "batch": pos,
                "total_steps": total_steps,
                "elapsed_s": elapsed_s,
                "target": self.fingerprint,
                "aux_layers": list(self.capture.aux_layers),
                "config": asdict(self.config),
            }
            ckpt.save_checkpoint(
                self.out, step, self.draft, self.optimizer, state, self.config.keep_checkpoints
            )
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def train(config: TrainConfig, llm=None, callback: StepCallback | None = None) -> TrainResult:
    """Train a drafter as `config` says; `llm` reuses an already loaded target (its engine is
    left untouched). Returns the run's losses and the saved drafter's directory."""
    trainer = Trainer(config, llm)
    try:
        return trainer.run(callback)
    finally:
        if trainer.owns_process_group:
            import torch.distributed as dist

            dist.destroy_process_group()
