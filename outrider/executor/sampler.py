"""The sampler: one row of logits per sequence in, one next token per sequence out.

Processing order, per row (vLLM's semantics):
  1. min_tokens: while the output is shorter than min_tokens, EOS (unless ignore_eos) and
     stop_token_ids are masked to -inf.
  2. penalties: repetition (HF style, over prompt + output), then frequency and presence
     (OpenAI style, over the output only).
  3. greedy rows (temperature 0) take the argmax of the penalised logits.
  4. the other rows: temperature, top-k, top-p, min-p, softmax, then one draw.

Every step is a small function over a [rows, vocab] float32 tensor, so the speculative
rejection sampler can rebuild the exact distribution drawn from: `processed_probs` is that
distribution, and the sampler draws from what it returns (one-hot for greedy rows).

Logprobs are log_softmax of the raw model logits (before penalties and temperature), as vLLM
reports them by default. The one host sync is reading the chosen ids (and logprobs) back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from outrider.core import SamplingParams, ScheduledSeq
from outrider.layers import fused
from outrider.transfer import to_device_no_sync

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler reads about one logits row. Built from a ScheduledSeq; the verifier
    builds its own rows (the same request with draft tokens appended to output_token_ids)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    # The index in the output of the token this row draws (a seeded row's noise is keyed by it,
    # `keyed_noise_no_sync`); None: len(output_token_ids).
    position: int | None = None

    @classmethod
    def of(cls, seq: ScheduledSeq) -> SamplingRow:
        # From the step, not the request's list: a step launched ahead of the last one's read
        # samples one past the tokens the request holds (engine/overlap.py).
        r = seq.request
        return cls(r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids,
                   r.generator, seq.context_len - len(r.prompt_token_ids))  # fmt: skip

    @classmethod
    def of_request(cls, r) -> SamplingRow:
        return cls(r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids, r.generator)

    @property
    def key(self) -> tuple[int, int] | None:
        """(seed, output position) of a seeded sampled row, whose noise is keyed by them."""
        if self.params.seed is None or self.params.greedy:
            return None
        pos = len(self.output_token_ids) if self.position is None else self.position
        return self.params.seed, pos


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # None when no row asked for logprobs; otherwise one dict per row: {} for a row that did
    # not ask, else the row's top-N in descending logprob order, then the sampled token if it
    # is not among them (so the first N items are always the top-N).
    logprobs: list[dict[int, float]] | None


def as_rows(seqs: Sequence[ScheduledSeq] | Sequence[SamplingRow]) -> list[SamplingRow]:
    return [s if isinstance(s, SamplingRow) else SamplingRow.of(s) for s in seqs]


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request RNG for a seeded request; it must live on the logits' device."""
    return torch.Generator(device=device).manual_seed(seed)


# --- 0. structured outputs ----------------------------------------------------------------------


def token_bitmask(seqs: Sequence[ScheduledSeq], rows: Sequence[int]) -> torch.Tensor | None:
    """The allowed-token bitmask of every logits row of `seqs` (seq i owning rows[i] rows, in
    order), on the host: each constrained sequence's ScheduledSeq.token_masks, padded with
    all-allowed rows past its own, and all-allowed rows for the others; None when no sequence
    is constrained. Where every sequence is constrained and the masks lie back to back with
    exactly their rows (Grammars lays a step's out so), the answer is a view of them: no copy,
    and pinned where they are."""
    masks = [s.token_masks for s in seqs]
    words = next((m.shape[1] for m in masks if m is not None), None)
    if words is None:
        return None
    if _back_to_back(masks, rows):
        return masks[0].as_strided((sum(rows), words), (words, 1))
    out = np.full((sum(rows), words), -1, dtype=np.int32)  # numpy: no intra-op threads woken
    start = 0
    for m, n in zip(masks, rows):
        if m is not None:
            k = min(n, m.shape[0])
            out[start : start + k] = m[:k].numpy()
        start += n
    return torch.from_numpy(out)


