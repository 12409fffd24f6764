"""The EAGLE-3 drafter split over the tensor-parallel ranks like the target
(draft_tensor_parallel_size = tensor_parallel_size) beside the drafter whole on rank 0, on the
CPU over gloo: the same drafts, the same greedy output as one rank, and the collectives a draft
forward runs, counted under "draft"."""

from __future__ import annotations

import shutil

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.config import EngineConfig, flat_sections
from outrider.core import ForwardMode
from outrider.distributed import TPGroup, single
from outrider.executor.inputs import build_inputs
from outrider.executor.kv_cache import KVPool
from outrider.layers.attn_backends.base import get_backend
from outrider.layers.forward_context import ForwardContext, forward_context
from outrider.loaders.hf_config import TransformerConfig
from outrider.models.eagle3_io import load_drafter, save_drafter
from tests.tiny import hf_reference, outrider_model, prefill_batch, tiny_hf_config
from tests.unit.test_engine_tiny import prompts, tiny_dir  # noqa: F401 (fixtures)
from tests.unit.test_spec_eagle3 import random_drafter
from tests.unit.test_tp import BLOCK, _batch, checkpoint, gather_from_ranks

# EAGLE-3's aux layers (2, L//2, L-3) must be distinct for a drafter file: 8 layers. 4 heads,
# 2 KV heads (one per rank at TP 2); draft vocabulary 300 splits over 2.
TARGET = tiny_hf_config(
    num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=16)
OPTS = dict(dtype="float32", device="cpu", num_blocks=96, block_size=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):  # noqa: F811
    """(the target's directory with tiny_dir's tokenizer, a random drafter's directory)."""
    path = tmp_path_factory.mktemp("tiny-8-layers")
    hf_reference(TARGET).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir[0] / name, path / name)
    draft = random_drafter(TransformerConfig.from_hf_dict(TARGET))
    return path, save_drafter(draft, tmp_path_factory.mktemp("drafter") / "d")


# -- the draft network alone, sharded by spawned ranks -------------------------------------------


def draft_forwards(tp: TPGroup, drafter_dir: str) -> list[tuple[str, torch.Tensor, dict]]:
    """(what ran, draft logits, its collective counts) for a draft forward over the target's
    aux streams (a prefill of two prompts) and one over the draft's own output (a chain step)."""
    target, _ = outrider_model(TARGET, checkpoint(TARGET), num_blocks=4, tp=tp)
    draft = load_drafter(drafter_dir, TransformerConfig.from_hf_dict(TARGET), tp=tp)
    draft.bind_embedding(target.model.embed_tokens)
    pool = KVPool(draft.kv_layout(torch.float32), 1, 4, BLOCK, torch.device("cpu"))
    draft.attention_layers()[0].kv_cache = pool.layer(0)
    backend = get_backend("torch_ref")

    def forward(model, batch, extra):
        inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
        with torch.inference_mode(), forward_context(ForwardContext(inputs.attn, backend)):
            return model(inputs.input_ids, inputs.positions, extra)

    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 5)]
    batch = prefill_batch(rows, BLOCK)
    _, aux = forward(target, batch, draft.config.aux_layers)
    out = []
    tp.reset_counts()
    with tp.counting_as("draft"), torch.inference_mode():
        normed, summed = forward(draft, batch, torch.cat(aux, dim=-1))
        out.append(("over the target's streams", draft.compute_logits(normed), tp.counts()))
    tp.reset_counts()
    step = _batch(ForwardMode.DRAFT, [([7], 9), ([8], 5)])
    last = torch.tensor([8, 13])  # each prompt's last row
    with tp.counting_as("draft"), torch.inference_mode():
        normed, _ = forward(draft, step, summed[last])
        out.append(("over its own output", draft.compute_logits(normed), tp.counts()))
    return out


@pytest.mark.slow
def test_the_sharded_draft_equals_the_whole_one_and_counts_its_collectives(served, tmp_path):
    """Per draft forward at TP 2: all-reduces for the embedding (the target's shard), o_proj
    and down_proj (2 per layer, one layer), and fc when it reads the target's streams; the
    head's one all-gather of [rows, draft vocab]; the whole draft counts nothing."""
    _, drafter_dir = served
    want = draft_forwards(single(), str(drafter_dir))
    assert all(counts == {} for _, _, counts in want)
    ranks = gather_from_ranks(draft_forwards, 2, tmp_path, str(drafter_dir))
    h, vocab = TARGET["hidden_size"], 300
    for rank, got in enumerate(ranks):
        for (what, logits, counts), (_, ref, _), tokens, reduces in zip(
            got, want, (14, 2), (1 + 1 + 2, 1 + 2)
        ):
            assert logits.shape == ref.shape == (tokens, vocab)
            err = (logits - ref).abs().max().item()
            assert err < 1e-5, f"rank {rank}, {what}: logits differ by {err}"
            assert torch.equal(logits.argmax(-1), ref.argmax(-1)), (rank, what)
            assert counts == {
                "draft": {
                    "all_reduce": {"calls": reduces, "bytes": reduces * tokens * h * 4},
                    "all_gather": {"calls": 1, "bytes": tokens * vocab * 4},
                }
            }, f"rank {rank}, {what}"
    for a, b in zip(ranks[0], ranks[1]):  # the head's gather hands every rank the same logits
        assert torch.equal(a[1], b[1])


# -- through the engine ----------------------------------------------------------------------


def _spec(drafter_dir, draft_tp: int, topk: int = 1) -> dict:
    return {"method": "eagle3", "draft": str(drafter_dir), "controller": "fixed",
            "num_draft_tokens": 3, "topk": topk, "draft_tensor_parallel_size": draft_tp}  # fmt: skip


