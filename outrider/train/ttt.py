"""EAGLE-3 training-time test (TTT): the draft network unrolled for `steps` draft steps over a
batch of packed token rows, each step feeding its own pre-norm output to the next, exactly as a
serving chain does.

Semantics (row index t inside one sequence; x_s the sequence's tokens, h_s the target's fused
aux features at s, p_s the target's next-token distribution at s, i.e. over x_{s+1}):

    step 0 at t:  input token x_{t+1}, hidden h_t,                rotary position t      -> x_{t+2}
    step j at t:  input token x_{t+1+j} (ground truth),
                  hidden = step j-1's pre-norm output at t,       rotary position t + j  -> x_{t+2+j}
    target of step j at t: p_{t+1+j} restricted to the draft vocabulary (not renormalised: the
    optimum of the soft cross-entropy is the same, the weight is the mass the draft can reach);
    loss mask: the loss mask of the predicted token x_{t+2+j}, and t+2+j inside the sequence.

Attention of step j at t: the step-0 keys of its own sequence at rows <= t (causal), plus, from
each step i in 1..j, only step i's key at row t (the diagonal). This is what serving computes:
a proposal from the last position t runs step j at position t + j over the drafter's cache of
step-0 keys (positions <= t, the last one written by the proposal's own step 0) and the keys of
its own chain (steps 1..j, at t + 1..t + j). `tests/unit/test_train_ttt.py` checks the unrolled
steps against such a chain of single-token forwards.

Compared with SpecForge (sgl-project/SpecForge, specforge/core/eagle3.py `OnlineEagle3Model`
and specforge/modeling/draft/llama3_eagle.py `LlamaAttention` with `cache_hidden`):
- positions: the same, step j rotates q and k at position_ids + j (`position_ids + lck`).
- mask: SpecForge also hides step-0 keys at rows t-j+1..t from step j (after step idx it masks
  `attention_mask[:, :, ind[idx:], ind[:T - idx]]`, the idx-th sub-diagonal), so step 1 at t
  does not see its own chain's step-0 key at t. Serving does see it (outrider's and, as far as
  we can tell, SGLang's draft KV holds the step-0 key at t when step 1 runs), so we keep it.
- loss: SpecForge renormalises the target over the draft vocabulary, drops positions whose
  target argmax is outside it, and averages over all B*T rows; we weight by the reachable mass
  (same optimum), keep those positions (they count as misses for accuracy, as in SpecForge)
  and average over loss-masked rows of each step.

Two options on the loss (both off by default; accuracy is always counted over every
loss-masked row, so runs with and without them compare):
- `align_topk` k > 0 (token alignment, after GRIFFIN, arXiv 2502.11018): step j at row t
  learns only where every earlier step at t had the target's argmax among its top k. A serving
  chain (k = 1) or tree (k = topk) never reaches step j past a miss, and in training such a
  row pairs the ground-truth token with a hidden state that predicted another one: a pairing
  serving never feeds the draft.
- `hard_label` w in [0, 1]: loss = (1 - w) * soft cross-entropy + w * cross-entropy of the
  target's argmax, where it lies in the draft vocabulary. Greedy serving accepts a draft token
  only if it is the argmax, and greedy datagen makes the data's next token that argmax.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from outrider.models.eagle3 import Eagle3Draft
from outrider.train.soft_ce import soft_ce

ATTENTION_BACKENDS = ("auto", "dense", "flex", "sdpa")


@dataclass
class TTTBatch:
    """Packed rows: each row holds one or more whole sequences back to back, then padding.
    Every tensor is [B, T, ...] on the training device."""

    input_ids: torch.Tensor  # [B, T] int64, 0 on padding
    positions: torch.Tensor  # [B, T] int64, position of each token inside its sequence
    seq_ids: torch.Tensor  # [B, T] int64, equal within a sequence, -1 on padding
    loss_mask: torch.Tensor  # [B, T] bool, True on tokens the draft should learn to predict
    hidden: torch.Tensor  # [B, T, 3 * Ht] target aux residual streams (fused by draft.fc)
    embeds: torch.Tensor  # [B, T, H] the target's embedding of input_ids (frozen)
    target_p: torch.Tensor  # [B, T, Vd] target p(next token) at each row, on the draft vocab
    target_top: torch.Tensor  # [B, T] int64 draft id of the target's argmax, -1 if outside


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, sum_j decay^j * loss_j (the one to backpropagate)
    step_loss: torch.Tensor  # [steps] detached
    step_correct: torch.Tensor  # [steps] float, rows whose draft argmax == target argmax
    step_count: torch.Tensor  # [steps] float, loss-masked rows


def ttt_mask(seq_ids: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T] sequence ids -> [B, T, (step + 1) * T] bool: what query row t of step `step` may
    see, keys laid out as [step-0 keys | step-1 keys | ... | step-`step` keys].

    Worked example, one sequence of T = 3, step 2 (1 = visible):
        step-0 keys   step-1 keys   step-2 keys
        1 0 0         1 0 0         1 0 0        row 0
        1 1 0         0 1 0         0 1 0        row 1
        1 1 1         0 0 1         0 0 1        row 2
    """
    b, t = seq_ids.shape
    idx = torch.arange(t, device=seq_ids.device)
    same = seq_ids[:, :, None] == seq_ids[:, None, :]  # [B, T, T]
    causal = same & (idx[None, :] <= idx[:, None])[None]
    diag = torch.eye(t, dtype=torch.bool, device=seq_ids.device).expand(b, t, t)
    return torch.cat([causal] + [diag] * step, dim=-1)


