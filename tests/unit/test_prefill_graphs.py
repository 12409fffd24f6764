"""PREFILL graphs (executor/cuda_graph.py): steps with prompt chunks beside decode rows replay a
graph of B sequences and T tokens, the rest padded. On the CPU: the keys a runner captures and
picks, the static buffers a step leaves (empty sequences, the padding sequence in the scratch
block), and, under Triton's interpreter, a tiny model's forward over those buffers against the
same step computed eagerly. Capture and replay themselves are in tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import pytest
import torch

from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq
from outrider.executor.cuda_graph import GraphKey, GraphRunner
from outrider.executor.inputs import build_inputs
from tests.unit.test_triton_attention import interpreter_worker, serve

BLOCK = 16
SCRATCH = 63  # the pool's last block: no sequence here is given it


def _runner(
    model=None, backend=None, batch_sizes=(1, 2, 4, 8), prefill_tokens=(32, 64), mixed_prefill=True
):
    return GraphRunner(
        model if model is not None else torch.nn.Linear(1, 1),
        backend,
        max_blocks=8,
        scratch_block=SCRATCH,
        block_size=BLOCK,
        batch_sizes=batch_sizes,
        prefill_tokens=prefill_tokens,
        mixed_prefill=mixed_prefill,
    )


def _mixed_batch(decoding: list[tuple[list[int], int]], chunk: list[int]) -> ScheduledBatch:
    """Decode rows (the sequence's tokens so far, its first block) and a new prompt's chunk
    (blocks 40..): what a server's step looks like when a request arrives."""
    seqs = []
    for tokens, first in decoding:
        req = Request(prompt_token_ids=tokens[:-1], params=SamplingParams(temperature=0))
        blocks = list(range(first, first + 1 + len(tokens) // BLOCK))
        seqs.append(ScheduledSeq(req, [tokens[-1]], len(tokens) - 1, blocks, sample=True))
    req = Request(prompt_token_ids=list(chunk), params=SamplingParams(temperature=0))
    blocks = list(range(40, 40 + -(-len(chunk) // BLOCK)))
    seqs.append(ScheduledSeq(req, list(chunk), 0, blocks, sample=True))
    return ScheduledBatch(ForwardMode.PREFILL, seqs)


def test_prefill_keys_are_captured_first_and_at_batch_sizes_up_to_their_tokens():
    keys = _runner(batch_sizes=(1, 2, 4, 8, 16, 64), prefill_tokens=(8, 32)).capture_keys()
    prefill = [k for k in keys if k.mode == ForwardMode.PREFILL]
    assert keys[: len(prefill)] == prefill  # the largest steps first, into the shared pool
    assert [(k.batch, k.tokens) for k in prefill] == [(16, 32), (4, 32), (1, 32), (4, 8), (1, 8)]
    assert all(k.num_tokens == k.tokens and k.num_seqs == k.batch + 1 for k in prefill)
    decode = keys[len(prefill)]
    assert (decode.mode, decode.num_tokens, decode.num_seqs) == (ForwardMode.DECODE, 64, 64)


def test_a_step_takes_the_smallest_prefill_graph_that_holds_it():
    r = _runner(batch_sizes=(1, 2, 4, 8, 16), prefill_tokens=(32, 64))
    assert r.prefill_key(1, 20) == GraphKey(ForwardMode.PREFILL, 1, 0, 32)
    assert r.prefill_key(3, 32) == GraphKey(ForwardMode.PREFILL, 4, 0, 32)
    assert r.prefill_key(5, 33) == GraphKey(ForwardMode.PREFILL, 16, 0, 64)
    assert r.prefill_key(20, 40) is None  # more sequences than any graph
    assert r.prefill_key(2, 65) is None  # more tokens: eager
    assert _runner(prefill_tokens=()).prefill_key(1, 1) is None


def test_can_run_sends_prompt_steps_to_prefill_graphs_but_not_tree_masks_or_long_ones():
    """(Mixed steps only where mixed_prefill, the engine's default; off, they run eager.)"""
    r = _runner()
    batch = _mixed_batch([(list(range(3, 23)), 0), (list(range(5, 40)), 8)], list(range(7, 16)))
    inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
    assert r.can_run(inputs) == GraphKey(ForwardMode.PREFILL, 4, 0, 32)
    long = _mixed_batch([(list(range(3, 23)), 0)], list(range(3, 3 + 70)))
    assert r.can_run(build_inputs(long, BLOCK, torch.device("cpu"))) is None
    alone = _mixed_batch([], list(range(7, 16)))  # a prompt with no decode rows beside it
    unmixed = _runner(mixed_prefill=False)
    assert unmixed.can_run(inputs) is None  # decode rows beside the chunk: eager
    alone_inputs = build_inputs(alone, BLOCK, torch.device("cpu"))
    assert unmixed.can_run(alone_inputs) == GraphKey(ForwardMode.PREFILL, 1, 0, 32)
    inputs.attn.tree_mask = torch.ones(inputs.input_ids.shape[0], 1, dtype=torch.bool)
    assert r.can_run(inputs) is None


def test_a_loaded_step_leaves_empty_sequences_and_the_rest_of_its_tokens_in_scratch():
    r = _runner()
    decoding = [(list(range(3, 23)), 0), (list(range(5, 40)), 8)]
    batch = _mixed_batch(decoding, list(range(7, 16)))  # 2 decode rows + 9 tokens = 11
    inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
    key = r.can_run(inputs)  # (PREFILL, 4 sequences, 32 tokens)
    # Fill the buffers with a bigger step first: what it leaves must not show through.
    big = _mixed_batch(decoding + [(list(range(9, 30)), 16)], list(range(1, 29)))
    big_inputs = build_inputs(big, BLOCK, torch.device("cpu"))
    r.load(r.can_run(big_inputs), big_inputs)
    assert r.load(key, inputs) == 11
    s = r.inputs
    starts = s.query_start_loc[: key.num_seqs + 1].tolist()
    assert starts == [0, 1, 2, 11, 11, 32]  # 3 real, 1 empty, the padding's 21 tokens
    assert s.seq_lens[: key.num_seqs].tolist() == [20, 35, 9, 0, 21]
    assert torch.equal(s.input_ids[:11], inputs.input_ids)
    assert torch.equal(s.slot_mapping[:11], inputs.attn.slot_mapping)
    assert s.input_ids[11:32].eq(0).all()
    assert s.positions[11:32].tolist() == list(range(21))
    slots = s.slot_mapping[11:32]
    assert slots.div(BLOCK, rounding_mode="floor").eq(SCRATCH).all()  # only the scratch block
    assert s.block_tables[3:5].eq(SCRATCH).all()
    assert s.block_tables[0, :3].tolist() == [0, 1, 0]  # as build_inputs padded it
    assert s.block_tables[0, 3:].eq(SCRATCH).all()
    meta = r._metadata(key)
    assert meta.mode == ForwardMode.PREFILL and meta.batch_size == 5
    assert max(meta.query_lens_cpu) == 32  # the grid holds any split of the 32 tokens


# -- under the interpreter: the forward over the padded buffers ------------------------------


def _check_padded_prefill_step() -> dict:
    """A tiny Llama's mixed step (2 decode rows + a 9-token chunk), eagerly and over the
    PREFILL graph's padded buffers, both with the Triton backend: the real tokens' hidden
    states, and what the step wrote to the KV pool outside the scratch block."""
    from outrider.layers.attn_backends.triton import TritonBackend
    from outrider.layers.forward_context import ForwardContext, forward_context
    from tests.tiny import hf_reference, outrider_model, prefill_batch, tiny_hf_config

    cfg = tiny_hf_config(num_hidden_layers=2)
    model, pool = outrider_model(cfg, hf_reference(cfg).state_dict(), num_blocks=64)
    backend = TritonBackend()

    def eager(batch):
        inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
        backend.prepare(inputs.attn)
        with torch.inference_mode(), forward_context(ForwardContext(inputs.attn, backend)):
            return model(inputs.input_ids, inputs.positions, ())[0]

    a, b = list(range(3, 23)), list(range(5, 40))
    eager(prefill_batch([a[:-1]], BLOCK, 0))
    eager(prefill_batch([b[:-1]], BLOCK, 8))
    batch = _mixed_batch([(a, 0), (b, 8)], list(range(7, 16)))
    kv = {name: t.clone() for name, t in pool.layer(0).items()}
    want = eager(batch)
    kv_eager = {name: t.clone() for name, t in pool.layer(0).items()}
    for name, t in kv.items():  # as it was before the step
        pool.layer(0)[name].copy_(t)
    runner = _runner(model, backend)
    inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
    key = runner.can_run(inputs)
    n = runner.load(key, inputs)
    s = runner.inputs
    with torch.inference_mode():
        got = runner._forward(
            s.input_ids[: key.num_tokens], s.positions[: key.num_tokens], {}, runner._metadata(key)
        )[0][:n]
    # (CPU GEMMs may round a row differently at another row count: close, not equal)
    slots = inputs.attn.slot_mapping
    written, untouched = 0.0, True
    for name, before in kv.items():
        after = pool.layer(0)[name]
        flat_after, flat_before = after.flatten(0, 1), before.flatten(0, 1)
        step = kv_eager[name].flatten(0, 1)[slots]
        written = max(written, (flat_after[slots] - step).abs().max().item())
        others = torch.ones(flat_after.shape[0], dtype=torch.bool)
        others[slots] = False
        others[SCRATCH * BLOCK :] = False
        untouched &= torch.equal(flat_after[others], flat_before[others])
    return {
        "key": [key.mode.value, key.batch, key.tokens],
        "tokens": n,
        "hidden_diff": (got - want).abs().max().item(),
        "hidden_scale": want.abs().max().item(),
        "kv_diff": written,
        "kv_untouched": untouched,
    }


def _serve() -> None:
    serve({"padded_prefill_step": _check_padded_prefill_step})


@pytest.fixture(scope="module")
def interpreter():
    yield from interpreter_worker("tests.unit.test_prefill_graphs")


def test_a_step_over_the_padded_buffers_computes_what_it_computes_eagerly(interpreter):
    res = interpreter("padded_prefill_step")
    assert res["key"][1:] == [4, 32] and res["tokens"] == 11
    assert res["hidden_scale"] > 0.1
    assert res["hidden_diff"] <= 1e-5 * res["hidden_scale"], res
    assert res["kv_diff"] <= 1e-5  # the step's own KV, as eagerly
    assert res["kv_untouched"]  # the padding wrote nowhere but the scratch block


def test_a_prefill_that_cannot_be_captured_leaves_those_steps_eager(monkeypatch, caplog):
    r = _runner(batch_sizes=(1, 4), prefill_tokens=(8, 16))
    done = []

    def capture(key):
        if key.mode == ForwardMode.PREFILL:
            raise RuntimeError("operation not permitted when stream is capturing")
        done.append(key)
        r.graphs[key] = (None, (), {})

    monkeypatch.setattr(r, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    r.capture()
    assert [k.mode for k in done] == [ForwardMode.DECODE] * 2  # the rest, as before
    assert r.prefill_tokens == () and r.prefill_key(1, 4) is None
    assert "run eagerly" in caplog.text and "not permitted" in caplog.text
    with pytest.raises(RuntimeError, match="decode"):  # a decode graph's failure still stops
        monkeypatch.setattr(
            r, "_capture", lambda key: (_ for _ in ()).throw(RuntimeError("decode"))
        )
        r.capture()


def test_decode_keys_prepare_a_backend_that_knows_nothing_of_splits():
    """Backends without PREFILL graphs (torch_ref) take prepare(meta) alone."""
    from outrider.layers.attn_backends.base import get_backend

    backend = get_backend("torch_ref")
    r = _runner(torch.nn.Embedding(8, 4), backend, prefill_tokens=())
    r.step = lambda ids, pos, extras: (ids,)
    key = r.capture_keys()[0]
    r._fill_padding(key, first_row=0)
    (out,) = r._forward(r.inputs.input_ids[: key.num_tokens], None, {}, r._metadata(key))
    assert out.shape[0] == key.num_tokens
