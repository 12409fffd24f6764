"""The reference backend: plain PyTorch on any device. It is the oracle the fast kernels are
tested against, so clarity beats speed here; still, decode batches and verifies take one
batched SDPA call per layer rather than one per sequence, which is what keeps CPU decoding
usable and a CPU verify close to a decode's cost; prefill chunks loop over their sequences."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from outrider.core import ForwardMode
from outrider.layers.attn_backends.base import AttentionBackend
from outrider.layers.forward_context import AttentionMetadata


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    # The decode path reads lengths from device tensors only (it attends over the whole padded
    # block table, which is correct but slow under graphs: the fast backends exist for that).
    graph_modes = frozenset({ForwardMode.DECODE})
    supports_latent = True
    has_deterministic = True
    deterministic_trees = True

    def __init__(self, deterministic: bool = False) -> None:
        """deterministic: attend one query row at a time over exactly the keys it sees, in
        position order (`_per_row`): a row's SDPA call, and so its bits, are the same in a
        decode, a verify (chain or tree) and a prefill chunk, alone or batched. One call per
        query token: slow, and it plans from host lengths, so no graph serves it."""
        self.deterministic = deterministic
        if deterministic:
            self.graph_modes = frozenset()

    def forward_latent(self, q, latent, kv_cache, meta, scale, expand):
        return latent_expanded(q, latent, kv_cache, meta, scale, expand)

    def forward_latent_absorbed(self, q_lat, q_pe, latent, kv_cache, meta, scale, written=False):
        # The latent cache is multi-query attention as it stands: one KV head of width
        # r + d_r, keys the whole latent, values its first r columns. Values are read as the
        # whole latent and the roped columns dropped after (d_r / r extra, 1/8 at DeepSeek-V3's
        # ranks), so the decode and per-sequence GQA paths serve unchanged, tree masks included.
        q = torch.cat([q_lat, q_pe], dim=-1)  # [T, heads, r + d_r], the latents' order
        cache = kv_cache["latent"]
        if not written:
            cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent)
        kv = cache.unsqueeze(2)  # [num_blocks, block_size, 1, width]
        if meta.tree_mask is None and max(meta.query_lens_cpu) == 1:
            out = _decode(q, kv, kv, meta, scale)
        else:
            out = _per_sequence(q, kv, kv, meta, scale)
        return out[..., : q_lat.shape[-1]]  # [T, heads, r]

    def forward(self, q, k, v, kv_cache, meta, scale):
        k_cache, v_cache = kv_cache["k"], kv_cache["v"]
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        if self.deterministic:
            return _per_row(q, k_cache, v_cache, meta, scale)
        if meta.tree_mask is None and max(meta.query_lens_cpu) == 1:
            return _decode(q, k_cache, v_cache, meta, scale)
        span = _query_span(meta)
        if span:
            return _batched(q, k_cache, v_cache, meta, scale, span)
        return _per_sequence(q, k_cache, v_cache, meta, scale)


def latent_expanded(
    q: torch.Tensor,  # [num_tokens, num_heads, qk_head_dim]: [nope | rope] per head
    latent: torch.Tensor,  # [num_tokens, width]
    kv_cache: dict[str, torch.Tensor],  # "latent": [num_blocks, block_size, width]
    meta: AttentionMetadata,
    scale: float,
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
    """MLA without weight absorption (prefill chunks): every cached latent is expanded into
    its per-head key and value (expand = kv_b_proj), then attention is ordinary multi-head
    attention. Costs heads x (nope + v) x kv_lora_rank FLOPs per cached token per layer,
    amortised over a chunk's many queries. Plans from host lengths (not graph-safe); the
    Triton backend serves prefill chunks with it too."""
    cache = kv_cache["latent"]
    cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent)
    if meta.tree_mask is None and max(meta.query_lens_cpu) == 1:
        return _latent_decode(q, cache, meta, scale, expand)
    return _latent_per_sequence(q, cache, meta, scale, expand)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # One query per sequence: gather every sequence's blocks into a padded [B, L] key range and
    # mask the padding. Query heads are grouped under their KV head (GQA without repeating KV):
    # head h uses KV head h // group, so q -> [B, kv_heads, group, head_dim].
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    mask = meta.backend_data.get("decode_mask")
    if mask is None:
        length = meta.block_tables.shape[1] * block_size
        keys = torch.arange(length, device=q.device)
        mask = (keys[None, :] < meta.seq_lens[:, None]).view(batch, 1, 1, length)
        meta.backend_data["decode_mask"] = mask
    flat_blocks = meta.block_tables.long().flatten()  # [B * max_blocks]
    keys = _gather(k_cache, flat_blocks).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    values = _gather(v_cache, flat_blocks).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    # keys, values: [B, kv_heads, max_blocks * block_size, head_dim]
    qg = q.view(batch, kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _query_span(meta: AttentionMetadata) -> int:
    """The most query rows a sequence of the step has, where the step is worth one batched
    call (a verify of 1 + k drafts a row, chain or tree, rows with fewer or none among them):
    0 for a step with a prefill-sized query, which the per-sequence loop serves."""
    span = max(meta.query_lens_cpu, default=0)
    return span if 1 < span <= BATCHED_MAX_QUERY else 0


# Past this many queries a sequence, a step holds a prefill chunk: padding every sequence's
# queries and keys to the longest costs more than the loop's calls.
BATCHED_MAX_QUERY = 64


def _batched(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, span: int) -> torch.Tensor:
    """Each sequence's query rows, its last positions (a verify), right-aligned in `span` rows
    (row i of sequence b at position seq_len_b - span + i; rows before its own are padding):
    as _decode, one batched SDPA over each sequence's blocks padded to [B, L], a row seeing
    the keys at its position and before, or, under a tree mask over each sequence's last W
    keys, the keys before those and the tree's columns the mask gives it. On 2 CPU cores the
    per-sequence loop (an SDPA call a sequence and layer, unbatched) took 20 of a 79 ms
    EAGLE-3 verify of 4 x 4."""
    _, num_heads, head_dim = q.shape
    batch = len(meta.query_lens_cpu)
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    key = ("batched", group)
    plan = meta.backend_data.get(key)
    if plan is None:
        plan = meta.backend_data[key] = _batched_plan(meta, block_size, group, span, q.device)
    mask, rows = plan
    if rows is not None:  # ragged: each token to its padded row (the padding rows' are 0)
        q = q.new_zeros(batch * span, num_heads, head_dim).index_copy_(0, rows, q)
    flat_blocks = meta.block_tables.long().flatten()
    keys = _gather(k_cache, flat_blocks).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    values = _gather(v_cache, flat_blocks).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    qg = q.view(batch, span, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, kv_heads, group * span, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    # [B, kvh, group * span, d] -> [B * span, heads, d]
    out = out.view(batch, kv_heads, group, span, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch * span, num_heads, head_dim)
    return out if rows is None else out.index_select(0, rows)


def _batched_plan(
    meta: AttentionMetadata, block_size: int, group: int, span: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mask [B, 1, group * span, L] for _batched's rows, ordered (head of the group, query
    row), and each token's padded row, or None where every sequence has `span` rows)."""
    lens_cpu = meta.query_lens_cpu
    batch = len(lens_cpu)
    length = meta.block_tables.shape[1] * block_size
    keys = torch.arange(length, device=device)
    lens = meta.seq_lens.long()[:, None]  # [B, 1]
    ragged = any(n != span for n in lens_cpu)
    rows = None
    if ragged:
        rows = torch.tensor(
            [b * span + span - n + t for b, n in enumerate(lens_cpu) for t in range(n)],
            device=device,
        )
    if meta.tree_mask is None:
        pos = lens - span + torch.arange(span, device=device)[None, :]  # [B, span]
        seen = keys[None, None, :] <= pos[:, :, None]  # [B, span, L]
    else:
        width = meta.tree_mask.shape[1]
        tree = meta.tree_mask
        if ragged:
            tree = tree.new_zeros(batch * span, width).index_copy_(0, rows, tree)
        col = keys[None, :] - (lens - width)  # [B, L]: the tree column a key is, if any
        in_tree = (col >= 0) & (col < width)
        picked = tree.view(batch, span, width).gather(
            2, col.clamp(0, width - 1)[:, None, :].expand(batch, span, length)
        )
        before = (keys[None, :] < lens - width)[:, None, :]
        seen = torch.where(in_tree[:, None, :], picked, before)
    if ragged:  # padding rows see key 0: no row without a key (SDPA would give NaN there)
        short = torch.tensor([span - n for n in lens_cpu], device=device)
        pad = torch.arange(span, device=device)[None, :] < short[:, None]  # [B, span]
        seen[:, :, 0] |= pad
    # Rows ordered (group head, query) as _batched's: each query's row repeats per head.
    mask = seen.repeat(1, group, 1).view(batch, 1, group * span, length)
    return mask, rows


