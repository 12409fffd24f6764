"""The plan as people and programs read it: one JSON object, a text table, and a PNG of
predicted speedup against accept length (matplotlib, imported only to draw)."""

from __future__ import annotations

from pathlib import Path

from outrider.plan.costmodel import Setup, StepCost, layer_allreduces
from outrider.plan.planner import BatchPlan, Drafter, Option, weights_per_gpu_gb


def _option(o: Option) -> dict:
    return {
        "label": o.label,
        "drafts": o.k,
        "verify_ms": round(o.verify.ms, 4),
        "draft_ms": round(o.draft.ms, 4),
        "break_even_accept_len": round(o.break_even, 4),
        "expected_accept_len": round(o.expected_tokens, 4),
        "speedup": round(o.speedup, 4),
    }


def _best(p: BatchPlan) -> dict:
    b = p.best
    if b is None:
        return {"method": "off", "k": 0, "speedup": 1.0}
    return {"method": b.label, "k": b.k, "speedup": round(b.speedup, 4)}


def _chain(p: BatchPlan, k: int) -> Option:
    return p.chains[min(k, len(p.chains)) - 1]


def to_json(
    setup: Setup, drafter: Drafter, plans: list[BatchPlan], k: int, context: int, acceptance
) -> dict:
    """Headline fields at the first batch size and k (`decode_ms`, `verify_ms`, `draft_ms`,
    `comm_ms` by step kind, `break_even_accept_len`), `best` per batch size, and every
    option's figures under `batches`."""
    first = plans[0]
    chosen = _chain(first, k)
    decode = first.decode
    return {
        "model": setup.model.name,
        "gpu": setup.gpu.name,
        "link": setup.link.name,
        "tp": setup.tp,
        "context": context,
        "method": drafter.method,
        "k": chosen.k,
        "acceptance": list(acceptance),
        "weights_gb_per_gpu": round(weights_per_gpu_gb(setup), 2),
        "fits": weights_per_gpu_gb(setup) < setup.gpu.memory_gb,
        "allreduces_per_forward": layer_allreduces(setup.model) if setup.tp > 1 else 0,
        "collectives_per_forward": decode.collectives,
        "decode_ms": round(decode.ms, 4),
        "verify_ms": round(chosen.verify.ms, 4),
        "draft_ms": round(chosen.draft.ms, 4),
        "comm_ms": {
            "decode": round(decode.comm_ms, 4),
            "verify": round(chosen.verify.comm_ms, 4),
            "draft": round(chosen.draft.comm_ms, 4),
        },
        "break_even_accept_len": round(chosen.break_even, 4),
        "best": {str(p.batch): _best(p) for p in plans},
        "batches": {
            str(p.batch): {
                "decode": p.decode.as_dict(),
                "verify": _chain(p, k).verify.as_dict(),
                "draft": _chain(p, k).draft.as_dict(),
                "options": [_option(o) for o in p.chains + p.trees],
            }
            for p in plans
        },
    }


def _row(name: str, c: StepCost) -> str:
    coll = sum(c.collectives.values())
    return (
        f"  {name:<14}{c.tokens:>7}{c.ms:>9.3f}{c.compute_ms:>9.3f}{c.memory_ms:>9.3f}"
        f"{c.comm_ms:>9.3f}{c.launch_ms:>9.3f}{c.host_ms:>9.3f}{c.bytes / 1e9:>9.3f}"
        f"{c.flops / 1e12:>9.3f}"
        f"{c.launches:>7}{coll:>6}"
    )


def machine(setup: Setup) -> str:
    """What the plan is for: "cpu (16 threads)", "1 x H200", "8 x H200, link nvlink4 (...)".
    The link only where there are ranks to link: one device sends nothing over it."""
    if setup.gpu.is_cpu and setup.tp == 1:
        return setup.gpu.name
    text = f"{setup.tp} x {setup.gpu.name}"
    if setup.tp > 1:
        text += f", link {setup.link.name}"
        text += f" ({setup.link.channels} NCCL channels)" if setup.link.per_channel else ""
    return text


def _gb(x: float) -> str:
    return f"{x:.2f} GB" if x < 1 else f"{x:.1f}".removesuffix(".0") + " GB"


