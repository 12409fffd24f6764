"""How good is a drafter? Two measures.

Offline (here): the TTT unroll over held-out samples, per-step top-1 agreement with the
target's argmax, acc_j. With greedy verification a chain's draft k is accepted only if drafts
1..k all were, so the expected tokens per verify step are estimated by
    accept_length ~= 1 + sum_k prod_{j<=k} acc_j
(the 1 is the target's own bonus token). acc_j is measured with ground-truth inputs and the
draft's own hidden states, as TTT trains it; it overestimates a little where errors correlate.

Replayed (`replay_chain`): the greedy chain of k the engine runs, replayed offline on samples
that are the target's own greedy answers. Draft j of a verify rooted after row t is TTT step
j - 1 at row t (its inputs are the accepted tokens, i.e. the sample's); the engine accepts the
leading correct drafts plus its bonus token and roots the next verify a + 1 rows on, with drafts
capped so they never pass the answer's end. The first verify is rooted at the answer's second
token, as a request served alone meets it (its prefill drafts nothing; its first decode step
verifies no drafts and drafts inside). On such samples it equals the engine's accept
length exactly (a test holds it to that): a drafter that scores well here but not in serving
points at serving, not at training.

By the target's confidence (`confidence_profile`): the first draft's agreement bucketed by the
target's own top-1 probability at the token drafted. A small target is often unsure (the
default model puts under 0.5 on its own greedy token for a third of its answer tokens), and
where it is, its argmax turns on details of a computation the draft does not run: a drafter's
accuracy follows that probability, and the share of unsure tokens bounds what training can
reach.

In the engine: `serving_accept_length(llm, prompts)` runs real speculative decoding (build the
LLM with speculative={"method": "eagle3", "draft": path}) and averages each request's
metrics["accept_length"]. That, not the estimate, is the number that decides speed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from outrider.core import SamplingParams
from outrider.models.eagle3 import Eagle3Draft
from outrider.speculative.stats import accept_length
from outrider.train.batch import DraftVocabMaps, build_batch
from outrider.train.capture import TargetCapture
from outrider.train.dataset import Sample, micro_batches, pack_rows
from outrider.train.ttt import resolve_attention, scored_rows, ttt_forward, unroll

CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


@dataclass
class EvalResult:
    step_acc: list[float]  # top-1 agreement of draft step j with the target, j = 0..steps-1
    step_loss: list[float]
    num_tokens: int  # loss-masked rows scored at step 0

    @property
    def estimated_accept_length(self) -> float:
        return estimated_accept_length(self.step_acc)


def estimated_accept_length(step_acc: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j. Worked example: acc (0.8, 0.6) -> 1 + 0.8 + 0.48 = 2.28."""
    total, run = 1.0, 1.0
    for a in step_acc:
        run *= a
        total += run
    return total


@torch.no_grad()
def evaluate_drafter(
    draft: Eagle3Draft,
    llm,
    samples: list[Sample],
    *,
    ttt_steps: int = 7,
    max_len: int = 2048,
    batch_rows: int = 1,
    attention: str = "auto",
) -> EvalResult:
    """Per-step accuracy of `draft` on `samples` (held out from its training), features from
    `llm`'s own target model as in training."""
    if not samples:
        raise ValueError("no samples to evaluate: pass held-out samples (num_samples >= 1)")
    capture = TargetCapture(llm, draft.config.aux_layers)
    if draft.config.vocab_size != capture.config.vocab_size:
        raise ValueError(
            f"the drafter's vocab_size={draft.config.vocab_size} does not match the target's "
            f"{capture.config.vocab_size}: evaluate it with the target it was trained for"
        )
    vocab = DraftVocabMaps.from_d2t(draft.d2t, capture.config.vocab_size, capture.device)
    backend = resolve_attention(attention, capture.device)
    was_training = draft.training
    draft.eval()
    sums = torch.zeros(3, ttt_steps, device=capture.device)  # loss * rows, correct, rows
    on_cuda = capture.device.type == "cuda"
    for rows in micro_batches(pack_rows(samples, max_len, seed=0, epoch=0), batch_rows):
        batch = build_batch(capture, samples, rows, max_len, vocab)
        with torch.autocast("cuda", torch.bfloat16) if on_cuda else contextlib.nullcontext():
            out = ttt_forward(draft, batch, ttt_steps, attention=backend)
        sums += torch.stack([out.step_loss * out.step_count, out.step_correct, out.step_count])
    draft.train(was_training)
    loss_rows, correct, count = sums.cpu()  # CPU-GPU sync point
    n = count.clamp(min=1)
    return EvalResult((correct / n).tolist(), (loss_rows / n).tolist(), int(count[0]))


