"""What one step costs: the kernels a forward launches (bytes each reads, FLOPs each does), the
collectives between them, and the time they take on a GPU and link. Plain data in and out.

Per rank at tensor-parallel size tp, for N = batch x tokens-per-sequence tokens over contexts of
C tokens, each kernel takes

    t = max(bytes / (bandwidth x mem_efficiency), flops / (peak x compute_efficiency)) + overhead

(a grouped MoE GEMM's memory time no less than the bytes its blocks take in over `sms x
moe_block_gbs_per_sm`, or for INT4 experts, which the SMs unpack, `sms x int4_unpack_gbs_per_sm`,
and at few rows, one GEMV a row, each row's expert over `sms x int4_gemv_gbs_per_sm`)

where the overhead is what a kernel costs beyond moving its bytes or doing its FLOPs (its
start, the ramp to full bandwidth, the tail, the gap to the next kernel in a graph): a GEMM's
(`gemm_overhead_us`: a cuBLAS GEMV of Llama-3.1-8B's gate/up projection takes 57.6 us of bytes
at 85% of the H200's bandwidth plus ~3 us, and one of the default model's 0.6 MB projections
~3.8 us) or any other kernel's (`kernel_overhead_us`: norms, rotary, activations, ~1.1-1.7 us).
Added, not a floor under max(): the H200's profile of both models' decode graphs
(benchmarks/results/plan_accuracy.json) shows the large GEMMs paying it too.

The step is the sum of its kernels and collectives (nothing overlaps inside a forward). A
kernel's time goes to `memory` or `compute` by which bound it hit, its overhead to `launch`.
Eager steps (no CUDA graph) also pay host dispatch per launch: the step is the larger of the
device's time and the host's, the difference going to `launch`; on a CPU, whose cores dispatch
a kernel and then run it, the sum. A CPU's BLAS also runs a GEMM of few rows as one GEMV a row
and packs the weights of larger ones (`gemv_rows`, `gemm_weight_reads`), so its weights'
time is a step function of the rows where a GPU's is flat. A step of the engine's also pays
its host's own work once (`step_host_us`, `row_host_us` a sequence and `token_host_us` a
token: building inputs, launching the graph, reading the result back; `host`), which an engine
that overlaps its host work with the device hides.

Weights read per step are what the N tokens touch: every dense weight once, and for MoE
layers the experts routed to. With E routed experts, k chosen per token, routing uniform and
independent, an expert is missed by one token with probability 1 - k/E, so N tokens touch

    U(N) = E * (1 - (1 - k/E)^N)        experts in expectation (kimi-k2.5: U(1) = 8, U(4) = 31.4,
                                         U(64) = 284 of 384)

which is why large batches read most of the experts and a verify of 1 + k tokens per sequence
reads several times the expert bytes of a decode step. Real routing is skewed, so U(N) is an
upper estimate; a model given its measured routing (ModelSpec.routing, `outrider plan
--routing`: each expert's chance p_e that a token chooses it, per layer) is priced with
U(N) = sum_e 1 - (1 - p_e)^N and the blocks below from each expert's own binomial. The engine's grouped GEMM (layers/moe_fused.py moe_gemm) runs each expert's
rows in blocks of MOE_BLOCK_M, and every block takes in its expert's weights: the first from
memory, the rest from L2 (an expert's blocks run together). So the SMs take in

    B(N) = sum over experts of ceil(rows_e / MOE_BLOCK_M)     experts' weights (expert_blocks:
                                                               E x E[ceil(X / M)], X ~ Bin(N, k/E))

which is U(N) while few tokens share an expert; where each holds several blocks, this intake
bounds the GEMM, not the memory. Moonlight's verify of 64 x 8 tokens: 48 rows and 3.5 blocks
an expert, and 32 for each shared expert, which the engine runs among the routed ones with
every token's row (`folded_shared_experts`).

Collectives per forward at tp > 1: rank 0's broadcast of the step's inputs (ids, positions,
slots, lengths, block tables, logits rows: one packed buffer, executor/tp_channel.py), two
all-reduces per layer (after attention's output projection and after the MLP or MoE, shared
experts summed in before it), one for the vocabulary-parallel embedding, and an all-gather of
the vocabulary-parallel LM head's logits. A ring broadcast of S bytes costs what an all-gather
with S x n / (n - 1) bytes out does: the same hops, S through each link.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from outrider.plan.hardware import Gpu, Link
from outrider.plan.models import ModelSpec, weight_format

ACT_BYTES = 2  # activations and logits in bf16
INPUT_BLOCK = 16  # the KV block size the engine's block tables count in (its default)
# The rows of one expert a block of the engine's grouped MoE GEMM takes (layers/moe_fused.py
# MOE_BLOCK_M; copied: that module imports torch, the planner does not).
MOE_BLOCK_M = 16
# INT4 experts' products of at most this many (token, expert) rows run as one GEMV a row, each
# row streaming its own expert's weights (layers/moe_fused.py MOE_GEMV_MAX_ROWS; copied).
INT4_GEMV_MAX_ROWS = 128


@dataclass(frozen=True)
class Kernel:
    name: str
    bytes: float
    flops: float
    gemm: bool = False  # a GEMM (or attention): pays gemm_overhead_us, else kernel_overhead_us
    # A dense GEMM's (rows, inputs, outputs): its FLOPs are done in whole tiles and whole waves
    # of tiles over the SMs (`padded_flops`). None: the FLOPs as counted.
    shape: tuple[int, float, float] | None = None
    int4: bool = False  # reads INT4 experts: the SMs unpack what they take in
    # A grouped MoE GEMM's: the bytes its blocks take in, each block its expert's weights (from
    # L2 where another block of that expert brought them from memory). 0: not one.
    block_bytes: float = 0.0
    gemv: bool = False  # INT4 experts one GEMV a row: taken in at int4_gemv_gbs_per_sm


SPLIT_K_MIN = 512  # the least of the input dimension one split of a split-K GEMM takes


def padded_flops(k: Kernel, sms: int) -> float:
    """A GEMM's FLOPs as the GPU does them: rows in tiles of 16-128 (the power of two that
    holds them: skinny decode GEMMs take narrow tiles), outputs in tiles of 128, the input
    dimension split in parts of at least SPLIT_K_MIN where too few tiles would fill the SMs
    (split-K), and tiles in whole waves over `sms` SMs. At 1024 rows the default model's
    [576 -> 3072] gate/up projection is 192 tiles, two waves of 132, and its input too short to
    split: 1.4x its FLOPs. Llama-3.1-8B's [14336 -> 4096] down projection at 256 rows is 64
    tiles, each split 2 ways: one wave, 0.97 of it busy."""
    if k.shape is None or sms <= 0:
        return k.flops
    rows, k_in, k_out = k.shape
    tile_m = min(128, max(16, 1 << max(0, math.ceil(math.log2(max(rows, 1))))))
    best = math.inf
    for tile_n in (64, 128):
        tiles = math.ceil(rows / tile_m) * math.ceil(k_out / tile_n)
        splits = max(1, min(sms // tiles, int(k_in // SPLIT_K_MIN)))
        waves = math.ceil(tiles * splits / sms)
        best = min(best, waves * sms * tile_m * tile_n * 2.0 * k_in / splits)
    return max(k.flops, best)


@dataclass(frozen=True)
class Collective:
    kind: str  # "all_reduce" | "all_gather" | "broadcast"
    bytes: float  # all-reduce: each rank's buffer; all-gather: the gathered output; broadcast: the buffer


@dataclass(frozen=True)
class Setup:
    """Where a model runs. `graphs`: decode steps replay CUDA graphs; `verify_graphs`: verify
    and draft steps do too (an engine without verify graphs runs them eager). `algo` pins an
    all-reduce algorithm ("ring", "oneshot"); None takes the link's cheapest."""

    model: ModelSpec
    gpu: Gpu
    link: Link
    tp: int = 1
    graphs: bool = True
    verify_graphs: bool = True
    algo: str | None = None

    def __post_init__(self) -> None:
        self.model.check_tp(self.tp)


