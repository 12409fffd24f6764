"""Acceptance: which drafted tokens the target keeps, plus one token of its own, lossless.

One sequence per call (the engine loops over sequences). The verify forward gives the target's
distribution at 1 + N rows: row 0 follows the root (it predicts the first draft level), row
1 + i follows node i. Everything emitted is distributed exactly as plain sampling from the
target would be: greedy rows give verify_greedy's answer, sampled rows follow the rejection
schemes below (proved in the docstrings, checked statistically in tests/unit).

Chain (Leviathan et al. 2023, Chen et al. 2023): level d's draft x ~ q_d is accepted with
probability min(1, p_d(x) / q_d(x)); the first rejection emits a draw from
norm(max(0, p_d - q_d)) and stops; after the last draft, a bonus token is drawn from row k.

Tree (multi-draft recursive rejection sampling, as in SpecInfer and EAGLE's tree verify, in
the without-replacement form of Jeon et al. 2024): at a node with target p, try its children
x_1, x_2, ... in node order, child j against the law it was drawn from, q_j; accept it with
probability min(1, p(x_j) / q_j(x_j)) and descend, or on rejection set p <- norm(max(0,
p - q_j)) and try the next child; when all are rejected (or the node is a leaf) draw from p.

What the tree verifier assumes about how siblings were drawn: all children of one parent were
drawn one after another from the parent's draft distribution q WITHOUT replacement (Gumbel
top-k, `torch.multinomial(q, k, replacement=False)` in its returned order, or a loop that
zeroes each pick), and every sibling's draft_probs row holds that same q. So
q_j = q with x_1 .. x_{j-1} zeroed and renormalized. Why this is exact: if everything after a
rejection of child j emits ~ p_{j+1} whatever x_j was (true by induction, ending at the
final draw from p), then P(emit y) = min(p_j, q_j)(y) + sum_z max(0, p_j - q_j)(z) p_{j+1}(y)
= p_j(y). Siblings drawn WITH replacement are handled exactly too: conditioned on differing
from the earlier ones they have law q_j, and a repeat has q_j(x) = 0, so it is verified as a
deterministic draft (below) against a p that already has no mass at x (a rejected x always
had p(x) < q(x)): never accepted, p unchanged. Top-k by rank (the k most likely tokens,
EAGLE's default) is NOT sampling: such drafts must be passed with draft_probs=None.

Deterministic drafts (draft_probs=None: n-gram lookup, top-k by rank) are one-hot proposals:
try x_1 w.p. p(x_1), else p <- p without x_1 renormalized, and so on — exact sampling from p
for any drafts chosen without looking at this verifier's random numbers. (So treating sampled
drafts as deterministic is still lossless, only less often accepted.)

Edge cases, each exact: a drafted x with q_j(x) = 0 (it could not have been drawn from q_j: a
repeated sibling, a proposer bug, rounding) is verified as a deterministic draft, which is
exact whatever x is and keeps greedy rows equal to verify_greedy; a residual with zero mass
(p <= q everywhere, so rejection had probability 0) falls back to p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.executor.inputs import to_device_no_sync
from outrider.spec.tree import TreeTopology

# Residual mass at or below this is treated as zero: dividing by it would overflow float32.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class Verdict:
    """One sequence's verify outcome. Invariant: len(token_ids) == len(accepted_nodes) + 1."""

    accepted_nodes: list[int]  # node indices along the accepted path, root-first, root excluded
    # The accepted nodes' tokens, then one final token: the correction drawn after a rejection,
    # or the bonus after accepting a whole root-to-leaf path.
    token_ids: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


# --- per-node math: small tensor functions, broadcastable over leading dims ------------------