def greedy_samples(llm, prompts: Sequence[str], max_tokens: int) -> list[Sample]:
    """The target's own greedy answers to `prompts` (user messages under its chat template), as
    samples whose answer is the learned part: what serving meets at temperature 0, so
    evaluate_drafter, replay_chain and confidence_profile on them measure held-out prompts
    without a datagen file."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return [
        Sample(
            f"prompt-{i}",
            torch.tensor(o.prompt_token_ids + o.token_ids, dtype=torch.int32),
            torch.tensor([False] * len(o.prompt_token_ids) + [True] * len(o.token_ids)),
        )
        for i, o in enumerate(outs)
    ]


@dataclass
class ConfidenceProfile:
    edges: tuple[float, ...]  # bucket i holds target top-1 probabilities in [edges[i], edges[i+1])
    share: list[float]  # of the scored tokens, per bucket
    acc: list[float]  # the first draft's agreement with the target's argmax, per bucket
    outside: float  # share whose target argmax is outside the draft vocabulary (always missed)
    num_tokens: int

    def report(self) -> dict[str, Any]:
        """The JSON `drafter eval` prints (rounded)."""
        return {
            "target_top1_prob": [f"{a:g}-{b:g}" for a, b in zip(self.edges, self.edges[1:])],
            "share": [round(x, 4) for x in self.share],
            "first_draft_acc": [round(x, 4) for x in self.acc],
            "outside_draft_vocab": round(self.outside, 4),
        }


@torch.no_grad()
def confidence_profile(
    draft: Eagle3Draft,
    llm,
    samples: list[Sample],
    *,
    max_len: int = 2048,
    batch_rows: int = 1,
    attention: str = "auto",
    edges: Sequence[float] = CONFIDENCE_EDGES,
) -> ConfidenceProfile:
    """The first draft step's top-1 agreement on `samples`, bucketed by the target's top-1
    probability at the drafted token (the module docstring). The buckets weighted by their
    shares give evaluate_drafter's step_acc[0]."""
    if not samples:
        raise ValueError("no samples to profile: pass held-out samples (num_samples >= 1)")
    capture = TargetCapture(llm, draft.config.aux_layers)
    vocab = DraftVocabMaps.from_d2t(draft.d2t, capture.config.vocab_size, capture.device)
    backend = resolve_attention(attention, capture.device)
    on_cuda = capture.device.type == "cuda"
    inner = torch.tensor(list(edges[1:-1]), device=capture.device)
    k = len(edges) - 1
    counts = torch.zeros(2, k, device=capture.device)  # scored, agreed
    rest = torch.zeros(2, device=capture.device)  # outside the draft vocab, all scored
    for rows in micro_batches(pack_rows(samples, max_len, seed=0, epoch=0), batch_rows):
        batch = build_batch(capture, samples, rows, max_len, vocab)
        b, t = batch.input_ids.shape
        # Step 0 at row r drafts x_{r+2}: the target's distribution over it is row r + 1's.
        with torch.autocast("cuda", torch.bfloat16) if on_cuda else contextlib.nullcontext():
            logits = draft.compute_logits(next(iter(unroll(draft, batch, 1, backend))))
        pred = logits.view(b, t, -1).argmax(-1)[:, : t - 1]
        top = batch.target_top[:, 1:]
        conf = batch.target_p[:, 1:].float().amax(-1)  # the top-1 probability where top >= 0
        mask = scored_rows(batch, 0)
        inside = mask & (top >= 0)
        bucket = torch.bucketize(conf, inner, right=True)
        counts[0] += torch.bincount(bucket[inside], minlength=k)[:k]
        counts[1] += torch.bincount(bucket[inside & (pred == top)], minlength=k)[:k]
        rest += torch.stack([(mask & (top < 0)).sum(), mask.sum()])
    (scored, agreed), (outside, total) = counts.cpu(), rest.cpu().tolist()  # CPU-GPU sync point
    return ConfidenceProfile(
        tuple(edges),
        (scored / max(total, 1)).tolist(),
        (agreed / scored.clamp(min=1)).tolist(),
        outside / max(total, 1),
        int(total),
    )


