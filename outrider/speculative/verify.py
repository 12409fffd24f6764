"""Acceptance: which drafted tokens the target keeps, plus one token of its own, lossless.

verify_greedy and verify_sampled take one sequence per call; verify_chain_batch_no_sync and
verify_chain_greedy_no_sync decide a whole batch of chains on the device, with no host sync
(the engine's batched step; the greedy one is what a CUDA graph runs). The verify forward gives
the target's distribution at 1 + N rows: row 0 follows the root (it predicts the first draft
level), row 1 + i follows node i. Everything emitted is distributed exactly as plain sampling
from the target would be: greedy rows give verify_greedy's answer, sampled rows follow the
rejection schemes below (proved in the docstrings, checked statistically in tests/unit).

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

from outrider.speculative.tree import TreeTopology
from outrider.transfer import to_device_no_sync

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


# --- batched chains: one step for the whole batch on the device, no host sync ---------------


def verify_chain_greedy_no_sync(
    target_argmax: torch.Tensor,  # [B, 1 + k] long
    draft_tokens: torch.Tensor,  # [B, k] long; entries at index >= num_drafts[b] are padding
    num_drafts: torch.Tensor,  # [B] long in 0..k
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_greedy over a batch of chains, graph-capturable (fixed shapes, no syncs). Returns
    (tokens [B, 1 + k], num_accepted [B]); row b emits tokens[b, :num_accepted[b] + 1]. tokens
    IS target_argmax (no copy): the accepted drafts equal it, and the token after them is the
    argmax at that row.

        k = 3, num_drafts [3, 1], drafts [[4, 8, 9], [4, 8, 15]], argmax [4, 8, 15, 16] (both)
        match & real [[T, T, F], [T, F, F]] -> num_accepted [2, 1]: [4, 8, 15] and [4, 8]
    """
    _check_chain_batch("target_argmax", target_argmax, 2, draft_tokens, num_drafts, None)
    k = draft_tokens.shape[1]
    real = torch.arange(k, device=draft_tokens.device) < num_drafts.unsqueeze(1)  # [B, k]
    match = (draft_tokens == target_argmax[:, :k]) & real
    return target_argmax, match.long().cumprod(1).sum(1)  # the leading run of matches


def verify_chain_batch_no_sync(
    target_probs: torch.Tensor,  # [B, 1 + k, V] float32
    draft_tokens: torch.Tensor,  # [B, k] long; entries at index >= num_drafts[b] are padding
    num_drafts: torch.Tensor,  # [B] long in 0..k
    draft_probs: torch.Tensor | None,  # [B, k, V] float32; None: deterministic drafts
    generators: Sequence[torch.Generator | None],  # [B]: each row's RNG, None the default one
) -> tuple[torch.Tensor, torch.Tensor]:
    """_verify_chain for B chains at once: no host sync, no loop over k. Returns (tokens
    [B, 1 + k], num_accepted [B]); row b emits tokens[b, :num_accepted[b] + 1] (later entries
    are unspecified): its accepted drafts, then the residual draw at the first rejection, or
    the bonus from row num_accepted[b] when every real draft was accepted. A row with
    num_drafts[b] = d behaves exactly as a chain of d drafts. Row j of target_probs follows
    the root and drafts 0..j-1; one-hot rows (greedy requests) give verify_greedy's answer
    whatever the random numbers. Real drafts must lie in [0, V): checking would sync.

    The same decisions as _verify_chain, but only the final token's row is built ([B, V], not
    [B, 1 + k, V]): the row at num_accepted, as a residual where a real draft was rejected.

        k = 3, num_drafts [3, 1], accepted & real [[T, T, F], [T, F, F]] -> num_accepted [2, 1]
        row 0: 2 < 3, draft 2 rejected -> draw from residual(p[0, 2], q[0, 2])
        row 1: 1 = num_drafts, all real accepted -> draw the bonus from p[1, 1]

    Randomness, all drawn up front (the only Python loop, over B, just launches draws): u
    [B, k] ~ U[0, 1) for the tests and E [B, V] ~ Exp(1) for the final draw as an exponential
    race, argmax_i r_i / E_i, which is exact: E_i / r_i are independent Exp(r_i) clocks and
    the first to ring is i with probability r_i / sum(r) (torch.multinomial can sync on CUDA).
    A row's draws come from its own generator alone, wherever it sits in the batch.
    """
    _check_chain_batch("target_probs", target_probs, 3, draft_tokens, num_drafts, draft_probs)
    batch, rows, vocab = target_probs.shape
    k = rows - 1
    device = target_probs.device
    u, noise = _chain_noise_no_sync(generators, batch, k, vocab, device)
    p = target_probs.float()
    n_real = num_drafts.long().clamp(0, k)  # [B]
    real = torch.arange(k, device=device) < n_real.unsqueeze(1)  # [B, k]
    drafts = torch.where(real, draft_tokens.long(), 0)  # padding may hold anything: never read
    p_x = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, k]
    if draft_probs is None:
        accepted = accept_no_sync(p_x, 1.0, u)
    else:
        q = draft_probs.float()
        q_x = q.gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, k]
        # proposal_no_sync's q'(x) without building q' at every level: 1 where q(x) = 0.
        accepted = accept_no_sync(p_x, torch.where(q_x > 0, q_x.clamp_max(1.0), 1.0), u)
    num_accepted = (accepted & real).long().cumprod(1).sum(1)  # [B], the leading run
    final = p.gather(1, num_accepted.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)
    if k > 0:  # a shape, not a value
        level = num_accepted.clamp_max(k - 1).unsqueeze(1)  # [B, 1], in range where n = k too
        x = drafts.gather(1, level)  # [B, 1]
        if draft_probs is None:
            residual = drop_no_sync(final, x)
        else:
            q_n = q.gather(1, level.unsqueeze(2).expand(batch, 1, vocab)).squeeze(1)  # [B, V]
            residual = residual_no_sync(final, proposal_no_sync(q_n, x.squeeze(1))[0])
        final = torch.where((num_accepted < n_real).unsqueeze(1), residual, final)
    drawn = (final / noise).argmax(1, keepdim=True)  # [B, 1]
    tokens = torch.cat([drafts, drawn], 1).scatter_(1, num_accepted.unsqueeze(1), drawn)
    return tokens, num_accepted