class TTTAttention:
    """The `attend(q, k, v)` callable for one unrolled TTT pass: the draft calls it once per
    step, it keeps every step's K/V and attends under `ttt_mask`. q: [B*T, heads, d], k/v:
    [B*T, kv_heads, d] -> [B*T, heads * d]."""

    def __init__(self, seq_ids: torch.Tensor, scale: float, backend: str = "dense") -> None:
        if backend not in ("dense", "flex", "sdpa"):
            raise ValueError(
                f"unknown TTT attention backend {backend!r}: use 'dense', 'flex' or 'sdpa'"
            )
        self.seq_ids, self.scale, self.backend = seq_ids, scale, backend
        self.keys: list[torch.Tensor] = []  # per step [B, kv_heads, T, d]
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = self.seq_ids.shape
        heads, d = q.shape[1], q.shape[2]
        self.keys.append(k.view(b, t, -1, d).transpose(1, 2))
        self.values.append(v.view(b, t, -1, d).transpose(1, 2))
        step = len(self.keys) - 1
        qb = q.view(b, t, heads, d).transpose(1, 2)  # [B, heads, T, d]
        keys = torch.cat(self.keys, dim=2)  # [B, kv_heads, (step + 1) * T, d]
        values = torch.cat(self.values, dim=2)
        if self.backend == "flex":
            out = _flex(qb, keys, values, self.seq_ids, step, self.scale)
        elif self.backend == "sdpa":
            out = _sdpa(qb, keys, values, ttt_mask(self.seq_ids, step), self.scale)
        else:
            out = _dense(qb, keys, values, ttt_mask(self.seq_ids, step), self.scale)
        return out.transpose(1, 2).reshape(b * t, heads * d)


