"""Speculation's side of the plan: what drafting costs, what a speculative step must yield to
pay, and which k or tree pays best at each batch size.

A speculative step verifies drafts and drafts the next ones; it pays when the tokens it emits
(its accept length L: accepted drafts plus the target's own token) outrun the plain steps the
same time would have run:

    speedup(L)        = L * decode_ms / (verify_ms + draft_ms)
    break-even L      = (verify_ms + draft_ms) / decode_ms
    E(k) for a chain  = 1 + sum_{i=1..k} prod_{j<=i} a_j        (a_j: acceptance at position j)

E(k) is the adaptive controller's model (outrider/speculative/controller.py, shared code). A
tree with w_d candidates at depth d reaches depth d when any candidate matches. Siblings are not
independent tries (a drafter whose first choice is wrong is often wrong about the rest), so the
j-th candidate is taken to match with probability a_d / j given the ones before missed:

    P(depth d | depth d-1) = 1 - prod_{j=1..w_d} (1 - a_d / j)

a heuristic: at a = 0.75 four candidates cover 0.90 (independent tries would claim 0.996),
about what EAGLE-style drafters report for top-4 against top-1.

Drafting (EAGLE-3): after each verify the drafter extends over the verify's rows (the catch-up:
1 + k rows per sequence for a chain, the accepted path's 1 + S rows for a tree, its fc layer
fusing the target's three captured hidden states), then runs k - 1 chain steps of one token
(a tree: S - 1 frontier steps of topk tokens). The drafter is one Llama decoder layer at the
target's width (its qkv reads [embedding, hidden]: 2h inputs) with a reduced vocabulary;
n-gram drafting is a host lookup and costs no device time here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outrider.plan.costmodel import (
    Kernel,
    Setup,
    StepCost,
    decode_cost,
    folded_shared_experts,
    forward_kernels,
    layer_allreduces,
    time_step,
    verify_cost,
)
from outrider.plan.models import ModelSpec, weight_format
from outrider.speculative.controller import expected_tokens

METHODS = ("eagle3", "ngram")


@dataclass(frozen=True)
class Tree:
    """A draft tree budget: num_nodes drafts verified, topk candidates per depth, num_steps
    depths (the shape of speculative.tree_batch.TreeShape)."""

    num_nodes: int
    topk: int
    num_steps: int

    def __post_init__(self) -> None:
        if min(self.num_nodes, self.topk, self.num_steps) < 1:
            raise ValueError(f"a tree needs num_nodes, topk and num_steps >= 1, got {self}")
        if not self.num_steps <= self.num_nodes <= self.topk * self.num_steps:
            raise ValueError(
                f"tree {self.label}: num_nodes must lie in num_steps..topk*num_steps "
                f"({self.num_steps}..{self.topk * self.num_steps})"
            )

    @property
    def label(self) -> str:
        return f"tree{self.num_nodes}x{self.topk}x{self.num_steps}"

    def widths(self) -> list[int]:
        """Nodes per depth, front-loaded as a best-first tree grows: up to topk at each depth
        while one node is left for every deeper one."""
        out, left = [], self.num_nodes
        for d in range(self.num_steps):
            w = min(self.topk, left - (self.num_steps - d - 1))
            out.append(w)
            left -= w
        return out

    @classmethod
    def parse(cls, text: str) -> Tree:
        try:
            n, t, s = (int(x) for x in text.replace("x", ",").split(","))
        except ValueError:
            raise ValueError(f"invalid tree {text!r}: use NODES,TOPK,STEPS, e.g. 16,4,5") from None
        return cls(n, t, s)


@dataclass(frozen=True)
class Drafter:
    """The draft network: `layers` Llama layers at the target's width; None fields follow the
    target (intermediate size, tensor-parallel size)."""

    method: str = "eagle3"
    layers: int = 1
    intermediate_size: int | None = None
    vocab_size: int = 32000  # EAGLE-3's usual draft vocabulary
    tp: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}: use one of {', '.join(METHODS)}")


def tree_expected_tokens(acceptance: list[float], tree: Tree) -> float:
    """1 + sum_d prod_{i<=d} P(depth i | depth i - 1)."""
    total, p = 1.0, 1.0
    for a, w in zip(_curve(acceptance, tree.num_steps), tree.widths()):
        p *= 1.0 - depth_miss(a, w)
        total += p
    return total


def depth_miss(a: float, width: int) -> float:
    """prod_{j=1..w} (1 - a / j): no candidate of `width` matches."""
    miss = 1.0
    for j in range(1, width + 1):
        miss *= 1.0 - a / j
    return miss


def _curve(acceptance: list[float], n: int) -> list[float]:
    """Per-position acceptance for positions 1..n; the last value repeats."""
    if not acceptance or not all(0.0 <= a <= 1.0 for a in acceptance):
        raise ValueError(f"acceptance rates must lie in [0, 1], got {acceptance}")
    return [acceptance[min(i, len(acceptance) - 1)] for i in range(n)]


def drafter_model(target: ModelSpec, d: Drafter) -> ModelSpec:
    """The drafter as a Llama-shaped ModelSpec: the target's heads, and for an MLA target
    multi-head attention over v_head_dim-wide heads, as the drafter outrider builds
    (DeepseekV3Config.eagle3_draft_layer)."""
    h = target.hidden_size
    return ModelSpec(
        name=f"{target.name}-eagle3",
        hidden_size=h,
        num_layers=d.layers,
        num_heads=target.num_heads,
        num_kv_heads=target.num_heads if target.mla else target.num_kv_heads,
        head_dim=target.v_head_dim if target.mla else target.head_dim,
        intermediate_size=d.intermediate_size or target.intermediate_size,
        vocab_size=d.vocab_size,
    )


def draft_cost(setup: Setup, drafter: Drafter, batch: int, context: int, spec: int | Tree):
    """One speculative step's drafting: catch-up plus chain (or frontier) steps."""
    if drafter.method == "ngram":
        return time_step("draft", [], [], setup, True, 0)
    tp = drafter.tp or setup.tp
    m = drafter_model(setup.model, drafter)
    dsetup = Setup(m, setup.gpu, setup.link, tp, setup.graphs, setup.verify_graphs, setup.algo)
    rows, steps, width = (1 + spec, spec - 1, 1) if isinstance(spec, int) else (
        1 + spec.num_steps, spec.num_steps - 1, spec.topk)  # fmt: skip
    w = weight_format(m.weights).bytes_per_element
    h = m.hidden_size
    qkv_in = h * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim // tp * w

    def forward(tokens: int, ctx: int, catch_up: bool) -> StepCost:
        ks, cs, _ = forward_kernels(m, tp, batch, tokens, ctx)
        n = batch * tokens
        ks.append(Kernel("qkv_second_input", qkv_in, 2.0 * qkv_in / w * n))
        if catch_up:  # fc: [3h] captured hidden states -> h
            ks.append(Kernel("fc", 3 * h * h * w, 2.0 * n * 3 * h * h))
        ks.append(Kernel("draft_topk", 2 * n * 4 * width, 0.0))
        return time_step("draft", ks, cs, setup=dsetup, graphed=setup.verify_graphs, tokens=n)

    cost = forward(rows, context, True)
    for i in range(steps):
        cost = cost + forward(width, context + rows + i * width, False)
    return cost