@dataclass(frozen=True)
class StepCost:
    """One step on one rank: what it moves and computes, and its predicted milliseconds."""

    kind: str
    tokens: int
    bytes: float
    flops: float
    launches: int
    collectives: dict[str, int]
    collective_bytes: dict[str, float]
    compute_ms: float
    memory_ms: float
    comm_ms: float
    launch_ms: float
    experts_touched: float = 0.0
    host_ms: float = 0.0
    parts: tuple[StepCost, ...] = field(default=(), repr=False)

    @property
    def ms(self) -> float:
        return self.compute_ms + self.memory_ms + self.comm_ms + self.launch_ms + self.host_ms

    def __add__(self, other: StepCost) -> StepCost:
        def merged(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        return StepCost(
            kind=self.kind,
            tokens=self.tokens + other.tokens,
            bytes=self.bytes + other.bytes,
            flops=self.flops + other.flops,
            launches=self.launches + other.launches,
            collectives=merged(self.collectives, other.collectives),
            collective_bytes=merged(self.collective_bytes, other.collective_bytes),
            compute_ms=self.compute_ms + other.compute_ms,
            memory_ms=self.memory_ms + other.memory_ms,
            comm_ms=self.comm_ms + other.comm_ms,
            launch_ms=self.launch_ms + other.launch_ms,
            host_ms=self.host_ms + other.host_ms,
            experts_touched=max(self.experts_touched, other.experts_touched),
            parts=(*(self.parts or (self,)), *(other.parts or (other,))),
        )

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "tokens": self.tokens,
            "ms": round(self.ms, 4),
            "compute_ms": round(self.compute_ms, 4),
            "memory_ms": round(self.memory_ms, 4),
            "comm_ms": round(self.comm_ms, 4),
            "launch_ms": round(self.launch_ms, 4),
            "host_ms": round(self.host_ms, 4),
            "bytes": self.bytes,
            "flops": self.flops,
            "launches": self.launches,
            "collectives": self.collectives,
            "collective_bytes": self.collective_bytes,
            "experts_touched": round(self.experts_touched, 2),
        }