def _dense(q, keys, values, mask, scale: float) -> torch.Tensor:
    """Reference attention: scores over every key, masked, softmax in fp32."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [B, heads, T, S]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.matmul(scores.softmax(-1).to(values.dtype), values)


def _sdpa(q, keys, values, mask, scale: float) -> torch.Tensor:
    """The same attention as `_dense` through torch's fused kernel, which keeps only the output
    and a logsumexp per row for the backward: `_dense` keeps each step's (j + 1) T x T
    probabilities per head until the backward, 4.1 GiB over 7 steps at T = 2048 with 9 heads,
    the bulk of a CPU training step's memory."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, keys, values, seq_ids: torch.Tensor, step: int, scale: float) -> torch.Tensor:
    """FlexAttention under the same mask: whole masked-out blocks are skipped, so step j costs
    about a causal pass plus j diagonal block strips instead of (j + 1) dense T x T blocks."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t = seq_ids.shape[1]

    def mask_mod(b, h, qi, kv):
        s = kv % t
        causal = (seq_ids[b, s] == seq_ids[b, qi]) & (s <= qi)
        return torch.where(kv < t, causal, s == qi)

    block_mask = create_block_mask(
        mask_mod, B=seq_ids.shape[0], H=None, Q_LEN=t, KV_LEN=(step + 1) * t, device=q.device
    )
    # Eager flex is a slow reference (and has no CPU backward); compiled it is a fused kernel.
    fn = _compiled_flex() if q.is_cuda else flex_attention
    return fn(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)


def resolve_attention(backend: str, device: torch.device) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown TTT attention backend {backend!r}: use one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """out[:, t] = x[:, t + s]; rows past the end are zero (False, 0)."""
    if s == 0:
        return x
    tail = x.new_zeros((x.shape[0], min(s, x.shape[1]), *x.shape[2:]))
    return torch.cat([x[:, s:], tail], dim=1)


def _same_seq(seq_ids: torch.Tensor, s: int) -> torch.Tensor:
    """[B, T] bool: row t + s exists and belongs to row t's sequence (padding never does)."""
    key = seq_ids + 1  # >= 1 on tokens, 0 on padding and past the end after the shift
    return (_shift(key, s) == key) & (key > 0)


def scored_rows(batch: TTTBatch, step: int) -> torch.Tensor:
    """[B, T - 1 - step] bool: the rows t that step `step` is scored at, those whose predicted
    token x_{t+2+step} is learnable and inside t's sequence."""
    s, keep = 2 + step, max(batch.input_ids.shape[1] - 1 - step, 0)
    return (_shift(batch.loss_mask, s) & _same_seq(batch.seq_ids, s))[:, :keep]


def unroll(
    draft: Eagle3Draft, batch: TTTBatch, steps: int = 7, attention: str = "dense"
) -> Iterator[torch.Tensor]:
    """Yield each step's normed draft output [B*T, H] (row t of step j predicts x_{t+2+j}).
    Under autograd the layers run their PyTorch ops (the fused kernels have no backward)."""
    b, t = batch.input_ids.shape
    n = b * t
    attend = TTTAttention(batch.seq_ids, draft.midlayer.self_attn.attn.scale, attention)
    hidden = batch.hidden.reshape(n, -1)  # step 0: [N, 3 * Ht]; later steps: [N, H]
    for j in range(steps):
        # Step j at row t: token x_{t+1+j}, rotary position t + j, the previous step's pre-norm
        # output as hidden.
        ids = _shift(batch.input_ids, 1 + j).reshape(n)
        embeds = _shift(batch.embeds, 1 + j).reshape(n, -1)
        positions = (batch.positions + j).reshape(n)
        normed, hidden = draft(ids, positions, hidden, attend=attend, embeds=embeds)
        yield normed


def ttt_forward(
    draft: Eagle3Draft,
    batch: TTTBatch,
    steps: int = 7,
    decay: float = 0.8,
    attention: str = "dense",
    align_topk: int = 0,
    hard_label: float = 0.0,
) -> TTTOutput:
    """Unroll `steps` draft steps over `batch` and score them; no host sync (the counts stay
    on the device). align_topk / hard_label: the module docstring."""
    outputs = unroll(draft, batch, steps, attention)
    return _score(draft, batch, outputs, decay, align_topk, hard_label)


