"""The training set: JSONL samples {"id", "input_ids", "loss_mask"} (what datagen writes; its
"conversations" beside them are for reading, the ids are what is learned) or conversations in
any common layout (`read_conversations`), the draft vocabulary counted from them, and their
packing into fixed [rows, max_len] batches.

Packing: an epoch's samples, shuffled by (seed, epoch), are laid end to end into rows of
max_len tokens (a sample that does not fit starts the next row; longer ones are truncated);
micro-batches take `rows` rows each, padded with empty rows so every batch has one shape (a
compiled kernel sees one size). Everything is a pure function of (samples, seed, epoch), so a
resumed run finds its place from (epoch, batch index) alone.

Worked example, max_len 8, samples of 5, 2, 4 and 9 tokens in shuffled order:
    row 0: [s0 s0 s0 s0 s0 s1 s1 .]    row 1: [s2 s2 s2 s2 . . . .]    row 2: [s3 x 8] (truncated)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from outrider.conversations import Conversation, read_conversations


@dataclass(frozen=True)
class Sample:
    """Tensors, not lists: a Python int costs 28 bytes, a million samples of 2k tokens would
    not fit in a host's memory as lists."""

    id: str
    input_ids: torch.Tensor  # [n] int32
    loss_mask: torch.Tensor  # [n] bool, True on the assistant's (learned) tokens

    def prompt(self) -> list[int]:
        """The token ids before the first learned token (what the target was asked)."""
        first = int(self.loss_mask.int().argmax()) if bool(self.loss_mask.any()) else len(self)
        return self.input_ids[:first].tolist()

    def __len__(self) -> int:
        return self.input_ids.numel()