def _record_drafts(drafter) -> list[torch.Tensor]:
    """Rank 0's drafts from every speculative step, in order."""
    seen: list[torch.Tensor] = []
    inner = drafter.after_verify_no_sync

    def after_verify(*args, **kwargs):
        drafts = inner(*args, **kwargs)
        seen.append(drafts.clone())
        return drafts

    drafter.after_verify_no_sync = after_verify
    return seen


@pytest.mark.slow
def test_sharded_drafter_output_equals_the_drafter_on_rank0_and_one_rank(served, prompts):  # noqa: F811
    """TP 2 with the drafter on rank 0, then split over both ranks (chains, then trees): the
    greedy output is one rank's plain output each time; the two chains draft the same tokens
    step for step; the drafter on rank 0 runs no collective, the split one per draft forward
    one all-gather (its head) and 3 or 4 all-reduces (embedding, o_proj, down_proj, and fc
    over the target's streams)."""
    path, drafter_dir = served
    few = prompts[:5]
    with LLM(str(path), **OPTS) as one:
        want = [o.token_ids for o in one.generate(few, GREEDY)]
    runs = {}
    for draft_tp, topk in ((1, 1), (2, 1), (2, 2)):
        spec = _spec(drafter_dir, draft_tp, topk)
        with LLM(str(path), tensor_parallel_size=2, speculative=spec, **OPTS) as llm:
            engine = llm.engine
            assert engine.speculator.proposer.sharded == (draft_tp == 2)
            drafts = _record_drafts(engine.speculator.proposer)
            engine.runner.reset_collective_counts()
            got = [o.token_ids for o in llm.generate(few, GREEDY)]
            counts = engine.runner.collective_counts()
            assert got == want, f"draft_tp={draft_tp} topk={topk}: differs from one rank"
            assert engine.speculator.stats.num_verify_steps > 0
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        runs[draft_tp, topk] = (drafts, counts)
        if draft_tp == 1:
            assert "draft" not in counts  # on rank 0 alone: no draft collective, no draft op
            continue
        draft = counts["draft"]
        n = draft["forward"]["calls"]
        assert n > 0 and draft["all_gather"]["calls"] == n, draft
        assert 3 * n < draft["all_reduce"]["calls"] < 4 * n, draft
        # A verify still runs 2 x layers + 1 all-reduces and one all-gather: none is a draft's.
        verify = counts["verify"]
        forwards = verify["forward"]["calls"]
        assert verify["all_reduce"]["calls"] == (2 * TARGET["num_hidden_layers"] + 1) * forwards
        assert verify["all_gather"]["calls"] == forwards
    on_rank0, sharded = runs[1, 1][0], runs[2, 1][0]
    assert len(on_rank0) == len(sharded) > 0
    assert all(torch.equal(a, b) for a, b in zip(on_rank0, sharded))


# -- config --------------------------------------------------------------------------------------


def test_draft_tensor_parallel_size_from_yaml_flags_and_options(tmp_path):
    from outrider.cli import build_parser
    from outrider.flags import engine_config

    spec = {"method": "eagle3", "draft_tensor_parallel_size": 2}
    assert flat_sections({"speculative_config": spec})["speculative"] == spec
    config = EngineConfig.from_dict({"tensor_parallel_size": 2, "speculative_config": spec})
    assert config.speculative.draft_tensor_parallel_size == 2
    yaml = tmp_path / "d.yaml"
    yaml.write_text(
        "parallel: {tensor_parallel_size: 2}\n"
        "speculative: {method: eagle3, draft_tensor_parallel_size: 2}\n"
    )
    assert EngineConfig.from_yaml(yaml).speculative.draft_tensor_parallel_size == 2
    args = build_parser().parse_args(
        ["generate", "hi", "--tp", "2", "--spec", "eagle3", "--draft-tensor-parallel-size", "2"]
    )
    assert engine_config(args).speculative.draft_tensor_parallel_size == 2
    # vLLM's null (its default) reads as 1.
    none = {"method": "eagle3", "draft_tensor_parallel_size": None}
    assert EngineConfig.from_dict({"speculative_config": none}).speculative == (
        EngineConfig.from_dict({"speculative_config": {"method": "eagle3"}}).speculative
    )


@pytest.mark.parametrize(
    "values,match",
    [
        ({"tp": 2, "speculative_config": {"method": "eagle3", "draft_tensor_parallel_size": 3}},
         r"draft_tensor_parallel_size=3 with tensor_parallel_size=2: use 1 .* or 2"),
        ({"speculative_config": {"method": "eagle3", "draft_tensor_parallel_size": 2}},
         r"draft_tensor_parallel_size=2 with tensor_parallel_size=1: use 1"),
        ({"speculative_config": {"method": "eagle3", "draft_tensor_parallel_size": 0}},
         r"invalid draft_tensor_parallel_size=0"),
        ({"tp": 2, "speculative_config": {"method": "ngram", "draft_tensor_parallel_size": 2}},
         r"applies to method='eagle3'"),
        ({"tp": 2, "cuda_graphs": True,
          "speculative_config": {"method": "eagle3", "draft_tensor_parallel_size": 2}},
         r"cuda_graphs=True with draft_tensor_parallel_size=2: .*--enforce-eager"),
    ],
)  # fmt: skip
def test_sizes_that_cannot_work_name_the_choices(values, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_dict(values)


def test_a_draft_that_does_not_split_names_the_fix():
    from outrider.models.eagle3 import Eagle3Config, check_draft_tp_size

    cfg = Eagle3Config.for_target(TransformerConfig.from_hf_dict(TARGET), 301)
    with pytest.raises(ValueError, match=r"301 draft vocabulary: use draft_tensor_parallel_size=1"):
        check_draft_tp_size(cfg, 2)