def proposal_no_sync(q: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The law each drafted token is verified against: q [..., V] itself, or a one-hot at the
    token where q gives it no mass (it could not have come from q), i.e. a deterministic draft.
    tokens [...] long. Returns (q' [..., V], q'(token) [...], always > 0)."""
    q_x = q.gather(-1, tokens.unsqueeze(-1))  # [..., 1]
    q = torch.where(q_x > 0, q, one_hot_no_sync(tokens, q.shape[-1]))
    # A renormalized q can exceed 1 by an ulp; the clamp keeps greedy rows' u * q_x < 1 exact.
    return q, q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).clamp_max(1.0)


def accept_no_sync(p_x: torch.Tensor, q_x: torch.Tensor | float, u: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p_x / q_x) given u ~ U[0, 1) and q_x > 0: u * q_x < p_x
    avoids the division. A one-hot p (greedy row) accepts exactly its argmax: u < 1 and
    q_x <= 1 make u * q_x < 1 there, and p_x = 0 elsewhere."""
    return u * q_x < p_x


def residual_no_sync(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What to sample from after a rejection: norm(max(0, p - q)) [..., V], or p where that
    has no mass (p <= q everywhere: rejection had probability 0, so any answer is exact)."""
    return _normalized_or(p, (p - q).clamp_min_(0))


def drop_no_sync(p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """residual_no_sync for a deterministic draft (q one-hot at the token), without building
    q: p [..., V] with tokens [..., 1] zeroed, renormalized (p where nothing is left)."""
    return _normalized_or(p, p.scatter(-1, tokens, 0.0))


def _normalized_or(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > _TINY, r / mass.clamp_min(_TINY), p)


def without_no_sync(q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """q [..., V] restricted to keep [..., V] (1 = still drawable, 0 = an earlier sibling) and
    renormalized: the law of the next sibling drawn without replacement. All-zero when nothing
    is left (that sibling is then verified as a deterministic draft)."""
    q = q * keep
    return q / q.sum(dim=-1, keepdim=True).clamp_min(_TINY)


def one_hot_no_sync(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """tokens [...] long -> [..., vocab] float32 deterministic proposals."""
    out = torch.zeros(*tokens.shape, vocab, dtype=torch.float32, device=tokens.device)
    return out.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def draw_no_sync(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of probs [..., V] -> ids [...]: the exponential race of the sampler
    (argmax p_i / E_i picks i with probability p_i), so a one-hot row returns its hot index."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # Exp(1) can round to 0: 0/0 = nan would win the argmax on a zero-probability token.
    return (probs / noise.clamp_min_(_TINY)).argmax(dim=-1)


# --- greedy ----------------------------------------------------------------------------------


def verify_greedy(
    topology: TreeTopology, draft_tokens: Sequence[int], target_argmax: Sequence[int]
) -> Verdict:
    """Temperature 0: from the root, follow the child whose token is the current row's argmax
    (the first such child if drafts repeat); stop where none is; end with that row's argmax.
    target_argmax: 1 + N ids, row 0 after the root, row 1 + i after node i."""
    _check_sizes(topology, draft_tokens, len(target_argmax), "target_argmax")
    accepted: list[int] = []
    node = -1
    while True:
        want = target_argmax[node + 1]
        nxt = next((c for c in topology.children(node) if draft_tokens[c] == want), None)
        if nxt is None:
            return Verdict(accepted, [draft_tokens[n] for n in accepted] + [int(want)])
        accepted.append(nxt)
        node = nxt


# --- sampled ---------------------------------------------------------------------------------


def verify_sampled(
    topology: TreeTopology,
    draft_tokens: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Lossless acceptance against the exact processed target distribution.

    target_probs: [1 + N, V], row r as `sampler.processed_probs` gives it for the sequence
    extended by the path to row r (one-hot rows for greedy requests). draft_probs: [N, V],
    the distribution node i's token was drawn from (siblings share their parent's q, see the
    module docstring), or None for deterministic drafts. generator: the request's RNG
    (`make_generator(seed, target_probs.device)`), None for the default one.
    """
    num_nodes = topology.num_nodes
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [1 + N, V], got {tuple(target_probs.shape)}")
    _check_sizes(topology, draft_tokens, target_probs.shape[0], "target_probs rows")
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (num_nodes, vocab):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, expected ({num_nodes}, {vocab}) "
            "(one row per draft node, the target's vocabulary); pass None for deterministic "
            "drafts"
        )
    bad = [t for t in draft_tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft tokens {bad} are outside the target vocabulary [0, {vocab})")
    if generator is not None and generator.device.type != target_probs.device.type:
        raise ValueError(
            f"the generator is on {generator.device} but target_probs is on "
            f"{target_probs.device}; create it with make_generator(seed, target_probs.device)"
        )
    p = target_probs.float()
    q = None if draft_probs is None else draft_probs.to(p.device, torch.float32)
    tokens = to_device_no_sync(list(draft_tokens), torch.long, p.device)
    if topology.is_chain:
        return _verify_chain(list(draft_tokens), tokens, p, q, generator)
    return _verify_tree(topology, list(draft_tokens), tokens, p, q, generator)


def _verify_chain(
    draft_tokens: list[int],
    tokens: torch.Tensor,  # [k] long
    p: torch.Tensor,  # [k + 1, V]
    q: torch.Tensor | None,  # [k, V]; None: one-hot at each draft
    generator: torch.Generator | None,
) -> Verdict:
    """All k levels decided at once, one host sync. Each level's test only needs its own row
    (the path to it is the draft itself), so the decisions and the k + 1 candidate final draws
    are computed side by side; the first rejection picks which ones count.

        k = 3, accepted [T, T, F]: n = 2 -> tokens = drafts[0:2] + [draw from residual row 2]
        k = 3, accepted [T, T, T]: n = 3 -> tokens = drafts[0:3] + [draw from p row 3 (bonus)]
    """
    k = len(draft_tokens)
    p_x = p[:k].gather(1, tokens.unsqueeze(1)).squeeze(1)  # [k]
    u = torch.rand(k, generator=generator, device=p.device)
    if q is None:
        accepted = accept_no_sync(p_x, 1.0, u)
        rejected = drop_no_sync(p[:k], tokens.unsqueeze(1))
    else:
        q, q_x = proposal_no_sync(q, tokens)  # [k, V], [k]
        accepted = accept_no_sync(p_x, q_x, u)
        rejected = residual_no_sync(p[:k], q)
    finals = torch.cat([rejected, p[k:]])  # [k + 1, V]
    drawn = draw_no_sync(finals, generator)  # [k + 1]
    num_accepted = accepted.long().cumprod(0).sum().view(1)  # leading run of accepts
    host = torch.cat([num_accepted, drawn]).tolist()  # CPU-GPU sync point
    n = host[0]
    return Verdict(list(range(n)), draft_tokens[:n] + [host[1 + n]])


def _verify_tree(
    topology: TreeTopology,
    draft_tokens: list[int],
    tokens: torch.Tensor,  # [N] long
    p_rows: torch.Tensor,  # [1 + N, V]
    q_rows: torch.Tensor | None,  # [N, V]; None: one-hot at each draft
    generator: torch.Generator | None,
) -> Verdict:
    """Walk from the root; one host sync per child tried, one for the final draw. A batched
    version would run the same per-node functions over [B] nodes at each step."""
    u = torch.rand(topology.num_nodes, generator=generator, device=p_rows.device)
    accepted: list[int] = []
    p = p_rows[0]
    node = -1
    while True:
        keep = None  # [V] 1.0 where this node's next child could still have been drawn
        for child in topology.children(node):
            x = draft_tokens[child]
            if q_rows is None:  # a repeated deterministic sibling finds p(x) = 0 already
                q_x = 1.0
            else:
                q = q_rows[child] if keep is None else without_no_sync(q_rows[child], keep)
                q, q_x = proposal_no_sync(q, tokens[child])
            if bool(accept_no_sync(p[x], q_x, u[child])):  # CPU-GPU sync point
                accepted.append(child)
                p = p_rows[1 + child]
                node = child
                break
            if q_rows is None:
                p = drop_no_sync(p, tokens[child : child + 1])
            else:
                p = residual_no_sync(p, q)
                keep = torch.ones_like(p) if keep is None else keep
                keep[x] = 0.0  # no replacement: the next sibling was drawn from q without x
        else:  # every child rejected, or a leaf: the final token comes from p
            final = int(draw_no_sync(p, generator))  # CPU-GPU sync point
            return Verdict(accepted, [draft_tokens[n] for n in accepted] + [final])


def _check_sizes(topology: TreeTopology, draft_tokens: Sequence[int], rows: int, what: str) -> None:
    n = topology.num_nodes
    if len(draft_tokens) != n or rows != n + 1:
        raise ValueError(
            f"sizes disagree: the tree has {n} nodes, draft_tokens has {len(draft_tokens)} and "
            f"{what} has {rows}; expected {n} draft tokens and {n + 1} rows (the root's row "
            "first, then one per node)"
        )
