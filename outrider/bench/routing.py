"""`outrider bench routing MODEL`: how an MoE model routes text, counted per layer and routed
expert, for the planner to price its steps with (`outrider plan MODEL --routing FILE`).

Uniform routing, which the planner assumes otherwise, is an upper estimate of the experts a
step of N tokens touches: real routers favour some experts, so a batch touches fewer and piles
more rows on the popular ones. The engine runs the model eagerly over a prompt set, generating
as it would serve, and every router's choices (its top-k; experts every token takes, such as
shared ones run among the routed, left out) are counted as they are made, prompt and output
tokens alike."""

from __future__ import annotations

import torch

from outrider.layers.moe import GroupedTopkRouter


def measure_routing(llm, prompts: list[str], max_tokens: int) -> dict:
    """Generate `max_tokens` greedily after each of `prompts` through `llm` (an LLM built
    with enforce_eager: a graph replay runs no hooks) and count each MoE layer's choices.
    -> {"experts_per_token", "tokens", "layers": [[count per routed expert] per MoE layer]}."""
    from outrider import SamplingParams

    model = llm.engine.runner.model
    routers = [m for m in model.modules() if isinstance(m, GroupedTopkRouter)]
    if not routers:
        raise ValueError(
            f"{llm.config.model.model or 'the default model'} has no routed experts: "
            "`outrider bench routing` measures an MoE model's routing"
        )
    # On each router's device, read once at the end (no sync a layer and step).
    counts = [
        torch.zeros(r.num_experts, dtype=torch.int64, device=r.weight.device) for r in routers
    ]

    def counter(i: int):
        def count(router: GroupedTopkRouter, args, out) -> None:
            ids = out[1][:, : router.top_k].reshape(-1)
            counts[i] += torch.bincount(ids, minlength=router.num_experts)[: router.num_experts]

        return count

    hooks = [r.register_forward_hook(counter(i)) for i, r in enumerate(routers)]
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params)
    finally:
        for h in hooks:
            h.remove()
    top_k = routers[0].top_k
    return {
        "experts_per_token": top_k,
        "tokens": int(counts[0].sum()) // top_k,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "layers": [c.tolist() for c in counts],
    }


def summary(result: dict) -> str:
    """A line a layer: how concentrated its routing is (the busiest expert's share of the
    choices against uniform's, and the experts that take half the choices)."""
    lines = [f"{result['tokens']} tokens, {result['experts_per_token']} experts a token"]
    for i, row in enumerate(result["layers"]):
        total = sum(row) or 1
        shares = sorted((c / total for c in row), reverse=True)
        half, acc = 0, 0.0
        while acc < 0.5 and half < len(shares):
            acc += shares[half]
            half += 1
        lines.append(
            f"MoE layer {i}: busiest expert {shares[0] * len(row):.1f}x uniform, half the "
            f"choices on {half} of {len(row)} experts"
        )
    return "\n".join(lines)
