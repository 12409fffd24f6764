"""The TTT unroll is what serving computes: its mask is the hand-drawn one, and step j at row t
equals a chain of single-token draft forwards from t over a growing K/V, as a proposal runs."""

from __future__ import annotations

import pytest
import torch

from outrider.loaders.hf_config import TransformerConfig
from outrider.train.draft import new_draft
from outrider.train.ttt import TTTAttention, TTTBatch, ttt_forward, ttt_mask, unroll
from tests.tiny import tiny_hf_config

STEPS = 4


def test_mask_matches_hand_drawn():
    # One row: sequence 0 (3 tokens), sequence 1 (2 tokens), one padding row.
    seq = torch.tensor([[0, 0, 0, 1, 1, -1]])
    m = ttt_mask(seq, 2)[0].int()
    causal = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ]
    )
    eye = torch.eye(6, dtype=torch.int64)
    assert m.shape == (6, 18)
    assert torch.equal(m, torch.cat([causal, eye, eye], dim=1))
    assert torch.equal(ttt_mask(seq, 0)[0].int(), causal)


def _target_cfg() -> TransformerConfig:
    return TransformerConfig.from_hf_dict(
        tiny_hf_config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=8, vocab_size=96)
    )  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    cfg = _target_cfg()
    vd = cfg.vocab_size // 2
    d2t = torch.arange(vd)  # draft i -> target i + d2t[i] = 2i: the even ids
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[::2] = True
    draft = new_draft(cfg, d2t, t2d, max_positions=64, std=0.1, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    # Row 0 packs a 9-token and a 6-token sequence, then padding; row 1 holds one of 16.
    lengths = [[9, 6], [16]]
    t = 17
    ids = torch.zeros(2, t, dtype=torch.int64)
    pos = torch.zeros(2, t, dtype=torch.int64)
    seq = torch.full((2, t), -1)
    k = 0
    for r, lens in enumerate(lengths):
        start = 0
        for n in lens:
            ids[r, start : start + n] = torch.randint(0, cfg.vocab_size, (n,), generator=g)
            pos[r, start : start + n] = torch.arange(n)
            seq[r, start : start + n] = k
            k, start = k + 1, start + n
    hidden = torch.randn(2, t, 3 * cfg.hidden_size, generator=g)
    p = torch.softmax(torch.randn(2, t, cfg.vocab_size, generator=g) * 3, -1)
    batch = TTTBatch(
        input_ids=ids,
        positions=pos,
        seq_ids=seq,
        loss_mask=seq >= 0,
        hidden=hidden,
        embeds=embed[ids],
        target_p=p[..., d2t + torch.arange(vd)],
        target_top=torch.where(t2d[p.argmax(-1)], p.argmax(-1) // 2, -1),
    )
    return draft, embed, batch, lengths


def _serving_chain(draft, embed, ids, hidden, t, steps):
    """What a proposal from position t computes: step 0 over rows 0..t (the drafter's cache of
    step-0 keys, written by extends), then steps 1.. as single tokens at t + j attending to that
    cache plus their own chain. Ground-truth tokens are fed, as in training."""
    scale = draft.midlayer.self_attn.attn.scale
    cache_k, cache_v = [], []

    def attend(q, k, v):
        n = q.shape[0]
        cache_k.append(k)
        cache_v.append(v)
        keys, values = torch.cat(cache_k), torch.cat(cache_v)  # [S, kvh, d]
        s = keys.shape[0]
        q_pos = torch.arange(s - n, s)
        mask = torch.arange(s)[None, :] <= q_pos[:, None]  # a chain is causal in cache order
        group = q.shape[1] // k.shape[1]
        keys = keys.repeat_interleave(group, 1).transpose(0, 1)
        values = values.repeat_interleave(group, 1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) * scale
        scores = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return (scores @ values).transpose(0, 1).reshape(n, -1)

    rows = torch.arange(t + 1)
    normed, summed = draft(
        ids[rows + 1], rows, hidden[rows], attend=attend, embeds=embed[ids[rows + 1]]
    )
    outs, h = [normed[t]], summed[t : t + 1]
    for j in range(1, steps):
        tok = ids[t + 1 + j : t + 2 + j]
        normed, h = draft(tok, torch.tensor([t + j]), h, attend=attend, embeds=embed[tok])
        outs.append(normed[0])
    return outs


@torch.no_grad()
def test_unrolled_steps_equal_a_serving_chain(setup):
    draft, embed, batch, lengths = setup
    outs = [o.view(2, -1, o.shape[-1]) for o in unroll(draft, batch, STEPS, "dense")]
    checked = 0
    for r, lens in enumerate(lengths):
        start = 0
        for n in lens:
            ids = batch.input_ids[r, start : start + n]
            hidden = batch.hidden[r, start : start + n]
            # Every start t whose whole chain has ground-truth inputs (x_{t+STEPS} exists).
            for t in range(n - STEPS):
                chain = _serving_chain(draft, embed, ids, hidden, t, STEPS)
                for j in range(STEPS):
                    torch.testing.assert_close(
                        outs[j][r, start + t], chain[j], atol=1e-5, rtol=1e-5
                    )
                    checked += 1
            start += n
    assert checked == STEPS * ((9 - STEPS) + (6 - STEPS) + (16 - STEPS))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@torch.no_grad()
def test_flex_equals_dense_forward(setup):
    # Forward only: FlexAttention has no CPU backward (the CUDA path is compiled, and checked
    # against dense forward and backward on a GPU).
    draft, _, batch, _ = setup
    seq = batch.seq_ids
    g = torch.Generator().manual_seed(5)
    dense, flex = TTTAttention(seq, 0.25, "dense"), TTTAttention(seq, 0.25, "flex")
    for _ in range(3):
        q = torch.randn(seq.numel(), 4, 16, generator=g)
        k, v = torch.randn(2, seq.numel(), 2, 16, generator=g)
        torch.testing.assert_close(flex(q, k, v), dense(q, k, v), atol=1e-5, rtol=1e-5)


def test_loss_masks_and_accuracy(setup):
    draft, _, batch, _ = setup
    out = ttt_forward(draft, batch, steps=STEPS, attention="dense")
    # Step j predicts x_{t+2+j}: a sequence of n tokens gives n - 2 - j rows.
    want = [sum(max(n - 2 - j, 0) for lens in ([9, 6], [16]) for n in lens) for j in range(STEPS)]
    assert out.step_count.tolist() == want
    assert torch.all(out.step_correct <= out.step_count)
    weights = torch.tensor([0.8**j for j in range(STEPS)])
    torch.testing.assert_close(out.loss.detach(), (weights * out.step_loss).sum())
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())


def test_more_steps_than_tokens_score_nothing(setup):
    draft, _, batch, _ = setup
    short = TTTBatch(**{k: v[:, :3] for k, v in vars(batch).items()})
    out = ttt_forward(draft, short, steps=STEPS, attention="dense")
    assert out.step_count.tolist() == [2, 0, 0, 0]  # only t = 0 of step 0, in each row
    assert torch.isfinite(out.loss)


def _reference_step_losses(draft, batch, steps, align_topk, hard_label):
    """Each step's loss, row by row: the rows step j learns from, the soft / hard mix, and the
    alignment rule written out directly (the module docstring's), not with ttt.py's slices."""
    b, t = batch.input_ids.shape
    outs = [draft.compute_logits(o).float().view(b, t, -1) for o in unroll(draft, batch, steps)]
    aligned = torch.ones(b, t, dtype=torch.bool)
    losses, learned = [], []
    for j, logits in enumerate(outs):
        s, total, n = 1 + j, 0.0, 0
        nxt = aligned.clone()
        for r in range(b):
            for row in range(t):
                k = row + s + 1  # the predicted token x_{row+2+j}
                seq = batch.seq_ids[r, row]
                if k >= t or seq < 0 or batch.seq_ids[r, k] != seq or not batch.loss_mask[r, k]:
                    continue
                top = int(batch.target_top[r, row + s])
                logp = torch.log_softmax(logits[r, row], -1)
                ce = -(batch.target_p[r, row + s].float() * logp).sum()
                if hard_label and top >= 0:
                    ce = (1 - hard_label) * ce - hard_label * logp[top]
                if aligned[r, row]:
                    total, n = total + ce, n + 1
                if align_topk:
                    best = logits[r, row].topk(align_topk).indices.tolist()
                    nxt[r, row] = bool(aligned[r, row]) and top in best
        aligned = nxt
        losses.append(total / max(n, 1))
        learned.append(n)
    return torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in losses]), learned


