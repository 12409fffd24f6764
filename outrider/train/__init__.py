"""EAGLE-3 drafter training for the target outrider serves (`outrider drafter ...`):

datagen.py    conversations answered by the target itself (JSONL)
dataset.py    samples, draft-vocabulary counts, packing into [rows, max_len] batches
capture.py    target features from the serving forward (private KV pool), disk cache
batch.py      samples + features -> one TTTBatch
ttt.py        the training-time-test unroll, its attention mask and loss
draft.py      a fresh trainable drafter
trainer.py    train(config): AdamW, schedule, accumulation, DDP, checkpoints, resume
checkpoint.py pickle-free atomic checkpoints
evaluate.py   per-step accuracy, estimated and in-engine accept length
config.py     DatagenConfig, TrainConfig, EvalConfig
cli.py        add_drafter_parser / cmd_drafter
"""