def unique_experts(num_experts: int, per_token: int, tokens: int) -> float:
    """U(N) = E * (1 - (1 - k/E)^N): experts touched by N tokens routed uniformly."""
    if num_experts == 0 or tokens == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


@functools.lru_cache(maxsize=1024)
def expert_blocks(num_experts: int, per_token: int, tokens: int, block: int = MOE_BLOCK_M) -> float:
    """E x E[ceil(X / M)], X ~ Binomial(N, k/E): the blocks of M rows the grouped GEMM runs for
    N tokens routed uniformly (each expert's rows are binomial; one with none has no block).
    U(N) while few tokens share an expert; Moonlight's 64 experts top-6: 69.8 blocks at 128
    tokens, 127.4 at 256, 221.6 at 512 (48 rows an expert)."""
    if num_experts == 0 or tokens == 0:
        return 0.0
    return num_experts * _blocks_of_one(per_token / num_experts, tokens, block)


def _blocks_of_one(p: float, tokens: int, block: int) -> float:
    """E[ceil(X / M)], X ~ Binomial(N, p): one expert's blocks of M rows for N tokens."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(math.ceil(tokens / block))
    if tokens <= block:  # one block, if any row
        return 1.0 - (1.0 - p) ** tokens
    mean, sd = tokens * p, math.sqrt(tokens * p * (1.0 - p))
    lo, hi = max(1, int(mean - 12 * sd)), min(tokens, int(mean + 12 * sd) + 1)
    log_n, lp, lq = math.lgamma(tokens + 1), math.log(p), math.log1p(-p)
    total = 0.0
    for x in range(lo, hi + 1):
        log_pmf = log_n - math.lgamma(x + 1) - math.lgamma(tokens - x + 1) + x * lp
        total += math.ceil(x / block) * math.exp(log_pmf + (tokens - x) * lq)
    return total


@functools.lru_cache(maxsize=1 << 16)
def _routed_one(p: float, tokens: int, block: int) -> tuple[float, float]:
    """(P(touched), E[blocks]) of an expert each token chooses with probability p."""
    return 1.0 - (1.0 - p) ** tokens, _blocks_of_one(p, tokens, block)


# Measured probabilities are priced on a grid 1% apart (relative): a model's thousands of
# (layer, expert) values then share a few hundred binomial sums.
_GRID = 100.0


@functools.lru_cache(maxsize=256)
def routed_load(
    routing: tuple[tuple[float, ...], ...], tokens: int, block: int = MOE_BLOCK_M
) -> tuple[tuple[float, float], ...]:
    """Per row of `routing` (ModelSpec.routing: each expert's chance that a token chooses
    it), (U, B) for N tokens: the experts they touch, sum_e 1 - (1 - p_e)^N, and the blocks of
    M rows the grouped GEMM runs, sum_e E[ceil(X_e / M)], X_e ~ Binomial(N, p_e) (choices
    taken as independent between experts, as the uniform U(N) takes them). Skewed routing
    touches fewer experts than uniform and piles more rows, so more blocks, on the popular
    ones."""
    out = []
    for row in routing:
        touched = blocks = 0.0
        for p in row:
            if p > 0.0:
                q = min(1.0, math.exp(round(math.log(p) * _GRID) / _GRID))
                t, b = _routed_one(q, tokens, block)
                touched, blocks = touched + t, blocks + b
        out.append((touched, blocks))
    return tuple(out)


def grouped_gemm(
    name: str, k_in: float, k_out: float, experts: float, blocks: float, rows: float,
    wbytes: float, int4: bool,
) -> Kernel:  # fmt: skip
    """A grouped MoE GEMM of `rows` (token, expert) rows: `experts` experts' [k_in -> k_out]
    weights read from memory, `blocks` of them taken in by the SMs; INT4 at no more than
    INT4_GEMV_MAX_ROWS rows, one GEMV a row, whose SMs take in one expert's weights a row."""
    weights, acts = k_in * k_out * wbytes, rows * (k_in + k_out) * ACT_BYTES
    gemv = int4 and rows <= INT4_GEMV_MAX_ROWS
    return Kernel(name, experts * weights + acts, 2.0 * rows * k_in * k_out, gemm=True,
                  int4=int4, block_bytes=(rows if gemv else blocks) * weights + acts,
                  gemv=gemv)  # fmt: skip