def _chain_noise_no_sync(
    generators: Sequence[torch.Generator | None],
    batch: int,
    k: int,
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """u [B, k] ~ U[0, 1) and E [B, V] ~ Exp(1) (clamped above 0), row b from generators[b];
    rows without a generator share one draw from the default generator."""
    if len(generators) != batch:
        raise ValueError(
            f"generators has {len(generators)} entries for a batch of {batch} rows; pass one "
            "per row (None for the default generator)"
        )
    for b, g in enumerate(generators):
        if g is not None and g.device.type != device.type:
            raise ValueError(
                f"generators[{b}] is on {g.device} but target_probs is on {device}; create it "
                "with make_generator(seed, target_probs.device)"
            )
    u = torch.empty(batch, k, dtype=torch.float32, device=device)
    noise = torch.empty(batch, vocab, dtype=torch.float32, device=device)
    shared = [b for b, g in enumerate(generators) if g is None]
    if len(shared) == batch:
        u.uniform_()
        noise.exponential_()
    else:
        for b, g in enumerate(generators):
            if g is not None:
                u[b].uniform_(generator=g)
                noise[b].exponential_(generator=g)
        if shared:
            idx = to_device_no_sync(shared, torch.long, device)
            u.index_copy_(0, idx, torch.rand(len(shared), k, device=device))
            noise.index_copy_(0, idx, torch.empty(len(shared), vocab, device=device).exponential_())
    # Exp(1) can round to 0: 0/0 = nan would win the argmax on a zero-probability token.
    return u, noise.clamp_min_(_TINY)


def _check_chain_batch(
    target_name: str,
    target: torch.Tensor,
    target_dims: int,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> None:
    """Shapes only: they are host data; checking values would sync."""
    ok = target.dim() == target_dims and draft_tokens.dim() == 2
    if ok:
        batch, k = draft_tokens.shape
        ok = tuple(target.shape[:2]) == (batch, k + 1) and tuple(num_drafts.shape) == (batch,)
        if draft_probs is not None:
            ok = ok and tuple(draft_probs.shape) == (batch, k, target.shape[-1])
    if not ok:
        named = {target_name: target, "draft_tokens": draft_tokens, "num_drafts": num_drafts}
        if draft_probs is not None:
            named["draft_probs"] = draft_probs
        got = ", ".join(f"{name} {tuple(t.shape)}" for name, t in named.items())
        want = f"{target_name} [B, 1 + k{', V' if target_dims == 3 else ''}], draft_tokens "
        want += "[B, k], num_drafts [B]" + (", draft_probs [B, k, V]" if target_dims == 3 else "")
        raise ValueError(f"chain batch shapes disagree: got {got}; expected {want}")