@dataclass(frozen=True)
class Option:
    """One way to speculate at one batch size, priced."""

    label: str
    k: int  # drafts verified (a tree's node count)
    verify: StepCost
    draft: StepCost
    expected_tokens: float
    decode_ms: float

    @property
    def spec_ms(self) -> float:
        return self.verify.ms + self.draft.ms

    @property
    def break_even(self) -> float:
        return self.spec_ms / self.decode_ms

    @property
    def speedup(self) -> float:
        return self.expected_tokens * self.decode_ms / self.spec_ms


@dataclass(frozen=True)
class BatchPlan:
    batch: int
    decode: StepCost
    chains: list[Option]
    trees: list[Option] = field(default_factory=list)

    @property
    def best(self) -> Option | None:
        """The option with the highest speedup, or None where none beats plain decode."""
        top = max(self.chains + self.trees, key=lambda o: o.speedup, default=None)
        return top if top is not None and top.speedup > 1.0 else None


def plan_batch(
    setup: Setup,
    drafter: Drafter,
    batch: int,
    context: int,
    acceptance: list[float],
    max_k: int = 8,
    trees: tuple[Tree, ...] = (),
) -> BatchPlan:
    decode = decode_cost(setup, batch, context)
    curve = _curve(acceptance, max(max_k, *(t.num_steps for t in trees), 1))
    chains = [
        Option(
            f"k={k}",
            k,
            verify_cost(setup, batch, 1 + k, context),
            draft_cost(setup, drafter, batch, context, k),
            expected_tokens(curve, k),
            decode.ms,
        )
        for k in range(1, max_k + 1)
    ]
    tree_opts = [
        Option(
            t.label,
            t.num_nodes,
            verify_cost(setup, batch, 1 + t.num_nodes, context),
            draft_cost(setup, drafter, batch, context, t),
            tree_expected_tokens(curve, t),
            decode.ms,
        )
        for t in trees
    ]
    return BatchPlan(batch, decode, chains, tree_opts)


def weights_per_gpu_gb(setup: Setup) -> float:
    """Weight bytes one rank holds (every expert, the embedding and LM head), in GB."""
    m, tp = setup.model, setup.tp
    we = weight_format(m.expert_weights or m.weights).bytes_per_element
    ks, _, _ = forward_kernels(m, tp, 1, 1, 0)
    dense = sum(k.bytes for k in ks if not k.name.startswith("experts_"))
    stacked = m.num_experts + folded_shared_experts(m)  # the shared experts held among them
    routed = m.num_moe_layers * stacked * 3 * m.hidden_size * m.moe_intermediate_size
    embed = m.vocab_size * m.hidden_size * 2 / tp * (0 if m.tie_word_embeddings else 1)
    return (dense + routed / tp * we + embed) / 1e9


__all__ = [
    "BatchPlan",
    "Drafter",
    "Option",
    "Tree",
    "draft_cost",
    "layer_allreduces",
    "plan_batch",
    "tree_expected_tokens",
    "weights_per_gpu_gb",
]