@pytest.mark.parametrize(
    "align_topk, hard_label", [(0, 0.0), (1, 0.0), (5, 0.0), (0, 1.0), (1, 0.4)]
)
@torch.no_grad()
def test_alignment_and_hard_labels_score_the_rows_they_name(setup, align_topk, hard_label):
    draft, _, batch, _ = setup
    # The target's argmax at step 0 = the draft's own at every other row, so about half the
    # chains survive step 0 and alignment has something to keep and something to drop.
    b, t = batch.input_ids.shape
    first = next(iter(unroll(draft, batch, 1)))
    own = draft.compute_logits(first).view(b, t, -1).argmax(-1)
    top = batch.target_top.clone()
    top[:, 1::2] = own[:, 0:-1:2]
    batch = TTTBatch(**{**vars(batch), "target_top": top})
    want, learned = _reference_step_losses(draft, batch, STEPS, align_topk, hard_label)
    out = ttt_forward(draft, batch, steps=STEPS, attention="dense",
                      align_topk=align_topk, hard_label=hard_label)  # fmt: skip
    torch.testing.assert_close(out.step_loss, want, atol=1e-5, rtol=1e-5)
    plain = ttt_forward(draft, batch, steps=STEPS, attention="dense")
    # Accuracy is counted over every masked row whatever the options.
    assert torch.equal(out.step_correct, plain.step_correct)
    assert torch.equal(out.step_count, plain.step_count)
    if align_topk:
        assert 0 < learned[1] < plain.step_count[1], learned  # some rows dropped, some kept
    if align_topk or hard_label:
        assert not torch.allclose(out.step_loss, plain.step_loss)


@pytest.mark.parametrize("align_topk, hard_label", [(0, 0.0), (5, 0.4)])
def test_fused_attention_and_recomputed_head_train_what_the_reference_does(
    setup, align_topk, hard_label
):
    # sdpa keeps no attention scores and the head's logits are recomputed in the backward:
    # the loss and every gradient must be those of dense attention over logits kept whole.
    draft, _, batch, _ = setup
    weights = torch.tensor([0.8**j for j in range(STEPS)])

    def grads(loss):
        draft.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in draft.named_parameters()}

    want_steps, _ = _reference_step_losses(draft, batch, STEPS, align_topk, hard_label)
    want = grads((weights * want_steps).sum())
    out = ttt_forward(draft, batch, steps=STEPS, attention="sdpa",
                      align_topk=align_topk, hard_label=hard_label)  # fmt: skip
    torch.testing.assert_close(out.step_loss, want_steps.detach(), atol=1e-5, rtol=1e-5)
    got = grads(out.loss)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    draft.zero_grad(set_to_none=True)