def _back_to_back(masks: Sequence[torch.Tensor | None], rows: Sequence[int]) -> bool:
    """Whether every mask is there with exactly its rows, each row-contiguous and starting where
    the one before ends in memory."""
    end = None
    for m, n in zip(masks, rows):
        if m is None or m.shape[0] != n or not m.is_contiguous():
            return False
        if end is not None and m.data_ptr() != end:
            return False
        end = m.data_ptr() + m.numel() * m.element_size()
    return True


# Top logits read for a constrained greedy row decided on the host (Grammars.paths).
GRAMMAR_TOPK = 16


def top_candidates(
    logits: torch.Tensor, rows: Sequence[int]
) -> dict[int, tuple[list[int], list[float]]]:
    """logits [R, V] (on the device) -> {rows[r]: (the GRAMMAR_TOPK highest ids of row r,
    their values as float32 holds them), best first}. One host read."""
    packed = top_candidates_no_sync(logits)
    return unpack_candidates(packed.cpu(), rows)  # CPU-GPU sync point


def top_candidates_no_sync(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> [R, 2 k] float64 where it is: each row's GRAMMAR_TOPK (k) highest ids,
    then their values as float32 holds them, best first (exact in float64: ids < 2^53). On
    CUDA fused.top_candidates serves (two Triton launches; torch.topk's host time was the
    cost there), else torch.topk. (torch.topk chunk by chunk first, then over the chunks'
    best, was slower on an H100 past one row: 64 vs 57 us at 4 rows of 49,152, 156 vs 98 at
    64; 44 vs 53 at one.)"""
    k = min(GRAMMAR_TOPK, logits.shape[-1])
    packed = fused.top_candidates(logits, k)  # ties to the lowest token; two launches
    if packed is not None:
        return packed
    values, ids = logits.float().topk(k, dim=-1)
    return torch.cat([ids.double(), values.double()], dim=1)


def unpack_candidates(
    host: torch.Tensor, rows: Sequence[int]
) -> dict[int, tuple[list[int], list[float]]]:
    """top_candidates_no_sync's rows [R, 2 k] float64, read to the host, as top_candidates
    gives them (through numpy: 64 rows took 0.1 ms as Python lists on an H100's host)."""
    packed = host.numpy()
    k = packed.shape[1] // 2
    ids = packed[:, :k].astype(np.int64).tolist()
    return dict(zip(rows, zip(ids, packed[:, k:].tolist())))


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> list[int]:
    """masked_argmax_no_sync over every row of logits [R, V] (any device), bitmask [R, W]
    int32 on the host, read back: each row's argmax among the tokens its bitmask allows."""
    dev = logits.device
    rows = torch.arange(logits.shape[0], device=dev)
    bits = to_device_no_sync(bitmask, torch.int32, dev)
    return masked_argmax_no_sync(logits, rows, bits).tolist()  # CPU-GPU sync point


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> -inf wherever bitmask [R, W] int32 (same device) has a 0 bit (bit
    t % 32 of word t // 32 for token t; tokens past 32 W are refused). In place; returns it.
    One launch where the fused kernels serve (fused.token_bitmask_)."""
    if fused.token_bitmask_(logits, bitmask):
        return logits
    r, v = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(r, -1).bool()  # [R, 32 W]
    if allowed.shape[1] < v:
        allowed = torch.cat([allowed, allowed.new_zeros(r, v - allowed.shape[1])], dim=1)
    return logits.masked_fill_(~allowed[:, :v], _NEG_INF)


def masked_argmax_no_sync(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """[R] int64: the greedy token of logits row rows[r] ([N, V]; rows [R] int64 on its
    device) among the tokens bitmask[r] ([R, W] int32, same device) allows; ties to the lowest
    token, as the sampler's argmax after apply_token_bitmask_. One launch where the fused
    kernels serve, else the rows are copied out, masked and reduced."""
    ids = fused.masked_argmax(logits, rows, bitmask)
    if ids is not None:
        return ids
    return apply_token_bitmask_(logits.index_select(0, rows), bitmask).argmax(dim=-1)


# --- 1. min_tokens ---------------------------------------------------------------------------


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Masks EOS (unless ignore_eos) and stop_token_ids to -inf in rows whose output is still
    shorter than min_tokens. In place on logits [R, V]; returns it."""
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        banned = (
            set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | row.eos_token_ids
        )
        # Ids past the logits' vocabulary cannot be sampled anyway; indexing them would fault.
        ids = [t for t in banned if 0 <= t < vocab]
        row_idx += [i] * len(ids)
        tok_idx += ids
    if row_idx:
        both = to_device_no_sync([row_idx, tok_idx], torch.long, logits.device)
        # new_full fills on the device; torch.tensor(-inf, device=cuda) would be a blocking copy.
        logits.index_put_((both[0], both[1]), logits.new_full((), _NEG_INF))
    return logits


def _any_min_tokens_active(rows: Sequence[SamplingRow]) -> bool:
    return any(
        len(r.output_token_ids) < r.params.min_tokens
        and (r.params.stop_token_ids or (r.eos_token_ids and not r.params.ignore_eos))
        for r in rows
    )


# --- 2. penalties ----------------------------------------------------------------------------


def _padded_ids(
    rows: list[tuple[Sequence[int], ...]], pad: int, device: torch.device
) -> torch.Tensor:
    """Each row's id lists laid end to end: [R, longest], padded with `pad` (an extra
    vocabulary column, dropped after the scatter; ids past the vocabulary land there too).
    numpy fills it: torch.tensor over nested lists costs ~10x more per id."""
    lengths = [sum(len(part) for part in parts) for parts in rows]
    arr = np.full((len(rows), max(1, *lengths)), pad, dtype=np.int64)
    for i, parts in enumerate(rows):
        at = 0
        for part in parts:
            arr[i, at : at + len(part)] = part
            at += len(part)
    np.minimum(arr, pad, out=arr)
    return to_device_no_sync(arr, torch.long, device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (positive logits divided, negative ones
    multiplied), then frequency (x count in output) and presence (x seen in output) penalties
    subtracted. In place on logits [R, V]; returns it. Rows without penalties are untouched.

    Cost: the token histories travel to the device every call, O(prompt + output) per
    penalised row; a per-request device-side count would make this O(new tokens)."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    num_rows, vocab = logits.shape
    dev = logits.device
    sel = [rows[i] for i in idx]
    outputs = _padded_ids([(r.output_token_ids,) for r in sel], vocab, dev)  # [P, Lo]
    histories = _padded_ids(
        [(r.prompt_token_ids, r.output_token_ids) for r in sel], vocab, dev
    )  # [P, Lp + Lo]
    factors = to_device_no_sync(
        [
            [r.params.repetition_penalty for r in sel],
            [r.params.frequency_penalty for r in sel],
            [r.params.presence_penalty for r in sel],
        ],
        torch.float32,
        dev,
    )
    rep, freq, pres = (f.unsqueeze(1) for f in factors)  # [P, 1] each

    counts = torch.zeros(len(sel), vocab + 1, dtype=torch.float32, device=dev)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
    counts = counts[:, :vocab]
    seen = torch.zeros(len(sel), vocab + 1, dtype=torch.bool, device=dev)
    seen.scatter_(1, histories, True)
    seen = seen[:, :vocab]

    whole = len(idx) == num_rows
    idx_t = None if whole else to_device_no_sync(idx, torch.long, dev)
    x = logits if whole else logits.index_select(0, idx_t)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0).float()
    if whole:
        logits.copy_(x)
    else:
        logits.index_copy_(0, idx_t, x)
    return logits


# --- 4. temperature, top-k, top-p, min-p ------------------------------------------------------


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Masks to -inf what top-k and then top-p drop. logits [R, V] (already divided by the
    temperature); top_k [R] long (<= 0 or >= V: off) or None when no row uses it; top_p [R]
    float (1: off) or None. Returns the masked logits (in place unless top_p is given).

    top-k keeps every token whose logit is >= the k-th largest (ties at the edge are kept).
    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p,
    computed on the top-k-renormalised distribution; the top token always stays.
    max_top_k (the largest k in use, a host int) lets top-k alone use topk() instead of a
    full vocabulary sort."""
    vocab = logits.shape[-1]
    if top_k is not None:
        k_on = (top_k > 0) & (top_k < vocab)
        k = torch.where(k_on, top_k, vocab).clamp(max=vocab)
    if top_p is None:
        if top_k is None:
            return logits
        width = vocab if max_top_k is None else min(max(max_top_k, 1), vocab)
        top = torch.topk(logits, width, dim=-1).values  # [R, width], descending
        kth = top.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
        return logits.masked_fill_((logits < kth) & k_on.unsqueeze(1), _NEG_INF)

    sorted_x, order = torch.sort(logits, dim=-1, descending=True)  # [R, V] each
    if top_k is not None:
        kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
        sorted_x = sorted_x.masked_fill((sorted_x < kth) & k_on.unsqueeze(1), _NEG_INF)
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly higher-ranked tokens
    drop = mass_before >= top_p.unsqueeze(1)
    # top_p == 1 must drop nothing, even where float cumsum overshoots 1 in the tail.
    drop &= (top_p < 1).unsqueeze(1)
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_x)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p x the top probability. logits [R, V],
    min_p [R] (0: off). In place; returns logits. Applied after top-k/top-p it keeps the same
    set as before them (they only remove tokens and keep the top one and the ratios)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def _sampled_probs(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Step 4 for the non-greedy rows: x [S, V] penalised logits -> probs [S, V] float32."""
    vocab = x.shape[-1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
    # One host->device copy for all four per-row knobs (top-k < 2^24 is exact in float32).
    knobs = to_device_no_sync(
        [
            [r.params.temperature for r in rows],
            [float(k) for k in ks],
            [r.params.top_p for r in rows],
            [r.params.min_p for r in rows],
        ],
        torch.float32,
        x.device,
    )
    x = x / knobs[0].unsqueeze(1)  # a new tensor: the caller's logits stay untouched
    any_k = any(ks)
    any_p = any(r.params.top_p < 1.0 for r in rows)
    if any_k or any_p:
        x = apply_top_k_top_p(
            x,
            knobs[1].long() if any_k else None,
            knobs[2] if any_p else None,
            max_top_k=max(ks) if any_k else None,
        )
    if any(r.params.min_p > 0.0 for r in rows):
        x = apply_min_p(x, knobs[3])
    return x.softmax(dim=-1)


def sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Each row's temperature, top-k, top-p and min-p (no penalties, no min_tokens) applied to
    logits [S, V]: probs [S, V] float32. What a drafter samples its own proposals from."""
    return _sampled_probs(logits.float(), rows)


_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical shift right of int64 bits (torch's >> keeps the sign)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bits (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def keyed_noise_no_sync(
    keys: Sequence[tuple[int, int]],
    vocab: int,
    device: torch.device,
    offsets: torch.Tensor | None = None,  # [R] int64 on the device, added to the positions
) -> torch.Tensor:
    """Exp(1) noise [R, V] float32 that is a function of each row's (seed, output position)
    alone: splitmix64 of (seed, position, token) as 53 uniform bits, then -log(1 - u). A seeded
    request draws the token at output position p with the noise (seed, p) whatever its batch,
    the step that draws it or the drafts beside it, so plain decoding and a speculative step
    that accepts a draft exactly when it equals that draw (`keyed_draws_no_sync`) emit the
    same text. The same bits on every device: the arithmetic is int64 wrapping. `offsets`:
    positions the device knows and the host does not yet (tokens a step emitted before its
    read: SpecStep.launch_after)."""
    seeds = to_device_no_sync([k[0] for k in keys], torch.long, device)
    pos = to_device_no_sync([k[1] for k in keys], torch.long, device)
    if offsets is not None:
        pos = pos + offsets
    row = _splitmix(_splitmix(seeds) ^ (pos + 1) * _GOLDEN)  # [R]: unrelated across keys
    z = _splitmix(row[:, None] + (torch.arange(vocab, device=device) + 1) * _GOLDEN)
    u = _shr(z, 11).double() * 2.0**-53  # [0, 1)
    return (-torch.log1p(-u)).float().clamp_min_(torch.finfo(torch.float32).tiny)


def keyed_draws_no_sync(
    probs: torch.Tensor,
    keys: Sequence[tuple[int, int]],
    offsets: torch.Tensor | None = None,  # [R] int64 on the device: keyed_noise_no_sync's
) -> torch.Tensor:
    """One draw per row of probs [R, V] with keyed noise -> ids [R] long: row r's token is the
    one the sampler draws for that request at that position (exactly p's law)."""
    noise = keyed_noise_no_sync(keys, probs.shape[-1], probs.device, offsets)
    return (probs.float() / noise).argmax(dim=-1)


def sample_from_probs_no_sync(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    keys: Sequence[tuple[int, int] | None] | None = None,
) -> torch.Tensor:
    """One draw per row from probs [R, V] -> ids [R] long, without a host sync.

    Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i
    exactly (min of independent Exp(p_i) variables). Rows with a key (seed, position) draw
    keyed noise (`keyed_noise_no_sync`); rows with a generator draw their noise from it alone,
    so a seeded row's tokens do not depend on its batch neighbours."""
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_()
    keyed = {i for i, k in enumerate(keys or ()) if k is not None}
    if keyed:
        order = sorted(keyed)
        idx = to_device_no_sync(order, torch.long, probs.device)
        rows = keyed_noise_no_sync([keys[i] for i in order], probs.shape[-1], probs.device)
        noise.index_copy_(0, idx, rows)
    for i, gen in enumerate(generators):
        if gen is None or i in keyed:
            continue
        if gen.device.type != probs.device.type:
            raise ValueError(
                f"row {i}: its torch.Generator is on {gen.device} but the logits are on "
                f"{probs.device}; create it with make_generator(seed, logits.device)"
            )
        noise[i].exponential_(generator=gen)
    # Exp(1) can round to 0 (p 2^-24 per float): 0/0 = nan would win argmax on a masked token.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


# --- the whole pipeline ---------------------------------------------------------------------


def _prepare(
    logits: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[torch.Tensor | None, list[int], torch.Tensor | None, torch.Tensor | None]:
    """Steps 1-4 without drawing. Returns (argmax of the penalised logits [B], or None when no
    row is greedy; indices of the non-greedy rows; those indices on the device, or None when
    all rows are non-greedy; their processed probs [S, V], or None when S == 0)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match {len(rows)} sequences: the "
            "sampler wants one [V] row per sequence (gather the last position of each first)"
        )
    x = logits.float()
    if _any_min_tokens_active(rows) or any(r.params.has_penalties for r in rows):
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()  # steps 1-2 write in place; the raw logits still feed logprobs
        apply_min_tokens(x, rows)
        apply_penalties(x, rows)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(sampled) == len(rows):
        return None, sampled, None, _sampled_probs(x, rows)
    greedy_ids = x.argmax(dim=-1)
    if not sampled:
        return greedy_ids, sampled, None, None
    idx_t = to_device_no_sync(sampled, torch.long, x.device)
    probs = _sampled_probs(x.index_select(0, idx_t), [rows[i] for i in sampled])
    return greedy_ids, sampled, idx_t, probs


def processed_probs(
    logits: torch.Tensor, seqs: Sequence[ScheduledSeq] | Sequence[SamplingRow]
) -> torch.Tensor:
    """The exact distribution the sampler draws each row's token from: [B, V] float32, rows
    summing to 1, one-hot at the penalised argmax for greedy rows. logits [B, V]."""
    rows = as_rows(seqs)
    greedy_ids, _, idx_t, probs = _prepare(logits, rows)
    if greedy_ids is None:
        return probs
    out = torch.nn.functional.one_hot(greedy_ids, logits.shape[-1]).float()
    return out if probs is None else out.index_copy_(0, idx_t, probs)


def logprob_rows_no_sync(
    logits: torch.Tensor, ids: torch.Tensor, asked: list[int], top_n: int
) -> torch.Tensor:
    """For the rows in `asked`: [A, 1 + 2 * top_n] float64 = sampled logprob, top-n ids,
    top-n logprobs. float64 carries both kinds exactly (ids < 2^53; float32 widens exactly),
    so everything reaches the host in the one transfer."""
    idx_t = to_device_no_sync(asked, torch.long, logits.device)
    lp = logits.index_select(0, idx_t).float().log_softmax(dim=-1)  # [A, V]
    parts = [lp.gather(1, ids.index_select(0, idx_t).unsqueeze(1))]
    if top_n > 0:
        top = lp.topk(top_n, dim=-1)
        parts += [top.indices.double(), top.values]
    return torch.cat([p.double() for p in parts], dim=1)


def unpack_logprobs(
    packed: list[list[float]], token_ids: list[int], top_n: int, keep: int | None = None
) -> list[dict[int, float]]:
    """Rows of logprob_rows_no_sync at width top_n (sampled logprob, top-n ids, top-n
    logprobs) -> one dict per token: the first `keep` (default top_n) of the top-n in order,
    then the token itself if it is not among them."""
    keep = top_n if keep is None else keep
    out = []
    for rec, tok in zip(packed, token_ids):
        d = {int(t): v for t, v in zip(rec[1 : 1 + keep], rec[1 + top_n : 1 + top_n + keep])}
        d.setdefault(int(tok), rec[0])
        out.append(d)
    return out


class Sampler:
    """Chooses one token per row. Stateless: everything per row comes from the requests."""

    def sample_no_sync(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq] | Sequence[SamplingRow]
    ) -> torch.Tensor:
        """The chosen ids [B] int64, left on the device (no host sync)."""
        rows = as_rows(seqs)
        plain = not any(r.params.has_penalties for r in rows) and not _any_min_tokens_active(rows)
        if plain and all(r.params.greedy for r in rows):
            return logits.argmax(dim=-1)  # fast path: one argmax for the batch
        ids, sampled, idx_t, probs = _prepare(logits, rows)
        if probs is not None:
            drawn = sample_from_probs_no_sync(
                probs, [rows[i].generator for i in sampled], [rows[i].key for i in sampled]
            )
            ids = drawn if ids is None else ids.index_copy(0, idx_t, drawn)
        return ids

    def __call__(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq] | Sequence[SamplingRow]
    ) -> SamplerOutput:
        """logits: [B, V], any float dtype, row i belongs to seqs[i]."""
        rows = as_rows(seqs)
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        ids = self.sample_no_sync(logits, rows)
        if not asked:
            return SamplerOutput(ids.tolist(), None)  # CPU-GPU sync point

        top_n = max(rows[i].params.logprobs or 0 for i in asked)
        packed = logprob_rows_no_sync(logits, ids, asked, top_n)
        flat = torch.cat([ids.double(), packed.flatten()]).tolist()  # CPU-GPU sync point
        token_ids = [int(t) for t in flat[: len(rows)]]
        width = 1 + 2 * top_n
        logprobs: list[dict[int, float]] = [{} for _ in rows]
        for a, i in enumerate(asked):
            rec = flat[len(rows) + a * width : len(rows) + (a + 1) * width]
            n = rows[i].params.logprobs or 0
            logprobs[i] = unpack_logprobs([rec], [token_ids[i]], top_n, n)[0]
        return SamplerOutput(token_ids, logprobs)
