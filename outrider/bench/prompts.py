"""What `bench serve` sends: built-in prompts (bench/datasets.py), a conversation file's first
user turns (outrider/conversations.py reads any layout) or random words of a given length, and
when (all at once, or Poisson arrivals)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outrider.bench.serve import BenchConfig


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int


# Short common words, one token each (with their leading space) in BPE vocabularies: a random
# prompt of N of them is about N tokens; the server's usage gives the exact count.
# fmt: off
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "at", "be",
    "by", "this", "had", "not", "but", "from", "or", "have", "an", "they", "which", "one", "you",
    "were", "all", "we", "her", "she", "there", "would", "their", "will", "when", "who", "him",
    "been", "has", "more", "if", "no", "out", "so", "said", "what", "up", "its", "about", "into",
    "than", "them", "can", "only", "other", "new", "some", "could", "time", "these", "two", "may",
    "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even",
    "most", "made", "after", "also", "did", "many",
)
# fmt: on


def load_prompts(cfg: BenchConfig) -> list[Prompt]:
    """cfg.num_prompts prompts from cfg.dataset, shuffled by cfg.seed (a set smaller than
    num_prompts is cycled)."""
    rng = random.Random(cfg.seed)
    if cfg.dataset == "random":
        return [
            Prompt(" ".join(rng.choices(_WORDS, k=cfg.random_input_len)), cfg.random_output_len)
            for _ in range(cfg.num_prompts)
        ]
    if cfg.dataset == "sharegpt":
        texts = file_prompts(cfg.dataset_path)
    else:
        from outrider.bench.datasets import GROUNDED, HELDOUT, HELDOUT_FRESH

        # grounded: tasks on a text given in the prompt (repeat, rewrite, fix, answer from it:
        # outputs reuse it, where n-gram drafts pay); builtin: those and open questions.
        texts = GROUNDED if cfg.dataset == "grounded" else GROUNDED + HELDOUT + HELDOUT_FRESH
    order = rng.sample(texts, len(texts))
    return [Prompt(order[i % len(order)], cfg.max_tokens) for i in range(cfg.num_prompts)]


def file_prompts(path: str | Path) -> list[str]:
    """The first user turn of every record of a conversation file (outrider/conversations.py
    reads any layout: ShareGPT, messages, prompt lists; JSON or JSONL); records without one are
    skipped."""
    from outrider.conversations import ACCEPTED, read_conversations

    if not Path(path).is_file():
        raise FileNotFoundError(
            f"--dataset sharegpt: no file {str(path)!r}: give a JSON or JSONL file of records "
            f"({ACCEPTED}), e.g. ShareGPT_V3_unfiltered_cleaned_split.json"
        )
    conversations = read_conversations(path)
    prompts = [turns[0].strip() for c in conversations if (turns := c.user_turns())]
    if not prompts:
        raise ValueError(
            f"{path}: none of its {len(conversations)} records has a user turn: {ACCEPTED}"
        )
    return prompts


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the point's start at which each request arrives: a Poisson process of
    `rate` per second (exponential gaps; the first at 0), or all at 0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times
