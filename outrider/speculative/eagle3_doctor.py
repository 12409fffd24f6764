"""Does this EAGLE-3 drafter fit this target? Each way a drafter silently fails, checked by name.

The failures it exists for (all seen in practice, all invisible until acceptance collapses):
a drafter whose aux layer ids were written in one engine's convention and read in the other's
(one layer off: ~25% acceptance), one trained for a sibling model's tokenizer (252 of 32,000
draft slots meant the same token), a d2t rebuilt or shuffled so lm_head rows name the wrong
tokens, and a drafter for another model width. `diagnose` reads config.json, the tensors and
both tokenizers; it never builds the network. `live_check` measures acceptance on real
generations once a caller can build an engine with the drafter.

    report = diagnose("drafters/smollm2-eagle3", None)   # None: the embedded default target
    print(report); assert report.ok
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from outrider.loaders.checkpoint import Checkpoint, open_checkpoint
from outrider.loaders.hf_config import ModelConfig
from outrider.loaders.tokenizer import Tokenizer
from outrider.models.eagle3_io import (
    check_tensors,
    config_from_json,
    engine_aux_ids,
    explicit_aux_ids,
    outrider_aux_layers,
    read_config,
    read_tensors,
    resolve_layout,
)
from outrider.speculative.eagle3_vocab import check_draft_vocab, draft_target_ids

log = logging.getLogger(__name__)

MIN_ACCEPT_LENGTH = 1.3  # tokens per verify; below this a drafter costs more than it gives
_ENGINE = {"sglang": "SGLang", "vllm": "vLLM"}
_A_FILE = {"sglang": "an SGLang-layout file", "vllm": "a vLLM-layout file"}
_OTHER = {"sglang": "vllm", "vllm": "sglang"}
LIVE_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three capital cities in Europe and one fact about each.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Why do we have seasons on Earth?",
)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    message: str  # what was found, with the values; on failure, what to do
    value: float | None = None  # the measured figure, where there is one (overlap, accept len)


@dataclass
class Report:
    """All checks for one (drafter, target) pair. ok <=> every check passed."""

    draft_path: Path
    target: str
    checks: list[Check] = field(default_factory=list)
    # Filled from live_check when the caller can serve the drafter (None: not measured).
    live_accept_length: float | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def __getitem__(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}: have {[c.name for c in self.checks]}")

    def __str__(self) -> str:
        lines = [f"EAGLE-3 drafter {self.draft_path} for target {self.target}"]
        lines += [
            f"  [{'ok' if c.ok else 'FAIL':>4}] {c.name:<11} {c.message}" for c in self.checks
        ]
        failed = [c.name for c in self.checks if not c.ok]
        live = any(c.name == "live" for c in self.checks)
        if failed:
            verdict = f"NOT usable: fix {', '.join(failed)}"
        elif live:
            verdict = "usable: the static checks and the live decode passed"
        else:
            # The static checks say the drafter fits the target; a 1%-accurate drafter fits.
            verdict = (
                "fits the target by the static checks only; acceptance was not measured "
                "(doctor --live N decodes N prompts with it)"
            )
        return "\n".join([*lines, f"  => {verdict}"])


def diagnose(
    draft_path: str | Path,
    target_checkpoint: Checkpoint | str | Path | None,
    *,
    min_overlap: float = 0.9,
    live_prompts: int = 4,
    layout: str | None = None,
    llm_factory: Callable[[], Any] | None = None,
) -> Report:
    """Check the drafter at `draft_path` against a target (an opened Checkpoint, a path, or
    None for the embedded default; only its config and tokenizer are used). `layout` is the
    caller's guess for files outrider did not write (see eagle3_io.resolve_layout). With
    `llm_factory` (builds an LLM serving this drafter) the first `live_prompts` of LIVE_PROMPTS
    are generated and the accept length checked too."""
    path = Path(draft_path)
    target = (
        target_checkpoint
        if hasattr(target_checkpoint, "tokenizer")
        else open_checkpoint(target_checkpoint)
    )
    cfg_t: ModelConfig = target.config
    report = Report(path, str(getattr(target, "path", cfg_t.architecture)))
    try:
        raw = read_config(path)
        layout = resolve_layout(raw, layout)
    except (OSError, ValueError) as e:
        report.add(Check("config", False, str(e)))
        return report
    how = "recorded by outrider" if "outrider" in raw else "inferred"
    if "speculators_config" in raw:  # its aux ids read as vLLM's
        how = "speculators layout, vLLM's aux-id convention"
    report.add(Check("config", True, f"{_ENGINE[layout]} layout ({how})"))
    report.add(_hidden_check(raw, cfg_t))
    report.add(_aux_check(raw, layout, cfg_t))
    report.add(_vocab_size_check(raw, cfg_t))
    try:
        tensors = read_tensors(path)
    except (OSError, ValueError) as e:
        report.add(Check("weights", False, str(e)))
        return report
    if report.ok:  # shapes are only meaningful against a config that fits the target
        report.add(_weights_check(raw, layout, cfg_t, tensors, path))
    draft_tok = _drafter_tokenizer(path, report)
    report.add(_mapping_check(raw, tensors, cfg_t))
    report.add(_overlap_check(raw, tensors, cfg_t, target.tokenizer, draft_tok, min_overlap))
    if llm_factory is not None:
        live = report.add(live_check(llm_factory, LIVE_PROMPTS[:live_prompts]))
        report.live_accept_length = live.value
    return report


def require_fit(draft_path: str | Path, checkpoint: Checkpoint, refusal: str, hint: str) -> None:
    """The doctor's static checks as a gate: a ValueError with the report (between `refusal`
    and `hint`) when any fails. Serving and fine-tuning both pass a drafter through it."""
    report = diagnose(draft_path, checkpoint)
    if not report.ok:
        raise ValueError(f"{refusal}:\n{report}\n{hint}")


def live_check(
    llm_factory: Callable[[], Any],
    prompts: Sequence[str],
    *,
    max_tokens: int = 64,
    min_accept_length: float = MIN_ACCEPT_LENGTH,
) -> Check:
    """Greedy generations through an engine serving the drafter; fails (and logs a warning)
    when the accept length (tokens per verify step, bonus included) is below
    `min_accept_length`. `llm_factory()` returns an object with outrider's LLM.generate and,
    where the model has a chat template, LLM.chat: each prompt is then a user turn, as the
    drafter was trained (sent raw, an instruct model answered two of four prompts with its
    end-of-turn token, and they never speculated)."""
    from outrider.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    try:
        llm = llm_factory()
        if getattr(getattr(llm, "tokenizer", None), "chat_template", None):
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(list(prompts), params)
    except Exception as e:  # the doctor reports every failure instead of stopping at one
        return Check("live", False, f"could not generate with the drafter: {type(e).__name__}: {e}")
    pairs = [
        (m["accept_length"], m.get("num_verify_steps"))
        for m in (o.metrics for o in outputs)
        if m.get("accept_length") is not None
    ]
    if not pairs:
        return Check(
            "live",
            False,
            f"none of {len(outputs)} generations reported an accept length: speculation did "
            f"not run; pass speculative={{'method': 'eagle3', 'draft': <path>}} to the LLM, "
            f"with controller 'fixed' (an adaptive one may choose plain steps throughout)",
        )
    if all(steps for _, steps in pairs):  # weight by verify steps: long outputs count more
        length = sum(a * s for a, s in pairs) / sum(s for _, s in pairs)
    else:
        length = sum(a for a, _ in pairs) / len(pairs)
    msg = (
        f"accept length {length:.2f} tokens per verify over {len(pairs)} of {len(outputs)} prompts"
    )
    if len(pairs) < len(outputs):  # a prompt that never verified a draft has no accept length
        idle = len(outputs) - len(pairs)
        msg += f"; the other {idle} never speculated (no draft was verified)"
    if length >= min_accept_length:
        return Check("live", True, msg, length)
    msg += (
        f" (< {min_accept_length}): the drafter is almost never right and speculation will run "
        f"slower than plain decoding; usual causes: aux layers one off, a vocabulary for "
        f"another tokenizer, or a drafter trained for another target"
    )
    log.warning("EAGLE-3 drafter FAILS live: %s", msg)
    return Check("live", False, msg, length)


# ---- static checks ---------------------------------------------------------------------


def _hidden_check(raw: dict[str, Any], cfg_t: ModelConfig) -> Check:
    th = raw.get("target_hidden_size") or raw.get("hidden_size")
    if th == cfg_t.hidden_size:
        return Check("hidden", True, f"target_hidden_size {th} = the target's hidden_size")
    return Check(
        "hidden",
        False,
        f"the drafter reads target hidden states of width {th} but the target's hidden_size is "
        f"{cfg_t.hidden_size}: it was trained for another model; use or train one for this target",
    )


def _aux_check(raw: dict[str, Any], layout: str, cfg_t: ModelConfig) -> Check:
    n, default = cfg_t.num_hidden_layers, tuple(cfg_t.aux_hidden_layers)
    engine, other = _ENGINE[layout], _OTHER[layout]
    recorded = (raw.get("outrider") or {}).get("aux_layers")
    try:
        ids = explicit_aux_ids(raw, layout)
    except ValueError as e:
        return Check("aux_layers", False, str(e))
    if ids is None:
        if recorded is not None and tuple(recorded) != default:
            return Check(
                "aux_layers",
                False,
                f"config.json names no ids, so {engine} captures its default {list(default)}, "
                f"but the drafter was trained on {recorded}; re-export it",
            )
        return Check(
            "aux_layers", True, f"no explicit ids: {engine} captures its default {list(default)}"
        )
    aux = outrider_aux_layers(ids, layout)
    where = f"{engine} ids {ids} = inputs of layers {list(aux)}"
    if recorded is not None and tuple(recorded) != aux:
        return Check(
            "aux_layers",
            False,
            f"{where}, but outrider.aux_layers records {recorded}: the file was edited; make "
            f"them agree (re-export the drafter)",
        )
    if any(not 0 <= i < n for i in aux) or len(set(aux)) != len(aux):
        return Check(
            "aux_layers",
            False,
            f"{where}: not distinct layers of the {n}-layer target; it was made for another "
            f"model or in the other engine's convention",
        )
    if aux == default:
        return Check("aux_layers", True, f"{where}, the EAGLE-3 default")
    if recorded is None and outrider_aux_layers(ids, other) == default:
        fixed = engine_aux_ids(default, layout)
        return Check(
            "aux_layers",
            False,
            f"aux ids {ids} look like {_ENGINE[other]}'s convention in {_A_FILE[layout]}: "
            f"one layer off ({engine} would capture the inputs of layers {list(aux)}, EAGLE-3's "
            f"are {list(default)}); re-export with --format {layout} (ids {fixed}), or load it "
            f"as layout={other!r} if it was written for {_ENGINE[other]}",
        )
    return Check(
        "aux_layers",
        True,
        f"{where}: not the default {list(default)}; it must be what training used",
    )


def _vocab_size_check(raw: dict[str, Any], cfg_t: ModelConfig) -> Check:
    v = raw.get("vocab_size")
    if v == cfg_t.vocab_size:
        return Check("vocab_size", True, f"vocab_size {v} = the target's")
    return Check(
        "vocab_size",
        False,
        f"the drafter was trained for a vocabulary of {v} tokens, the target's has "
        f"{cfg_t.vocab_size}: a drafter for another tokenizer (a sibling model's?) cannot serve "
        f"this target; use or train one for it",
    )


def _weights_check(
    raw: dict[str, Any],
    layout: str,
    cfg_t: ModelConfig,
    tensors: dict[str, torch.Tensor],
    path: Path,
) -> Check:
    try:
        check_tensors(tensors, config_from_json(raw, cfg_t, layout), path)
    except ValueError as e:
        return Check("weights", False, str(e))
    dtype = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    return Check("weights", True, f"{len(tensors)} tensors, shapes match config.json ({dtype})")


def _mapping_check(
    raw: dict[str, Any], tensors: dict[str, torch.Tensor], cfg_t: ModelConfig
) -> Check:
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    draft = raw.get("draft_vocab_size") or raw.get("vocab_size")
    if d2t is None:
        if draft == cfg_t.vocab_size:
            return Check("d2t", True, "no d2t and a full-size draft vocabulary: identity mapping")
        return Check(
            "d2t",
            False,
            f"no d2t but draft_vocab_size={draft} < {cfg_t.vocab_size}: nothing says which "
            f"token each lm_head row is; re-export the drafter with its d2t",
        )
    problems = [] if d2t.numel() == draft else [f"d2t has {d2t.numel()} slots, config {draft}"]
    problems += check_draft_vocab(d2t, t2d, cfg_t.vocab_size)
    if problems:
        return Check("d2t", False, "; ".join(problems))
    note = "" if t2d is not None else " (no t2d shipped: derived from d2t)"
    return Check("d2t", True, f"{d2t.numel()} slots, increasing, in range, t2d consistent{note}")


def _overlap_check(
    raw: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    cfg_t: ModelConfig,
    target_tok: Tokenizer,
    draft_tok: Tokenizer | None,
    min_overlap: float,
) -> Check:
    """Share of draft slots whose target id is in range, marked in t2d and (with a drafter
    tokenizer) spelled the same by both tokenizers."""
    vocab = cfg_t.vocab_size
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:  # identity (the mapping check says whether that is allowed)
        d2t = torch.zeros(
            raw.get("draft_vocab_size") or raw.get("vocab_size") or 0, dtype=torch.long
        )
    ids = draft_target_ids(d2t.cpu()).tolist()
    n = len(ids)
    if n == 0:
        return Check("overlap", False, "the drafter has an empty draft vocabulary", 0.0)
    if raw.get("vocab_size") != vocab and draft_tok is None:
        return Check(
            "overlap",
            False,
            f"cannot map the drafter's {raw.get('vocab_size')}-token vocabulary onto the "
            f"target's {vocab} tokens and it ships no tokenizer to compare: assume it does not fit",
            0.0,
        )
    marked = t2d.cpu().tolist() if t2d is not None and t2d.dim() == 1 else None
    limit = min(vocab, len(marked)) if marked is not None else vocab
    same = [
        i
        for i in ids
        if 0 <= i < limit
        and (marked is None or marked[i])
        and (draft_tok is None or _same_token(draft_tok, target_tok, i))
    ]
    frac = len(same) / n
    basis = "in both tokenizers" if draft_tok is not None else "by d2t and t2d"
    msg = f"{len(same)} of {n} draft slots ({frac:.1%}) map to the same token ({basis})"
    if frac >= min_overlap:
        shown = [i for i in ids[:6] if 0 <= i < target_tok.vocab_size]
        sample = [target_tok.decode([i], skip_special_tokens=False) for i in shown]
        return Check("overlap", True, f"{msg}; first draft tokens {sample}", frac)
    return Check(
        "overlap",
        False,
        f"{msg}, below {min_overlap:.0%}: the drafter's vocabulary does not map onto this "
        f"target's tokenizer; use a drafter trained for this target",
        frac,
    )


def _same_token(a: Tokenizer, b: Tokenizer, i: int) -> bool:
    if i >= a.vocab_size or i >= b.vocab_size:
        return False
    piece = a.id_to_token(i)
    if piece is not None and piece == b.id_to_token(i):
        return True
    return a.decode([i], skip_special_tokens=False) == b.decode([i], skip_special_tokens=False)


def _drafter_tokenizer(path: Path, report: Report) -> Tokenizer | None:
    """The tokenizer a drafter directory ships (tokenizer.json), if any."""
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_hf_dir(path)
    except Exception as e:  # a tokenizers error type is not public; report, don't stop
        report.add(Check("tokenizer", False, f"the drafter's tokenizer.json is unreadable: {e}"))
        return None
