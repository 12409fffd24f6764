"""Seeded sampling through `outrider serve` on CUDA in bf16, the dtype users serve, with graphs
and the default adaptive EAGLE-3 (the shipped drafter): tests/e2e/test_server_seeded.py's check
(the same seeded request gives the same text alone, inside a batch of 16 and beside a load of
long streams) in the deterministic mode. The default mode is left to the fp32 CPU test: in bf16
its kernels change a row's last bits with the batch, so a near-tie between two noised logits
may fall either way; that is what the deterministic mode is for."""

from __future__ import annotations

import pytest

from tests.e2e.test_server_seeded import (  # noqa: F401  (collected here with this `served`)
    seeded_server,
    test_a_seed_gives_one_text_alone_batched_and_under_load,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def served():
    with seeded_server({"dtype": "bfloat16", "device": "cuda", "deterministic": True}) as pair:
        yield pair
