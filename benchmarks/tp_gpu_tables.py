"""The tables benchmarks/tp_gpu.py prints, one per part, from the part's JSON."""

from __future__ import annotations


def print_equality(part: dict) -> None:
    print(f"{'case':<42} {'equal':>6} {'verifies':>8} {'AR/fwd':>7} {'AG/fwd':>7}")
    for c in part["cases"]:
        pf = c["per_forward"].get("verify") or c["per_forward"].get("decode") or {}
        ar, ag = (pf.get(op, {}).get("calls", "-") for op in ("all_reduce", "all_gather"))
        print(f"{c['case']:<42} {str(c.get('equal', 'ref')):>6} {c['verify_steps']:>8} "
              f"{ar:>7} {ag:>7}")  # fmt: skip


def print_timings(part: dict) -> None:
    for name, s in part["by_setting"].items():
        if "points" not in s:
            print(f"{name}: {s.get('error') or s.get('skipped')}")
            continue
        print(f"{name} ({s['device_name']}, {'CUDA graphs' if s['cuda_graphs'] else 'eager'}, "
              f"env {s['env'] or 'as is'})")  # fmt: skip
        labels = list(s["points"][0].get("predicted", {}))
        head = "".join(f" {lb[:12]:>12} {'err':>6}" for lb in labels)
        print(f"{'C':>4} {'k':>3} {'ms':>9}{head} {'AR/fwd':>7} {'plan':>5} {'AR KB/fwd':>9}")
        for p in s["points"]:
            pred = "".join(
                f" {p['predicted'][lb]['ms']:>12.3f} {p['predicted'][lb]['error']:>+6.0%}"
                for lb in labels
            )
            ar = (p["collectives"] or {}).get("all_reduce", {})
            plan = p.get("planner_collectives", {}).get("calls", {}).get("all_reduce", 0)
            kb = ar.get("bytes", 0) / 1e3
            print(f"{p['batch']:>4} {p['k']:>3} {p['measured_ms']:>9.3f}{pred} "
                  f"{ar.get('calls', 0):>7} {plan:>5} {kb:>9.1f}")  # fmt: skip


def print_synthetic(part: dict) -> None:
    print(f"tp {part['tensor_parallel_size']} over {part['planner_link']} (planner), "
          f"graphs {part['graphs']}")  # fmt: skip
    print(f"{'curve':<12} {'C':>3} {'L':>6} {'speedup':>8} {'pred@L':>7} {'ratio':>6} "
          f"{'BE meas':>8} {'BE plan':>8} {'lossless':>8}")  # fmt: skip
    for r in part["rows"]:
        curve = "/".join(map(str, r["curve"]))
        print(f"{curve:<12} {r['concurrency']:>3} {r['accept_length']:>6.2f} {r['speedup']:>8.3f} "
              f"{r['predicted_speedup_at_measured']:>7.3f} {r['ratio']:>6.2f} "
              f"{r['measured_break_even']:>8.2f} "
              f"{r['predicted_ms']['break_even_accept_len']:>8.2f} "
              f"{str(r['lossless']):>8}")  # fmt: skip


def print_comm(part: dict) -> None:
    from outrider.bench.comm import summary

    print(summary(part))


def print_draft(part: dict) -> None:
    for name, s in part["by_setting"].items():
        if "points" not in s:
            print(f"{name}: {s.get('error') or s.get('skipped')}")
    print(f"tp {part['settings']['tp']}: the chain step with the drafter on rank 0 and split")
    print(f"{'C':>4} {'k':>3} {'rank 0 ms':>10} {'split ms':>9} {'ratio':>6}")
    for r in part["side_by_side"]:
        print(f"{r['batch']:>4} {r['k']:>3} {r['rank0_ms']:>10.3f} {r['split_ms']:>9.3f} "
              f"{r['split_over_rank0']:>6.2f}")  # fmt: skip


TABLES = {
    "equality": print_equality,
    "timings": print_timings,
    "synthetic": print_synthetic,
    "comm": print_comm,
    "draft": print_draft,
}
