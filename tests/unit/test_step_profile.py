"""The decode-step breakdown benchmarks report beside the roofline."""

from __future__ import annotations

import pytest

from outrider.bench.step_profile import kind, step_breakdown


def test_kernel_names_sort_into_kinds():
    assert kind("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK_TNT") == "gemm"
    assert kind("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "gemm"
    assert kind("_decode_split_kernel") == "attention"
    assert kind("_write_kv_kernel") == "attention"
    assert kind("rms_norm_kernel") == "other"
    assert kind("void at::native::reduce_kernel<512, 1>") == "other"


def test_breakdown_per_step_and_idle_rest():
    kernels = [("nvjet_a", 3000.0), ("rms_norm_kernel", 200.0), ("rotary_kernel", 100.0),
               ("_decode_split_kernel", 300.0), ("rms_norm_kernel", 200.0)] * 2  # fmt: skip
    out = step_breakdown(kernels, steps=2, step_ms=4.5, roofline_ms=3.6)
    assert out["gemm_ms"] == 3.0 and out["attention_ms"] == 0.3
    assert out["other_kernels_ms"] == 0.5
    assert out["idle_ms"] == pytest.approx(0.7)  # 4.5 - (3.0 + 0.3 + 0.5)
    assert out["kernels_per_step"] == 5.0
    assert list(out["top_other_ms"]) == ["rms_norm_kernel", "rotary_kernel"]
    assert out["top_other_ms"]["rms_norm_kernel"] == 0.4
    # Kernels that overlap the host's step time never make idle negative.
    assert step_breakdown(kernels, steps=2, step_ms=1.0, roofline_ms=3.6)["idle_ms"] == 0.0
    with pytest.raises(ValueError, match="steps=0"):
        step_breakdown(kernels, steps=0, step_ms=1.0, roofline_ms=1.0)
