"""`drafter train`'s target engine: its small KV pool (--target-num-blocks) lowers the engine's
serving context, which capture does not use, so the engine's advice to raise
gpu_memory_utilization / cpu_kv_bytes / num_blocks (flags train does not have) stays silent."""

from __future__ import annotations

import logging

from outrider.train.config import TrainConfig
from outrider.train.trainer import target_llm


def test_target_engine_does_not_advise_flags_train_lacks(caplog):
    config = TrainConfig(device="cpu", dtype="float32", target_num_blocks=2)
    with caplog.at_level(logging.INFO):
        llm = target_llm(config, "cpu")
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "gpu_memory_utilization" not in said and "cpu_kv_bytes" not in said, said
    # Capture reads the runner's context, the checkpoint's full one, not the engine's.
    assert llm.engine.runner.max_model_len > 2 * config.target_num_blocks * 16
    # The engine's own warning is back for everything else.
    assert logging.getLogger("outrider.engine.limits").getEffectiveLevel() <= logging.WARNING
