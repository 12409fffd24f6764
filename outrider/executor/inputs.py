"""ScheduledBatch (plain Python data) -> the device tensors one forward needs, built once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.core import ScheduledBatch
from outrider.layers.forward_context import AttentionMetadata
from outrider.speculative.tree import TreeTopology
from outrider.transfer import to_device_packed


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    # Rows of the hidden states whose logits are needed: the last token of each sampling seq.
    logits_indices: torch.Tensor  # [num_sampling_seqs] int64


def build_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> ForwardInputs:
    """Worked example (block_size 4): a seq with block_ids [7, 2] computing tokens at positions
    5..6 gets slot_mapping [2*4+1, 2*4+2] = [9, 10]: position p lives in block p // 4 of its
    table, at offset p % 4."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    query_lens: list[int] = []
    logits_indices: list[int] = []
    max_blocks = max(len(s.block_ids) for s in batch.seqs)
    block_tables = []
    trees: list[tuple[int, TreeTopology]] = []  # (batch index, topology) of non-chain drafts
    for i, s in enumerate(batch.seqs):
        n = s.query_len
        ids += s.token_ids
        # Token t's KV goes to slot position start_pos + t whatever its tree position: a tree
        # node's rotary position is root + depth, its slot is root + 1 + node index.
        slot_pos = range(s.start_pos, s.start_pos + n)
        slots += [s.block_ids[p // block_size] * block_size + p % block_size for p in slot_pos]
        if s.drafts is not None and not s.drafts.is_chain:
            topology = TreeTopology.from_parents(s.drafts.parents)
            positions += topology.positions(s.start_pos)
            trees.append((i, topology))
        else:
            positions += slot_pos
        query_start.append(query_start[-1] + n)
        query_lens.append(n)
        seq_lens.append(s.context_len)
        block_tables.append(s.block_ids + [0] * (max_blocks - len(s.block_ids)))
        if s.drafts is not None:  # every row: the root's and each draft's next-token logits
            logits_indices += range(query_start[-2], query_start[-1])
        elif s.sample:
            logits_indices.append(query_start[-1] - 1)

    slot_mapping, query_start_loc, seq_lens_t, tables, input_ids, pos, logits = to_device_packed(
        [
            (slots, torch.int64),
            (query_start, torch.int32),
            (seq_lens, torch.int32),
            (block_tables, torch.int32),
            (ids, torch.int64),
            (positions, torch.int64),
            (logits_indices, torch.int64),
        ],
        device,
    )  # one copy for the seven (to_device_packed)
    attn = AttentionMetadata(
        mode=batch.mode,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=tables,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        tree_mask=_tree_mask(batch, trees, query_start, device) if trees else None,
    )
    return ForwardInputs(input_ids=input_ids, positions=pos, attn=attn, logits_indices=logits)


def table_slots_no_sync(
    tables: torch.Tensor,  # [B, W] int32 block tables, the last column the scratch block
    pos: torch.Tensor,  # [B, n] int64 positions, computed on the device
    block_size: int,
) -> torch.Tensor:  # [B, n] int64 flat KV slots
    """Where positions computed on the device put their KV (graph-safe): each row's block for
    the position, or the last column (the scratch block) for one past the table's width."""
    col = (pos // block_size).clamp(max=tables.shape[1] - 1)
    return tables.gather(1, col).long() * block_size + pos % block_size


def _tree_mask(
    batch: ScheduledBatch,
    trees: list[tuple[int, TreeTopology]],
    query_start: list[int],
    device: torch.device,
) -> torch.Tensor:
    """[num_tokens, M] bool over each sequence's last M keys (AttentionMetadata.tree_mask),
    M = the longest query: a tree-verifying sequence's rows hold its ancestor mask in their last
    1 + N columns, an ordinary sequence's rows are causal over their last query_len columns,
    and every earlier column (prefix keys, or none when the context is shorter) is True.

    Example: a tree with parents [-1, -1, 0] beside a 2-token chunk and a decode, M = 4:
        tree (R n0 n1 n2)   1 . . .      chunk   1 1 1 .      decode   1 1 1 1
                            1 1 . .              1 1 1 1
                            1 . 1 .
                            1 1 . 1
    """
    width = max(s.query_len for s in batch.seqs)
    mask = torch.ones(query_start[-1], width, dtype=torch.bool)
    for s, start in zip(batch.seqs, query_start):
        n = s.query_len
        mask[start : start + n, width - n :] = torch.ones(n, n, dtype=torch.bool).tril()
    for i, topology in trees:
        s, start = batch.seqs[i], query_start[i]
        mask[start : start + s.query_len, width - s.query_len :] = topology.ancestor_mask()
    return mask if device.type == "cpu" else mask.pin_memory().to(device, non_blocking=True)
