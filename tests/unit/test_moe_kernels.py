"""The MoE routing kernels (outrider/layers/moe_fused.py) on the CPU under Triton's interpreter,
against their torch references: the router's choice (DeepSeek-V3's grouped sigmoid top-k, with
and without group pruning and renormalisation), the expert layout, and the weighted sum of each
token's expert rows. As in test_fused_kernels.py, TRITON_INTERPRET=1 has to be set before
triton is imported, so the checks run in one subprocess that prints a JSON line per check."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_RESULT = "@@moe-result "

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

# (name, experts, top_k, n_group, topk_group, norm_topk_prob, scaling)
ROUTERS = [
    ("deepseek-v3", 256, 8, 8, 4, True, 2.5),
    ("kimi", 384, 8, 1, 1, True, 2.827),
    ("moonlight", 64, 6, 1, 1, True, 2.446),
    ("odd-unnormed", 24, 3, 3, 2, False, 1.0),
]
# (name, rows, experts): one token, a chunk and a half, many slots past one fill, one expert.
LAYOUTS = [("one", 8, 384), ("chunks", 100, 7), ("wide", 600, 384), ("single", 40, 1)]


def _worker() -> None:  # runs in the subprocess, TRITON_INTERPRET=1
    from outrider.layers import fused, moe_fused
    from outrider.layers.moe import GroupedTopkRouter

    def emit(**line) -> None:
        print(_RESULT + json.dumps(line), flush=True)

    gen = torch.Generator().manual_seed(0)
    for name, experts, top_k, groups, keep, norm, scaling in ROUTERS:
        hidden, tokens = 48, 5
        router = GroupedTopkRouter(hidden, experts, top_k, groups, keep, norm, scaling)
        router.weight.data = torch.randn(experts, hidden, generator=gen)
        router.e_score_correction_bias.data = torch.randn(experts, generator=gen) * 0.5
        x = torch.randn(tokens, hidden, generator=gen)
        want_w, want_ids = router(x)  # CPU: the torch path
        logits = torch.nn.functional.linear(x, router.weight)
        got_w, got_ids = moe_fused.moe_route_no_sync(
            logits, router.e_score_correction_bias, top_k, groups, keep, norm, scaling
        )
        # Order within a token is unspecified on the torch side: compare by expert.
        order_g, order_w = got_ids.argsort(1), want_ids.argsort(1)
        ids_g, ids_w = got_ids.gather(1, order_g), want_ids.gather(1, order_w)
        w_g, w_w = got_w.gather(1, order_g), want_w.gather(1, order_w)
        biased = logits.sigmoid() + router.e_score_correction_bias
        descending = bool((biased.gather(1, got_ids).diff(dim=1) <= 0).all())
        emit(
            name=f"route-{name}",
            same_ids=torch.equal(ids_g, ids_w),
            weight_diff=(w_g - w_w).abs().max().item(),
            descending=descending,
            dtypes=[str(got_w.dtype), str(got_ids.dtype)],
        )

    for name, rows, experts in LAYOUTS:
        ids = torch.randint(0, experts, (rows,), generator=gen)
        ids[: rows // 3] = experts - 1  # one crowded expert, the last
        fused.use_fused = lambda x: True
        got = moe_fused.moe_layout_no_sync(ids, experts)
        fused.use_fused = lambda x: False
        want = moe_fused.moe_layout_no_sync(ids, experts)  # the torch reference
        emit(name=f"layout-{name}", same=torch.equal(got, want), dtype=str(got.dtype))

    for dtype in (torch.float32, torch.bfloat16):
        tokens, top_k, n = 6, 3, 200
        rows = torch.randn(tokens * top_k, n, generator=gen).to(dtype)
        weights = torch.rand(tokens, top_k, generator=gen)
        add = torch.randn(tokens, n, generator=gen).to(dtype)
        summed = (rows.view(tokens, top_k, n).float() * weights[..., None]).sum(1).to(dtype)
        for with_add in (False, True):
            got = moe_fused.moe_combine(rows, weights, add if with_add else None)
            want = summed + add if with_add else summed
            diff = (got.float() - want.float()).abs().max().item()
            emit(
                name=f"combine-{str(dtype).removeprefix('torch.')}-{with_add}",
                scaled=diff / want.float().abs().max().item(),
                same=torch.equal(got, want),
            )


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", "from tests.unit.test_moe_kernels import _worker; _worker()"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT):
            r = json.loads(line[len(_RESULT) :])
            found[r["name"]] = r
    return found


@pytest.mark.parametrize("name", [r[0] for r in ROUTERS])
def test_route_chooses_the_references_experts_with_its_weights(results, name):
    r = results[f"route-{name}"]
    assert r["same_ids"], r
    assert r["weight_diff"] <= 1e-6, r
    assert r["descending"], r  # choices in descending biased score
    assert r["dtypes"] == ["torch.float32", "torch.int64"]


@pytest.mark.parametrize("name", [r[0] for r in LAYOUTS])
def test_layout_kernel_equals_the_torch_reference(results, name):
    r = results[f"layout-{name}"]
    assert r["same"] and r["dtype"] == "torch.int32", r


def test_combine_sums_in_fp32_then_adds_as_torch_rounds(results):
    for with_add in (False, True):
        assert results[f"combine-float32-{with_add}"]["scaled"] <= 1e-6
    # The interpreter truncates fp32 -> bf16 (numpy has no bf16): within one bf16 step, twice.
    for with_add in (False, True):
        assert results[f"combine-bfloat16-{with_add}"]["scaled"] <= 2**-6


def test_route_refuses_groups_that_do_not_divide_the_experts():
    from outrider.layers.moe_fused import moe_route_no_sync

    with pytest.raises(ValueError, match="n_group=5"):
        moe_route_no_sync(torch.zeros(2, 64), torch.zeros(64), 6, 5, 2, True, 1.0)
    with pytest.raises(ValueError, match="topk_group=3"):
        moe_route_no_sync(torch.zeros(2, 64), torch.zeros(64), 6, 2, 3, True, 1.0)