class ChatRenderer(Protocol):
    """Renders and tokenizes a conversation the way the target is prompted (outrider.LLM)."""

    def apply_chat_template(
        self, conversation: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...

    def encode_chat_text(self, text: str) -> list[int]: ...


def read_samples(
    path: str | Path, vocab_size: int | None = None, chat: ChatRenderer | None = None
) -> list[Sample]:
    """Read a training set: datagen's JSONL samples (streamed; a truncated last line, a crash
    mid-write, is skipped), or a conversation file (`read_conversations`) whose assistant turns
    are learned as `chat` (the target's LLM) renders them (`conversation_sample`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset {str(path)!r} not found: create it with `outrider drafter datagen`"
        )
    if _holds_samples(path):
        samples = _read_sample_lines(path, vocab_size)
    else:
        samples = _conversation_samples(path, vocab_size, chat)
    if not samples:
        raise ValueError(
            f"dataset {str(path)!r} holds no samples: generate some with `outrider drafter "
            f"datagen` (num_samples > 0)"
        )
    if not any(bool(s.loss_mask.any()) for s in samples):
        raise ValueError(
            f"dataset {str(path)!r}: no sample has a loss-masked (response) token, so there is "
            f"nothing to learn: regenerate it with max_new_tokens > 0"
        )
    return samples


def _holds_samples(path: Path) -> bool:
    """Whether the file is datagen's (its first record has input_ids, which decides before the
    "conversations" datagen writes beside them); an empty file counts."""
    with open(path) as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        return True
    try:
        rec = json.loads(first)
    except json.JSONDecodeError:
        return False  # a pretty-printed JSON file, or not JSON: read_conversations says which
    return isinstance(rec, dict) and "input_ids" in rec


def _read_sample_lines(path: Path, vocab_size: int | None) -> list[Sample]:
    samples = []
    bad: tuple[int, str] | None = None  # an unparsable line: fatal unless it is the last
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if bad is not None:
                raise ValueError(f"{path}:{bad[0]} is not valid JSON: fix or delete that line")
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad = (n, line)  # the last line of an interrupted write, if nothing follows
                continue
            samples.append(_sample(rec, path, n, vocab_size))
    return samples


def _conversation_samples(
    path: Path, vocab_size: int | None, chat: ChatRenderer | None
) -> list[Sample]:
    conversations = read_conversations(path)
    if chat is None:
        raise ValueError(
            f"dataset {str(path)!r} holds conversations, not token ids: run `outrider drafter "
            f"datagen --user-file {path}` and train on its output (the target answers the "
            f"prompts, as it will when the drafter serves it)"
        )
    samples = [s for c in conversations if (s := conversation_sample(c, chat)) is not None]
    if conversations and not samples:
        raise ValueError(
            f"dataset {str(path)!r} holds prompts without answers, so there is nothing to "
            f"learn: run `outrider drafter datagen --user-file {path}` to have the target answer"
        )
    for s in samples:
        top = int(s.input_ids.max()) if len(s) else 0
        if vocab_size is not None and top >= vocab_size:
            raise ValueError(
                f"{path}: conversation {s.id}: token id {top} is outside the target's vocabulary "
                f"of {vocab_size}: render it with the target's own chat template (chat=its LLM)"
            )
    return samples


def _sample(rec: dict, path: Path, n: int, vocab_size: int | None) -> Sample:
    ids, mask = rec.get("input_ids"), rec.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise ValueError(
            f"{path}:{n}: a sample needs input_ids and loss_mask lists of equal length, got "
            f"{type(ids).__name__} / {type(mask).__name__}: regenerate the dataset"
        )
    if vocab_size is not None and ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise ValueError(
            f"{path}:{n}: token ids {min(ids)}..{max(ids)} fall outside the target's vocabulary "
            f"of {vocab_size}: the dataset was made with another tokenizer; regenerate it"
        )
    return Sample(
        str(rec.get("id", n)),
        torch.tensor(ids, dtype=torch.int32),
        torch.tensor(mask, dtype=torch.bool),
    )


def count_tokens(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    """[vocab] int64: how often each target token is a loss-masked (learned) token."""
    ids = torch.cat([s.input_ids[s.loss_mask].long() for s in samples])
    return torch.bincount(ids, minlength=vocab_size)


def pack_rows(samples: list[Sample], max_len: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices per row for one epoch (see the module docstring)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(samples), generator=g).tolist()
    rows: list[list[int]] = []
    used = max_len
    for i in order:
        n = min(len(samples[i]), max_len)
        if n < 2:
            continue  # nothing to predict
        if used + n > max_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def micro_batches(rows: list[list[int]], rows_per_batch: int) -> list[list[list[int]]]:
    """Rows grouped rows_per_batch at a time; the last group padded with empty rows."""
    out = [rows[i : i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]
    if out and len(out[-1]) < rows_per_batch:
        out[-1] = out[-1] + [[] for _ in range(rows_per_batch - len(out[-1]))]
    return out


@dataclass
class PackedLayout:
    """Where each captured token lands in the [B, T] batch, and the per-row metadata."""

    seqs: list[list[int]]  # token ids per sequence, in capture order
    dest: torch.Tensor  # [N] flat index into B * T of each captured token
    input_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    seq_ids: torch.Tensor  # [B, T], -1 on padding
    loss_mask: torch.Tensor  # [B, T] bool


def layout_batch(samples: list[Sample], batch: list[list[int]], max_len: int) -> PackedLayout:
    """Host-side index arithmetic for one micro-batch (one small loop per sequence)."""
    b = len(batch)
    ids = torch.zeros(b, max_len, dtype=torch.int64)
    pos = torch.zeros(b, max_len, dtype=torch.int64)
    seq = torch.full((b, max_len), -1, dtype=torch.int64)
    mask = torch.zeros(b, max_len, dtype=torch.bool)
    seqs, dest = [], []
    k = 0
    for r, row in enumerate(batch):
        start = 0
        for i in row:
            s = samples[i]
            n = min(len(s), max_len - start)
            ids[r, start : start + n] = s.input_ids[:n]
            mask[r, start : start + n] = s.loss_mask[:n]
            pos[r, start : start + n] = torch.arange(n)
            seq[r, start : start + n] = k
            seqs.append(s.input_ids[:n].tolist())
            dest.append(torch.arange(r * max_len + start, r * max_len + start + n))
            k, start = k + 1, start + n
    flat = torch.cat(dest) if dest else torch.zeros(0, dtype=torch.int64)
    return PackedLayout(seqs, flat, ids, pos, seq, mask)


def conversation_sample(conversation: Conversation, chat: ChatRenderer) -> Sample | None:
    """The conversation as the target's chat template renders it, learned (loss_mask) on each
    answer: the tokens the template adds after that turn's generation prompt, the end-of-turn
    marker included, as datagen masks what the target generated. None without an answer.

    Worked example, ChatML, [user "Hi", assistant "Hello", user "Bye", assistant "Ciao"]:
        <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n  Hello<|im_end|>\n  ...
        0 ...................................................... 1 ........... 1    0 ...
    Earlier answers keep their mask when the template re-renders them unchanged (some drop an
    earlier turn's reasoning, and then only the last answer is learned)."""
    msgs = list(conversation.messages)
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or not any(p["role"] == "user" for p in msgs[:i]):
            continue  # an answer to nothing: rendered with the turns after it, never learned
        prompt = chat.encode_chat_text(chat.apply_chat_template(msgs[:i], True))
        full = chat.encode_chat_text(chat.apply_chat_template(msgs[: i + 1], False))
        keep = mask if full[: len(ids)] == ids else []
        start = len(prompt) if full[: len(prompt)] == prompt else len(full)
        start = max(start, len(keep))
        mask = keep + [0] * (start - len(keep)) + [1] * (len(full) - start)
        ids = full
    if not any(mask):
        return None
    return Sample(
        conversation.id,
        torch.tensor(ids, dtype=torch.int32),
        torch.tensor(mask, dtype=torch.bool),
    )