def _score(
    draft: Eagle3Draft,
    batch: TTTBatch,
    outputs: Iterator[torch.Tensor],
    decay: float,
    align_topk: int = 0,
    hard_label: float = 0.0,
) -> TTTOutput:
    """Cross-entropy and top-1 agreement of each step's output (the module docstring)."""
    b, t = batch.input_ids.shape
    losses, correct, count = [], [], []
    total = batch.hidden.new_zeros((), dtype=torch.float32)
    aligned = None  # [B, T-j] rows whose steps < j all had the target's argmax in their top k
    for j, normed in enumerate(outputs):
        # Rows t < T - s of step j (s = 1 + j) are scored against row t + s of the targets:
        # slices, not shifted copies, so autograd keeps views of target_p, not one per step.
        s, keep = 1 + j, max(t - 1 - j, 0)
        k = min(align_topk, draft.config.draft_vocab_size) if align_topk > 1 else 0
        # 1. Target p_{t+1+j} on the draft vocab; mask: x_{t+2+j} is learnable and in the seq.
        # The head and its loss run again in the backward instead of keeping this step's
        # [B, T, Vd] logits until then: one lm_head matmul more per step, for the largest
        # tensors a step holds (7 x 250 MiB at T = 2048, Vd = 32000 in fp32).
        ce, argmax, top_k = checkpoint(
            _head_loss, draft, normed, batch.target_p, batch.target_top, s, keep, hard_label, k,
            use_reentrant=False, preserve_rng_state=False,
        )  # fmt: skip
        top = batch.target_top[:, s:]  # [B, T-s], -1: the argmax is outside the draft vocab
        mask = scored_rows(batch, j)
        rows = mask.sum().float()
        learn = mask if aligned is None else mask & aligned[:, :keep]
        loss = (ce * learn).sum() / learn.sum().float().clamp(min=1.0)
        total = total + decay**j * loss
        # 2. Top-1 agreement over every masked row, on device.
        hit = (argmax == top) & mask
        losses.append(loss.detach())
        correct.append(hit.sum().float())
        count.append(rows)
        # 3. Which rows the next step may learn from (rows outside the mask do not break it).
        if align_topk:
            inside = hit if align_topk == 1 else (top_k == top[..., None]).any(-1)
            ok = inside | ~mask
            aligned = ok if aligned is None else aligned[:, :keep] & ok
    return TTTOutput(total, torch.stack(losses), torch.stack(correct), torch.stack(count))


def _head_loss(
    draft: Eagle3Draft,
    normed: torch.Tensor,  # [B*T, H] one step's normed draft output
    target_p: torch.Tensor,  # [B, T, Vd]
    target_top: torch.Tensor,  # [B, T]
    shift: int,
    keep: int,
    hard_label: float,
    topk: int,  # > 0: also the draft's top k ids per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> (ce [B, keep] fp32 with the hard-label mix, draft argmax [B, keep], top k ids
    [B, keep, topk] or None) of rows t < keep against target rows t + shift."""
    b, t = target_top.shape
    logits = draft.compute_logits(normed).view(b, t, -1)  # [B, T, Vd]
    # soft_ce reads rows t < keep of the logits against rows t + s of target_p in place.
    ce, lse, argmax = soft_ce(logits, target_p, shift, keep)  # [B, T-s] each
    if hard_label:  # -log softmax(z)[top] = lse - z[top]
        top = target_top[:, shift:]
        z_top = logits[:, :keep].gather(-1, top.clamp(min=0)[..., None]).squeeze(-1)
        hard = lse - z_top.float()
        ce = torch.where(top >= 0, (1 - hard_label) * ce + hard_label * hard, ce)
    top_k = None
    if topk:
        top_k = logits[:, :keep].detach().float().topk(topk, dim=-1).indices
    return ce, argmax, top_k


class TTTModel(torch.nn.Module):
    """The unrolled draft as one module, so DistributedDataParallel sees one forward per
    backward (the draft itself is called `steps` times inside)."""

    def __init__(
        self,
        draft: Eagle3Draft,
        steps: int,
        decay: float,
        attention: str,
        align_topk: int = 0,
        hard_label: float = 0.0,
    ) -> None:
        super().__init__()
        self.draft, self.steps, self.decay, self.attention = draft, steps, decay, attention
        self.align_topk, self.hard_label = align_topk, hard_label

    def forward(self, batch: TTTBatch) -> tuple[torch.Tensor, ...]:
        """-> (loss, step_loss [steps], step_correct [steps], step_count [steps])."""
        out = ttt_forward(self.draft, batch, self.steps, self.decay, self.attention,
                          self.align_topk, self.hard_label)  # fmt: skip
        return out.loss, out.step_loss, out.step_correct, out.step_count