@dataclass
class ChainReplay:
    accepted: int  # drafts accepted over all verify steps
    verify_steps: int

    @property
    def accept_length(self) -> float:
        return accept_length(self.accepted, self.verify_steps) or 1.0  # no verify step: 1


@torch.no_grad()
def replay_chain(
    draft: Eagle3Draft, llm, samples: list[Sample], k: int = 4, max_len: int = 4096
) -> ChainReplay:
    """The engine's greedy chain of k drafts replayed on `samples` (see the module docstring):
    each sample's answer must be the target's own greedy continuation of its prompt (datagen at
    temperature 0, same dtype) for this to be the accept length the engine will measure."""
    if not 1 <= k <= 16:
        raise ValueError(f"invalid chain length k={k}: use 1..16 draft tokens")
    capture = TargetCapture(llm, draft.config.aux_layers)
    vocab = DraftVocabMaps.from_d2t(draft.d2t, capture.config.vocab_size, capture.device)
    was_training = draft.training
    draft.eval()
    accepted = steps = 0
    for i, s in enumerate(samples):
        first = len(s.prompt())
        n = min(len(s), max_len)
        if first == 0 or first >= n:
            continue  # no prompt, or no answer inside max_len
        batch = build_batch(capture, samples, [[i]], n, vocab)  # one row, n wide
        ids = batch.input_ids[0].tolist()
        # preds[j][t]: TTT step j at row t proposes the token at t + 2 + j.
        preds = [
            draft.to_target_ids(draft.compute_logits(out).argmax(-1)).tolist()
            # dense: one sample per row, so every row is a new shape (flex would recompile)
            for out in unroll(draft, batch, k, attention="dense")
        ]
        # The prefill's last row (first - 1) gives the answer's first token; the first decode
        # step verifies no drafts (a prefill drafts nothing: the engine drafts a new request
        # inside its first speculative step) and gives the second, from row `first`.
        t = first
        while t + 2 < n:  # tokens x_{first}..x_{t+1} generated, x_{t+2}.. still to come
            room = min(k, n - (t + 2) - 1)  # the engine's cap: accepted + bonus <= the rest
            if room <= 0:
                t += 1  # the last token decodes plainly
                continue
            a = 0
            while a < room and preds[a][t] == ids[t + 2 + a]:
                a += 1
            accepted, steps, t = accepted + a, steps + 1, t + a + 1
    draft.train(was_training)
    return ChainReplay(accepted, steps)


def serving_accept_length(
    llm,
    prompts: Sequence[str] | Sequence[list[int]],
    sampling_params: SamplingParams | None = None,
    chat: bool = True,
) -> float:
    """Mean metrics["accept_length"] over `prompts` generated by `llm` with its speculative
    configuration. Strings become user messages under the chat template (unless chat=False);
    token id lists are sent as they are."""
    params = sampling_params or SamplingParams(temperature=0, max_tokens=256)
    if chat and all(isinstance(p, str) for p in prompts):
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(list(prompts), params)
    values = [o.metrics.get("accept_length") for o in outs]
    values = [v for v in values if v is not None]
    if not values:
        raise ValueError(
            "no request ran a speculative verify step: build the LLM with speculative="
            "{'method': 'eagle3', 'draft': '<drafter dir>'} (and max_tokens > 1)"
        )
    return sum(values) / len(values)
