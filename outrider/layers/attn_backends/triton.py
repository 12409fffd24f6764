"""The Triton backend: paged attention kernels for CUDA (and, under TRITON_INTERPRET=1, the CPU,
which is how the unit tests check their logic against torch_ref).

A forward writes this step's k/v into the cache (one small kernel; negative slots are skipped,
so padded rows may point nowhere), then runs one of two kernels:
    every query_len == 1, no tree mask  -> triton_decode.decode_attention (split-K decode)
    otherwise (prefill chunk, VERIFY)   -> triton_prefill.prefill_attention
Both read every length from device tensors, and a tree mask's shape follows the query lengths
alone, so CUDA graphs captured once serve any context: DECODE and chain VERIFY graphs both work.
The deterministic mode sends every step to triton_chunked.chunked_attention: keys split at fixed
CHUNK_KEYS boundaries, partials merged in chunk order, one tile shape for every step kind.

MLA models (a latent cache, {"latent": [num_blocks, block_size, r + d_r]}) take the same route
in their absorbed form (DECODE, VERIFY): the step's latents are written (by the MLA glue
kernel that makes them, fused.mla_prep_, or else one small kernel here), then
triton_mla.latent_attention attends over them, one kernel for one- and multi-token queries
alike, causal or under a tree mask, split along the context as decode is. Their expanded form
(prefill chunks) runs the reference's PyTorch code (see forward_latent).
What only depends on host data (which kernel, grid sizes, how many splits, the fp32 split
workspace) is derived once per step and kept in meta.backend_data, not re-derived per layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from outrider.core import ForwardMode
from outrider.layers.attn_backends.base import AttentionBackend
from outrider.layers.attn_backends.torch_ref import latent_expanded
from outrider.layers.forward_context import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "the 'triton' attention backend needs the triton package (CUDA builds of torch ship "
        "it; elsewhere `pip install 'triton==3.6.*'`), or choose attention_backend='torch_ref'"
    ) from e

from outrider.layers.attn_backends.triton_chunked import (  # noqa: E402
    CHUNK_KEYS,
    ChunkPlan,
    ChunkWorkspace,
    chunked_attention,
    plan_chunks,
)
from outrider.layers.attn_backends.triton_decode import (  # noqa: E402
    SplitWorkspace,
    choose_num_splits,
    decode_attention,
)
from outrider.layers.attn_backends.triton_mla import (  # noqa: E402
    head_tiles,
    latent_attention,
    write_latent_cache,
)
from outrider.layers.attn_backends.triton_prefill import (  # noqa: E402
    MAX_SPLIT_QUERY_LEN,
    check_tree_mask,
    prefill_attention,
    prefill_config,
    query_tile,
)

_PLAN_KEY = "triton"
# Stand-in SM count off CUDA (the interpreter): small, so CPU tests still see a few splits.
_CPU_SMS = 4


@dataclass
class _StepPlan:
    decode: bool  # the decode kernel serves this step
    batch: int  # sequences
    max_seq_len: int
    max_query_len: int
    query_lens: list[int]
    fixed_splits: int | None  # set by the caller (e.g. one value per CUDA graph bucket)
    # Per (kv_heads, group), or ("latent", heads) for MLA: num_splits, filled by the first
    # layer that asks; and the split workspaces, shared by all layers of the step (they run
    # one after another).
    splits: dict[tuple, int] = field(default_factory=dict)
    workspaces: dict[tuple, SplitWorkspace] = field(default_factory=dict)
    # The deterministic mode's, per (num_heads, kv_heads, head_dim, dtype).
    chunk_plans: dict[tuple, ChunkPlan] = field(default_factory=dict)
    chunk_workspaces: dict[tuple, ChunkWorkspace] = field(default_factory=dict)


class TritonBackend(AttentionBackend):
    name = "triton"
    # PREFILL too (steps with prompt chunks, executor/cuda_graph.py): the prefill kernel reads
    # every length from the device and sizes its grid by a bound the graph fixes.
    graph_modes = frozenset({ForwardMode.DECODE, ForwardMode.VERIFY, ForwardMode.PREFILL})
    supports_latent = True
    takes_written_latents = True
    has_deterministic = True
    deterministic_trees = True

    def __init__(self, num_splits: int | None = None, deterministic: bool = False) -> None:
        """num_splits: force this many context splits in every step (tuning, debugging);
        None chooses per step from batch size and the longest context.

        deterministic: every step, decode included, runs triton_chunked.chunked_attention: one
        query tile shape, the keys split at fixed CHUNK_KEYS boundaries from key 0 and merged
        in chunk order, so a row's bits depend on its position and keys alone while a long row
        still spreads over ceil(context / CHUNK_KEYS) programs a KV head. A tree verify runs
        one token a query tile and reads each row's keys through its mask row, in the order
        and tiles of the decode row it must equal (triton_chunked's docstring)."""
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
        if deterministic and num_splits not in (None, 1):
            raise ValueError(
                f"num_splits={num_splits} with deterministic=True: the deterministic mode "
                f"splits every context at fixed {CHUNK_KEYS}-key chunks, whatever the batch; "
                "leave num_splits None"
            )
        self.num_splits = num_splits
        self.deterministic = deterministic

    def prepare(self, meta: AttentionMetadata, num_splits: int | None = None) -> None:
        """Host-only, once per step. `num_splits` fixes the context splits for this step (a CUDA
        graph runner passes one value per captured batch size, so the grid does not depend on
        the lengths seen at capture); None keeps the constructor's choice or the heuristic."""
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
        if meta.tree_mask is not None:
            check_tree_mask(meta.tree_mask, sum(meta.query_lens_cpu))
        if self.deterministic:
            num_splits = 1
        meta.backend_data[_PLAN_KEY] = _StepPlan(
            decode=meta.tree_mask is None
            and max(meta.query_lens_cpu, default=1) == 1
            and not self.deterministic,
            batch=meta.batch_size,
            max_seq_len=max(meta.seq_lens_cpu, default=0),
            max_query_len=max(meta.query_lens_cpu, default=0),
            query_lens=list(meta.query_lens_cpu),
            fixed_splits=num_splits if num_splits is not None else self.num_splits,
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        kv_cache: dict[str, torch.Tensor],  # "k", "v": [num_blocks, block_size, kv_heads, dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        k_cache, v_cache = kv_cache["k"], kv_cache["v"]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = self._plan(meta)
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        if self.deterministic:
            return self._forward_chunked(q, k_cache, v_cache, meta, plan, scale)
        group = num_heads // max(kv_heads, 1)
        splits = plan.splits.get((kv_heads, group))
        if splits is None:
            splits = plan.splits[(kv_heads, group)] = self._choose_splits(plan, kv_heads, group, q)
        workspace = _workspace(plan, num_tokens, num_heads, splits, head_dim, q.device)
        if plan.decode:
            return decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits, workspace
            )
        return prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            plan.max_query_len, scale, splits, meta.tree_mask, workspace,
        )  # fmt: skip

    @staticmethod
    def _forward_chunked(q, k_cache, v_cache, meta, plan: _StepPlan, scale) -> torch.Tensor:
        """The deterministic mode's attention; its plan and workspace are made by the step's
        first layer and shared by the rest (under a CUDA graph: sized by max_model_len, the
        host context length the graph runner passes, so any replay fits)."""
        num_heads, head_dim = q.shape[1:]
        key = (num_heads, k_cache.shape[2], head_dim, q.dtype)
        chunks = plan.chunk_plans.get(key)
        if chunks is None:
            chunks = plan.chunk_plans[key] = plan_chunks(
                plan.query_lens, plan.max_seq_len, num_heads, k_cache.shape[2], head_dim,
                q.dtype, _num_sms(q.device), tree=meta.tree_mask is not None,
            )  # fmt: skip
        ws_key = (chunks.rows, num_heads, chunks.max_chunks, head_dim, q.device)
        workspace = plan.chunk_workspaces.get(ws_key)
        if workspace is None:
            workspace = plan.chunk_workspaces[ws_key] = ChunkWorkspace.allocate(
                chunks, num_heads, head_dim, q.device
            )
        return chunked_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            chunks, scale, workspace, meta.tree_mask,
        )  # fmt: skip

    def forward_latent(self, q, latent, kv_cache, meta, scale, expand):
        # The expanded form serves prefill chunks only, which are compute-bound and never
        # captured in a graph: the reference's PyTorch code (plans from host lengths) serves
        # them until a prefill kernel over latents exists.
        return latent_expanded(q, latent, kv_cache, meta, scale, expand)

    def forward_latent_absorbed(
        self,
        q_lat: torch.Tensor,  # [num_tokens, num_heads, r]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, d_r]
        latent: torch.Tensor,  # [num_tokens, r + d_r]: this step's [compressed kv | roped k]
        kv_cache: dict[str, torch.Tensor],  # "latent": [num_blocks, block_size, r + d_r]
        meta: AttentionMetadata,
        scale: float,
        written: bool = False,  # stored at meta.slot_mapping by fused.mla_prep_
    ) -> torch.Tensor:  # [num_tokens, num_heads, r]
        cache = kv_cache["latent"]
        if not written:
            write_latent_cache(latent, cache, meta.slot_mapping)
        plan = self._plan(meta)
        num_tokens, num_heads, v_dim = q_lat.shape
        key = ("latent", num_heads)
        splits = plan.splits.get(key)
        if splits is None:
            splits = plan.splits[key] = self._choose_latent_splits(plan, num_heads, q_lat.device)
        workspace = _workspace(plan, num_tokens, num_heads, splits, v_dim, q_lat.device)
        return latent_attention(
            q_lat, q_pe, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            plan.max_query_len, scale, splits, meta.tree_mask, workspace,
        )  # fmt: skip

    def _plan(self, meta: AttentionMetadata) -> _StepPlan:
        if _PLAN_KEY not in meta.backend_data:
            self.prepare(meta)
        return meta.backend_data[_PLAN_KEY]

    @staticmethod
    def _choose_latent_splits(plan: _StepPlan, num_heads: int, device: torch.device) -> int:
        # One program per (sequence, query token, tile of heads): at 128 heads a decode batch
        # of 16 already runs 128 programs before splitting.
        if plan.fixed_splits is not None:
            return plan.fixed_splits
        if plan.max_query_len > MAX_SPLIT_QUERY_LEN:
            return 1  # a long query has programs enough to fill the GPU
        programs = plan.batch * max(plan.max_query_len, 1) * head_tiles(num_heads)
        return choose_num_splits(programs, plan.max_seq_len, _num_sms(device))

    @staticmethod
    def _choose_splits(plan: _StepPlan, kv_heads: int, group: int, q: torch.Tensor) -> int:
        if plan.fixed_splits is not None:
            return plan.fixed_splits
        programs = plan.batch * kv_heads
        if not plan.decode:
            if plan.max_query_len > MAX_SPLIT_QUERY_LEN:
                return 1  # prefill chunks have q tiles enough to fill the GPU
            block_m = prefill_config(q.shape[-1], q.dtype)[0]
            block_q, _ = query_tile(plan.max_query_len, group, block_m)
            programs *= triton.cdiv(plan.max_query_len, block_q)
        return choose_num_splits(programs, plan.max_seq_len, _num_sms(q.device))


def _workspace(
    plan: _StepPlan, rows: int, num_heads: int, splits: int, dim: int, device: torch.device
) -> SplitWorkspace | None:
    """The step's split workspace of this shape (None when nothing is split), allocated by the
    first layer that needs it."""
    if splits == 1:
        return None
    key = (rows, num_heads, splits, dim, device)
    workspace = plan.workspaces.get(key)
    if workspace is None:
        workspace = plan.workspaces[key] = SplitWorkspace.allocate(
            rows, num_heads, splits, dim, device
        )
    return workspace


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot = block * block_size + offset
) -> None:
    """Scatter this step's k/v rows into the paged cache, one program per token, no host sync.
    A negative slot leaves its token out (padded rows need not own a slot)."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtype {k.dtype} differs from the cache's {k_cache.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=kv_heads, KV_HEADS_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
    )  # fmt: skip


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    ok = (heads < KV_HEADS) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=ok)
    k_dst = k_cache_ptr + page * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    v_dst = v_cache_ptr + page * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    tl.store(k_dst, k, mask=ok)
    tl.store(v_dst, v, mask=ok)