def table(setup: Setup, drafter: Drafter, plans: list[BatchPlan], k: int, context: int) -> str:
    m = setup.model
    gb = weights_per_gpu_gb(setup)
    memory = _gb(setup.gpu.memory_gb)
    held = f"of {memory} memory" if setup.gpu.is_cpu else f"per GPU of {memory}"
    lines = [
        f"{m.name} on {machine(setup)}, context {context}, {drafter.method}",
        f"weights {m.weights}"
        + (f", routed experts {m.expert_weights}" if m.moe and m.expert_weights else "")
        + f": {_gb(gb)} {held}"
        + ("" if gb < setup.gpu.memory_gb else "  (does not fit: raise --tp)"),
        f"all-reduces per forward: {layer_allreduces(m) if setup.tp > 1 else 0} in the layers"
        + (" + 1 embedding all-reduce + 1 LM-head all-gather" if setup.tp > 1 else ""),
    ]
    head = (
        f"  {'step':<14}{'tokens':>7}{'ms':>9}{'compute':>9}{'memory':>9}{'comm':>9}"
        f"{'launch':>9}{'host':>9}{'GB read':>9}{'TFLOP':>9}{'kern':>7}{'coll':>6}"
    )
    for p in plans:
        o = _chain(p, k)
        lines += ["", f"batch {p.batch}" + (
            f"  (experts touched per MoE layer: decode {p.decode.experts_touched:.1f}, "
            f"verify {o.verify.experts_touched:.1f} of {m.num_experts})" if m.moe else ""), head]  # fmt: skip
        lines.append(_row("decode", p.decode))
        lines.append(_row(f"verify 1+{o.k}", o.verify))
        lines.append(_row(f"draft k={o.k}", o.draft))
        lines.append(f"  {'option':<14}{'verify':>9}{'draft':>9}{'break-even':>12}{'E[L]':>8}"
                     f"{'speedup':>9}")  # fmt: skip
        for opt in p.chains + p.trees:
            lines.append(
                f"  {opt.label:<14}{opt.verify.ms:>9.3f}{opt.draft.ms:>9.3f}"
                f"{opt.break_even:>12.2f}{opt.expected_tokens:>8.2f}{opt.speedup:>9.2f}"
            )
        best = p.best
        lines.append(
            f"  best: {best.label} ({best.speedup:.2f}x)" if best else "  best: off (plain decode)"
        )
    return "\n".join(lines)


def write_png(path: str | Path, plans: list[BatchPlan], title: str, shown_options: int = 3) -> Path:
    """Speedup against accept length, one panel per batch size (the first four): the best
    `shown_options` options by predicted speedup, the best one bold with a star at its expected
    accept length, and the break-even line at 1 (plain decode). Speedup is linear in L, so ten
    options draw ten near-coincident lines; the table lists every one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = plans[:4]
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4.5), squeeze=False)
    for ax, p in zip(axes[0], shown):
        options = sorted(p.chains + p.trees, key=lambda o: -o.speedup)
        top_y = 1.0
        for rank, o in enumerate(options[:shown_options]):
            top = o.k + 1 if o in p.chains else _depth(o) + 1
            xs = [1.0, float(top)]
            ys = [x * p.decode.ms / o.spec_ms for x in xs]
            top_y = max(top_y, *ys)
            best = rank == 0 and o is p.best
            label = (
                ("best " if best else "")
                + f"{o.label}: {o.speedup:.2f}x at L={o.expected_tokens:.2f} "
                + f"(b/e {o.break_even:.2f})"
            )
            style = "-" if o in p.chains else "--"
            (line,) = ax.plot(xs, ys, style, linewidth=2.5 if best else 1.2, label=label)
            ax.plot([o.expected_tokens], [o.speedup], "*" if best else "o",
                    markersize=14 if best else 6, color=line.get_color())  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=1, label="plain decode (break-even)")
        if len(options) > shown_options:
            hidden = len(options) - shown_options
            ax.plot([], [], " ", label=f"{hidden} slower options: see the table")
        ax.set_xlabel("accept length (tokens per step)")
        ax.set_ylabel("speedup over plain decode")
        verdict = (
            f"best {p.best.label}, {p.best.speedup:.2f}x"
            if p.best
            else "plain decode: no option pays"
        )
        ax.set_title(f"batch {p.batch}: {verdict}")
        # The top third is left to the legend: a steep short line (k=1) ends up there, under it.
        ax.set_ylim(0, top_y * 1.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _depth(o: Option) -> int:
    """A tree option's depth, from its label (treeNxTxS)."""
    return int(o.label.rsplit("x", 1)[1])