def _per_sequence(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    key = ("per_sequence", group)  # the masks repeat per group: MHA and absorbed MLA differ
    plan = meta.backend_data.get(key)
    if plan is None:
        plan = meta.backend_data[key] = _plan(meta, block_size, group, q.device)
    out = torch.empty_like(q)
    for start, end, ctx, blocks, mask in plan:
        qlen = end - start
        keys = _gather(k_cache, blocks).view(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)
        values = _gather(v_cache, blocks).view(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)
        # keys, values: [kv_heads, ctx, head_dim]
        # [qlen, H, d] -> [kvh, group * qlen, d]; the mask repeats once per head of the group.
        qg = q[start:end].view(qlen, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(kv_heads, group * qlen, head_dim)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        out[start:end] = (
            o.view(kv_heads, group, qlen, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(qlen, num_heads, head_dim)
        )
    return out


def _per_row(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Each query row attends alone: its visible keys gathered in position order into a
    contiguous [kv_heads, n, head_dim], its heads grouped under their KV head, one SDPA call
    with no mask. A decode row at position p, a verify row at p and a prefill row at p make
    the same call on the same bytes. A tree row sees the prefix and the mask's columns in
    column order: its ancestors by depth (parents precede children in a tree's node order),
    the keys a decode reads at those positions once the accepted path is moved into place."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    out = torch.zeros_like(q)  # a row with no key (a padded sequence) comes out 0
    start = 0
    for i, (qlen, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        blocks = meta.block_tables[i, : (ctx + block_size - 1) // block_size].long()
        keys = _gather(k_cache, blocks).view(-1, kv_heads, head_dim)[:ctx]
        values = _gather(v_cache, blocks).view(-1, kv_heads, head_dim)[:ctx]
        for t in range(start, start + qlen):
            if meta.tree_mask is None:
                seen = slice(0, ctx - (start + qlen - t) + 1)  # positions <= its own
            else:
                width = meta.tree_mask.shape[1]
                tail = min(width, ctx)
                cols = meta.tree_mask[t, width - tail :].nonzero().flatten()
                prefix = torch.arange(ctx - tail, device=q.device)
                seen = torch.cat([prefix, ctx - tail + cols])
            k = keys[seen].transpose(0, 1).contiguous()  # [kv_heads, n, head_dim]
            if k.shape[1] == 0:
                continue
            v = values[seen].transpose(0, 1).contiguous()
            o = F.scaled_dot_product_attention(
                q[t].view(kv_heads, group, head_dim), k, v, scale=scale
            )  # [kv_heads, group, head_dim]
            out[t] = o.reshape(num_heads, head_dim)
        start += qlen
    return out


def _latent_decode(q, cache, meta: AttentionMetadata, scale: float, expand) -> torch.Tensor:
    # As _decode: every sequence's blocks gathered into a padded [B, L] key range, padding
    # masked; the latents expand to per-head keys and values (no grouping: MLA heads each
    # have their own key).
    batch, num_heads, qk_dim = q.shape
    block_size, width = cache.shape[1], cache.shape[2]
    length = meta.block_tables.shape[1] * block_size
    mask = meta.backend_data.get("decode_mask")
    if mask is None:
        keys = torch.arange(length, device=q.device)
        mask = (keys[None, :] < meta.seq_lens[:, None]).view(batch, 1, 1, length)
        meta.backend_data["decode_mask"] = mask
    latents = _gather(cache, meta.block_tables.long().flatten()).view(-1, width)
    k, v = expand(latents)  # [B * L, heads, qk_dim], [B * L, heads, v_dim]
    k = k.view(batch, length, num_heads, qk_dim).transpose(1, 2)
    v = v.view(batch, length, num_heads, -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale)
    return out.view(batch, num_heads, -1)  # [B, heads, v_dim]


def _latent_per_sequence(q, cache, meta: AttentionMetadata, scale: float, expand) -> torch.Tensor:
    block_size, width = cache.shape[1], cache.shape[2]
    plan = meta.backend_data.get("per_sequence_latent")
    if plan is None:
        plan = _plan(meta, block_size, 1, q.device)
        meta.backend_data["per_sequence_latent"] = plan
    out = None
    for start, end, ctx, blocks, mask in plan:
        k, v = expand(_gather(cache, blocks).view(-1, width)[:ctx])  # [ctx, heads, *]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale,
        )  # [heads, qlen, v_dim]  # fmt: skip
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], o.shape[-1])
        out[start:end] = o.transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] for a 1-D index: index_select on a [num_blocks, -1] view is ~5x faster on
    CPU than advanced indexing (which builds a generic strided gather)."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


def _plan(meta: AttentionMetadata, block_size: int, group: int, device: torch.device) -> list:
    # Per sequence: (first row, end row, context length, its blocks, mask [group * qlen, ctx]).
    # A tree mask covers each sequence's last M keys; the keys before them are all visible, and
    # a sequence shorter than M uses only its mask's last ctx columns (e.g. M 4, ctx 2: 2..3).
    plan = []
    start = 0
    for i, (qlen, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        end = start + qlen
        blocks = meta.block_tables[i, : (ctx + block_size - 1) // block_size].long()
        if meta.tree_mask is not None:
            width = meta.tree_mask.shape[1]
            tail = min(width, ctx)
            mask = torch.ones(qlen, ctx, dtype=torch.bool, device=device)
            mask[:, ctx - tail :] = meta.tree_mask[start:end, width - tail :]
        else:
            q_pos = torch.arange(ctx - qlen, ctx, device=device)
            mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]  # [qlen, ctx]
        plan.append((start, end, ctx, blocks, mask.repeat(group, 1)))
        start = end
    return plan
