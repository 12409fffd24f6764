"""Drafting inside the speculative step from tokens alone (a TokenDrafter: n-gram lookup), for
steps launched before the step before them is read (engine/overlap.py), whose tokens the host
does not have yet.

The token pool: one int64 per KV slot, [num_blocks * block_size], the token whose KV the slot
holds. Every target forward writes its input tokens at its slot mapping beside its KV
(ModelRunner.forward, SpecStep.verify_no_sync), so a row's tokens 0 .. p are in the slots its
block table gives positions 0 .. p once position p is computed, whoever computed them: a
prefill, a plain step run ahead on ids still on the device, a verify, or an earlier request
whose blocks a prefix-cache hit reuses (their tokens are the same: blocks are cached by their
tokens). Slots of rejected drafts hold stale tokens past a row's end, which no lookup reads.

After a verify (row at root position s, m drafts accepted, the target's tokens t_0 .. t_k):

    positions   s-W+m+1 ... s ... s+m   s+m+1
    tokens      pool (the verify wrote its root and drafts there)   t_m (the new last token)

the window of W + 1 tokens goes to the drafter's lookup (TokenDrafter.draft_from_tokens_no_sync)
for the row's next k drafts; positions before 0 are marked invalid.
"""

from __future__ import annotations

import torch

from outrider.executor.inputs import table_slots_no_sync
from outrider.speculative.base import TokenDrafter


def token_pool(num_slots: int, device: torch.device) -> torch.Tensor:
    """[num_slots] int64 zeros: the token at each KV slot (the module doc)."""
    return torch.zeros(num_slots, dtype=torch.int64, device=device)


def write_tokens_no_sync(
    pool: torch.Tensor,  # [num_slots] int64
    slots: torch.Tensor,  # [T] int64 a forward's slot mapping
    ids: torch.Tensor,  # [T] int64 its input tokens
) -> None:
    """A forward's input tokens at its slots (padded rows' go to the scratch block, as their
    KV does: collisions there are harmless)."""
    pool.index_copy_(0, slots, ids)


class TokenStepDrafter:
    """A TokenDrafter as the speculative step runs a chain drafter (the call it makes of a
    DeviceDrafter after a verify, `after_verify_no_sync`): the lookup over each row's window
    of the token pool. It reads no aux streams, writes no KV and runs on rank 0 alone."""

    aux_layers: tuple[int, ...] = ()
    sharded = False

    def __init__(self, lookup: TokenDrafter, pool: torch.Tensor, block_size: int) -> None:
        self.lookup, self.pool, self.block_size = lookup, pool, block_size
        self.window = lookup.token_window

    def after_verify_no_sync(
        self,
        meta,  # the verify's AttentionMetadata (unused: the pool is read by block table)
        next_ids: torch.Tensor,  # [B * t] the target's token after each row
        positions: torch.Tensor,  # [B * t] (unused)
        aux,  # None: no aux streams
        num_accepted: torch.Tensor,  # [B]
        starts: torch.Tensor,  # [B] each row's root position
        block_tables: torch.Tensor,  # [B, W] int32, padded with the scratch block
        k_draft: int,
        backend,  # (unused)
    ) -> torch.Tensor:  # [B, k_draft] int64
        b = starts.shape[0]
        tokens = next_ids.view(b, -1)
        last = starts + num_accepted + 1  # the new last token's position
        newest = tokens.gather(1, num_accepted[:, None])  # [B, 1]
        back = torch.arange(-self.window, 0, device=starts.device)
        pos = last[:, None] + back[None, :]  # [B, W]: the tokens before it
        slots = table_slots_no_sync(block_tables, pos.clamp(min=0), self.block_size)
        window = torch.cat([self.pool[slots], newest], dim=1)
        valid = torch.cat([pos >= 0, torch.ones_like(newest, dtype=torch.bool)], dim=1)
        return self.lookup.draft_from_tokens_no_sync(window, valid, k_draft)
