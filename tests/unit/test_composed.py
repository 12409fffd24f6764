"""Composed requests (train/composed.py) and the near-duplicate check that keeps held-out
prompts, and requests a word away from them, out of drafter data (train/datagen.py)."""

import re

import pytest

from outrider.bench.datasets import HELDOUT, HELDOUT_FRESH
from outrider.train.composed import _TEMPLATES, COMPOSED_CAPACITY, compose_prompts
from outrider.train.datagen import _content_words, near_duplicate


def test_composed_requests_are_distinct_filled_and_stable():
    many = compose_prompts(3000, seed=1)
    assert len(many) == len(set(many)) == 3000
    assert compose_prompts(300, seed=1) == many[:300]  # a longer list starts with the shorter
    assert compose_prompts(300, seed=2) != many[:300]
    assert not [p for p in many if re.search(r"[{}]", p) or not p[0].isupper()]
    # Templates take turns: the first 10 * len(_TEMPLATES) requests use every template.
    first = compose_prompts(10 * len(_TEMPLATES))
    lead = {re.split(r"\{", t)[0] for t in _TEMPLATES if not t.startswith("{")}
    assert all(any(p.startswith(x) for p in first) for x in lead)


def test_composed_requests_stop_at_what_the_templates_can_make():
    every = compose_prompts(COMPOSED_CAPACITY + 100)
    assert len(every) == len(set(every)) == COMPOSED_CAPACITY > 5000
    assert compose_prompts(0) == []
    with pytest.raises(ValueError, match="n=-1"):
        compose_prompts(-1)


def test_near_duplicates_ask_about_the_same_thing():
    held = [_content_words(p) for p in HELDOUT]
    assert all(near_duplicate(p, held) for p in HELDOUT)
    assert near_duplicate("WHAT is the difference between weather and climate?!", held)
    assert near_duplicate("Write a two-paragraph story about a robot who learns to paint.", held)
    assert not near_duplicate("What is the difference between wool and cotton?", held)
    assert not near_duplicate("Write a Rust program that reverses a string.", held)
    assert not near_duplicate("Tell me about volcanoes.", held)


def test_the_two_heldout_sets_are_apart():
    assert len(HELDOUT) >= 16 and len(HELDOUT_FRESH) >= 32
    first = [_content_words(p) for p in HELDOUT]
    assert not [p for p in HELDOUT_FRESH if near_duplicate(p, first)]


def test_a_negative_composed_count_is_refused():
    from outrider.train.config import DatagenConfig

    assert DatagenConfig(composed=500).composed == 500
    with pytest.raises(ValueError, match="composed.*-3.*>= 0"):
        DatagenConfig(composed=-3)