def folded_shared_experts(m: ModelSpec) -> int:
    """Shared experts the engine runs in the routed experts' grouped GEMM, as more experts every
    token chooses (models/deepseek_v3.py: unless the routed experts are INT4, whose shared MLP
    stays a bf16 one of its own)."""
    if weight_format(m.expert_weights or m.weights).bits == 4:
        return 0
    return m.num_shared_experts


def forward_kernels(
    m: ModelSpec, tp: int, seqs: int, tokens_per_seq: int, context: int
) -> tuple[list[Kernel], list[Collective], float]:
    """One target forward's kernels and collectives on one rank, and the experts it touches.
    `context` is each sequence's KV length before this step."""
    n = seqs * tokens_per_seq
    kv_len = context + tokens_per_seq
    w = weight_format(m.weights).bytes_per_element
    we = weight_format(m.expert_weights or m.weights).bytes_per_element
    int4 = weight_format(m.expert_weights or m.weights).bits == 4
    h, act = m.hidden_size, ACT_BYTES
    ks: list[Kernel] = []
    cs: list[Collective] = []
    reduce = Collective("all_reduce", n * h * act)

    def gemm(name: str, k_in: float, k_out: float, wbytes: float = w, rows: int = n) -> Kernel:
        return Kernel(name, k_in * k_out * wbytes + rows * (k_in + k_out) * act,
                      2.0 * rows * k_in * k_out, gemm=True, shape=(rows, k_in, k_out))  # fmt: skip

    def small(name: str, width: float) -> Kernel:  # elementwise: read and write activations
        return Kernel(name, 2 * n * width * act, 4.0 * n * width)

    if tp > 1:  # the step's inputs, from rank 0 (int64 ids, positions, slots, logits rows;
        # int32 query starts, lengths and block tables of 16-token blocks)
        table = -(-kv_len // INPUT_BLOCK)
        cs.append(Collective("broadcast", 32 * n + 4 * (2 * seqs + 1) + 4 * seqs * table))
    ks.append(small("embedding", h))
    if tp > 1:
        cs.append(reduce)
    experts = 0.0
    heads = m.num_heads // tp
    loads = routed_load(m.routing, n) if m.routing else ()  # measured routing's (U, B) a layer
    for layer in range(m.num_layers):
        ks.append(small("input_norm", h))
        if m.mla:
            rope, lora, nope, v = (
                m.qk_rope_head_dim,
                m.kv_lora_rank,
                m.qk_nope_head_dim,
                m.v_head_dim,
            )
            if m.q_lora_rank:  # q_a and kv_a as one replicated GEMM, then q_b split by heads
                ks.append(gemm("qkv_a_proj", h, m.q_lora_rank + lora + rope))
                ks += [small("q_a_norm", m.q_lora_rank), small("kv_a_norm", lora)]
                ks.append(gemm("q_b_proj", m.q_lora_rank, heads * (nope + rope)))
            else:
                ks.append(gemm("kv_a_proj", h, lora + rope))
                ks += [small("kv_a_norm", lora), gemm("q_proj", h, heads * (nope + rope))]
            # Decode-style MLA absorbs kv_b into the query and the output (two batched GEMMs
            # over kv_b_proj's halves) and attends over the cached latent, which every rank
            # holds whole: one (kv_lora_rank + rope) vector per token per layer.
            ks.append(gemm("q_absorb", nope, heads * lora))
            ks.append(small("rotary_kv_write", heads * (nope + rope)))
            latent = seqs * kv_len * (lora + rope) * m.kv_bytes
            attn_flops = 2.0 * n * heads * (2 * lora + rope) * kv_len
            ks.append(Kernel("attention", latent, attn_flops, gemm=True))
            ks.append(gemm("v_absorb", lora, heads * v))
            ks.append(gemm("o_proj", heads * v, h))
        else:
            kv = max(1, m.num_kv_heads // tp)  # KV heads replicate when tp exceeds them
            d = m.head_dim
            ks.append(gemm("qkv_proj", h, (heads + 2 * kv) * d))
            ks += [small("rotary", (heads + kv) * d), small("kv_write", 2 * kv * d)]
            cache = seqs * kv_len * 2 * kv * d * m.kv_bytes
            ks.append(Kernel("attention", cache, 4.0 * n * heads * d * kv_len, gemm=True))
            ks.append(small("attention_merge", heads * d))  # split-K partials -> the output
            ks.append(gemm("o_proj", heads * d, h))
        if tp > 1:
            cs.append(reduce)
        ks.append(small("post_attention_norm", h))
        if m.moe and layer >= m.first_k_dense:
            inter = m.moe_intermediate_size // tp
            if loads:  # measured: this layer's row, or the one row for all
                touched, blocks = loads[min(layer - m.first_k_dense, len(loads) - 1)]
            else:
                touched = unique_experts(m.num_experts, m.experts_per_token, n)
                blocks = expert_blocks(m.num_experts, m.experts_per_token, n)
            experts = max(experts, touched)
            folded = folded_shared_experts(m)  # more experts every token chooses: n rows each
            read = touched + folded
            blocks += folded * -(-n // MOE_BLOCK_M)
            routed = n * (m.experts_per_token + folded)  # token-expert pairs
            ks.append(gemm("router", h, m.num_experts, 2))  # the gate stays bf16
            ks += [small("topk", m.num_experts), small("moe_align", m.experts_per_token)]
            ks.append(grouped_gemm("experts_gate_up", h, 2 * inter, read, blocks, routed, we, int4))
            ks.append(Kernel("experts_act", 2 * routed * 2 * inter * act, 4.0 * routed * inter))
            ks.append(grouped_gemm("experts_down", inter, h, read, blocks, routed, we, int4))
            if m.num_shared_experts and not folded:
                shared = m.num_shared_experts * inter
                ks += [gemm("shared_gate_up", h, 2 * shared), small("shared_act", 2 * shared)]
                ks.append(gemm("shared_down", shared, h))
            ks.append(small("moe_combine", h * (m.experts_per_token + folded)))
        else:
            inter = m.intermediate_size // tp
            ks += [gemm("gate_up_proj", h, 2 * inter), small("act", 2 * inter)]
            ks.append(gemm("down_proj", inter, h))
        if tp > 1:
            cs.append(reduce)
    ks.append(small("final_norm", h))
    vocab = -(-m.vocab_size // tp)
    ks.append(gemm("lm_head", h, vocab, max(w, 2)))  # bf16 under quantized weights; fp32 on CPUs
    if tp > 1:
        cs.append(Collective("all_gather", n * m.vocab_size * act))
    return ks, cs, experts


def time_step(
    kind: str,
    kernels: list[Kernel],
    collectives: list[Collective],
    setup: Setup,
    graphed: bool,
    tokens: int,
    experts: float = 0.0,
) -> StepCost:
    gpu, link = setup.gpu, setup.link
    mem_bytes_per_us = gpu.mem_gbs * 1e3 * gpu.mem_efficiency
    block_bytes_per_us = gpu.sms * gpu.moe_block_gbs_per_sm * 1e3
    int4_bytes_per_us = gpu.sms * gpu.int4_unpack_gbs_per_sm * 1e3
    gemv_bytes_per_us = gpu.sms * gpu.int4_gemv_gbs_per_sm * 1e3
    compute_flops_per_us = gpu.bf16_tflops * 1e6 * gpu.compute_efficiency
    compute = memory = launch = 0.0
    for k in kernels:
        t_mem = k.bytes / mem_bytes_per_us
        if k.block_bytes and gpu.sms:  # the SMs take in every block's weights
            rate = block_bytes_per_us
            if k.int4:
                rate = gemv_bytes_per_us if k.gemv else int4_bytes_per_us
            t_mem = max(t_mem, k.block_bytes / rate)
        if k.shape is not None and gpu.gemv_rows:
            t_mem *= k.shape[0] if k.shape[0] < gpu.gemv_rows else gpu.gemm_weight_reads
        t_cmp = padded_flops(k, gpu.sms) / compute_flops_per_us
        if t_cmp > t_mem:
            compute += t_cmp
        else:
            memory += t_mem
        launch += gpu.gemm_overhead_us if k.gemm else gpu.kernel_overhead_us
    comm = 0.0
    counts: dict[str, int] = {}
    moved: dict[str, float] = {}
    for c in collectives:
        if c.kind == "all_reduce":
            comm += link.all_reduce_us(c.bytes, setup.tp, setup.algo)
        elif c.kind == "broadcast":
            comm += link.all_gather_us(c.bytes * setup.tp / (setup.tp - 1), setup.tp)
        else:
            comm += link.all_gather_us(c.bytes, setup.tp)
        counts[c.kind] = counts.get(c.kind, 0) + 1
        moved[c.kind] = moved.get(c.kind, 0.0) + c.bytes
    if not graphed:
        host = (len(kernels) + len(collectives)) * gpu.eager_host_us
        if gpu.is_cpu:  # the cores that dispatch a kernel then run it: nothing overlaps
            launch += host
        else:
            launch += max(0.0, host - (compute + memory + launch + comm))
    return StepCost(
        kind=kind,
        tokens=tokens,
        bytes=sum(k.bytes for k in kernels),
        flops=sum(k.flops for k in kernels),
        launches=len(kernels) + len(collectives),
        collectives=counts,
        collective_bytes=moved,
        compute_ms=compute / 1e3,
        memory_ms=memory / 1e3,
        comm_ms=comm / 1e3,
        launch_ms=launch / 1e3,
        experts_touched=experts,
    )


def forward_cost(
    setup: Setup, kind: str, seqs: int, tokens_per_seq: int, context: int, graphed: bool
) -> StepCost:
    kernels, collectives, experts = forward_kernels(
        setup.model, setup.tp, seqs, tokens_per_seq, context
    )
    return time_step(kind, kernels, collectives, setup, graphed, seqs * tokens_per_seq, experts)


def step_host(setup: Setup, kind: str, rows: int, tokens: int) -> StepCost:
    """The host's own work once per engine step of `rows` sequences and `tokens` tokens
    (gpu.step_host_us, row_host_us and token_host_us): a step of no kernels."""
    gpu = setup.gpu
    host_us = gpu.step_host_us + gpu.row_host_us * rows + gpu.token_host_us * tokens
    return dataclasses.replace(time_step(kind, [], [], setup, True, 0), host_ms=host_us / 1e3)


def decode_cost(setup: Setup, batch: int, context: int) -> StepCost:
    """A plain decode step: one token per sequence, and the step's host work."""
    return forward_cost(setup, "decode", batch, 1, context, setup.graphs) + step_host(
        setup, "decode", batch, batch
    )


def verify_cost(setup: Setup, batch: int, tokens_per_seq: int, context: int) -> StepCost:
    """The target's verify forward over 1 + k chain tokens or 1 + N tree nodes per sequence,
    plus acceptance (argmax, compare, the accepted run: three small kernels) and the step's host
    work (once for the speculative step: the drafter's forwards run in the same step)."""
    step = forward_cost(setup, "verify", batch, tokens_per_seq, context, setup.verify_graphs)
    accept = accept_kernels(batch, tokens_per_seq)
    return (
        step
        + time_step("verify", accept, [], setup, setup.verify_graphs, 0)
        + step_host(setup, "verify", batch, batch * tokens_per_seq)
    )


def accept_kernels(batch: int, tokens_per_seq: int) -> list[Kernel]:
    """Acceptance after a verify forward: argmax, compare, the accepted run."""
    return [Kernel("accept", 2 * batch * tokens_per_seq * 4, 0.0)] * 3


def layer_allreduces(model: ModelSpec) -> int:
    """All-reduces the transformer layers issue per forward at tp > 1 (two per layer)."""
    return 2 * model.num_layers
