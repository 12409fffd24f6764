"""`outrider bench serve | plot | comm | routing`: load an OpenAI-compatible server over a
concurrency sweep and chart the results; time the collectives of tensor parallelism; count an
MoE model's routing for the planner. Flag defaults come from BenchConfig (bench/serve.py) and
CommConfig (bench/comm.py); each subcommand's flags are added only when it is chosen
(flags.Commands), and httpx, tqdm, matplotlib and torch are imported only when a command
runs."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from outrider.flags import Commands, add_command


def add_bench_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` to the top-level commands (its subcommands when it is chosen)."""
    return add_command(
        commands,
        "bench",
        _add_bench_commands,
        help="benchmark a server (a load sweep over concurrency, and charts) or the collectives",
        description="Benchmark any OpenAI-compatible server (outrider, vLLM, SGLang): `serve` "
        "sweeps concurrency and writes JSON and PNGs; `plot` redraws and overlays results; "
        "`comm` times all-reduce and all-gather at decode and verify sizes.",
    )


def _add_bench_commands(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(
        dest="bench_command", metavar="SUBCOMMAND", required=True, action=Commands
    )
    add_command(
        sub,
        "serve",
        _add_serve_flags,
        help="load a server at each concurrency; TTFT, TPOT, ITL, throughput, accept length",
        description="Stream requests to --base-url at each --max-concurrency (one sweep point "
        "each, bounded by --num-prompts and --time-limit) and write one JSON result (keys as "
        "`vllm bench serve` names them, one entry per point under `points`) plus PNG charts. "
        "Accept length comes from the server's speculative counters on /metrics (outrider, "
        "vLLM); null where it has none.",
    )
    add_command(
        sub,
        "plot",
        _add_plot_flags,
        help="draw PNG charts from result files, overlaid by label",
        description="Throughput, TPOT, TTFT and accept length against concurrency, and "
        "per-user speed against total throughput, one line per run in one colour across the "
        "charts (vLLM's --save-result files sharing a label join one line).",
    )
    add_command(
        sub,
        "comm",
        _add_comm_flags,
        help="all-reduce and all-gather latency and bandwidth at decode and verify sizes",
        description="Start --world-size ranks on this machine (NCCL on GPUs, gloo on the CPU) "
        "and time the engine's all-reduce (hidden x B(1+k) x dtype bytes) and all-gather "
        "(vocab x B(1+k) x dtype bytes) for each batch size and k, under each NCCL setting "
        "candidate in its own processes (protocol, algorithm, channels, P2P). Writes the full "
        "result, the best candidate's figures for `outrider plan --link FILE`, and its settings "
        "as an env file for `outrider deploy systemd --env-file FILE`.",
    )
    add_command(
        sub,
        "routing",
        _add_routing_flags,
        help="count an MoE model's routing per layer and expert, for `outrider plan --routing`",
        description="Run an MoE model (eagerly, greedy, ignoring EOS) over the built-in prompts "
        "and count every router's choices per layer and routed expert. The JSON it writes is "
        "what `outrider plan MODEL --routing FILE` prices experts touched and grouped-GEMM "
        "blocks from, where it otherwise takes routing to be uniform (an upper estimate).",
    )


def _add_routing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an MoE checkpoint (HF directory or .gguf)")
    p.add_argument(
        "--num-prompts", type=int, default=64,
        help="prompts run through the model, the set cycled if smaller (default: 64)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=128, help="tokens generated a prompt (default: 128)"
    )
    p.add_argument(
        "--dataset", choices=("builtin", "grounded"), default="builtin",
        help="the built-in chat prompts, or its tasks on a given text (default: builtin)",
    )  # fmt: skip
    p.add_argument("--out", default="routing.json", help="where the counts go")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over"
    )


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    from outrider.bench.serve import DATASETS, ENDPOINTS, BenchConfig

    d = {f.name: f.default for f in dataclasses.fields(BenchConfig)}
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url", required=True,
        help="the server's root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)",
    )  # fmt: skip
    g.add_argument(
        "--model",
        default=None,
        help="the model id sent in each request (default: /v1/models' first)",
    )
    g.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)"
    )
    g.add_argument(
        "--endpoint", choices=tuple(ENDPOINTS), default=d["endpoint"],
        help="the API to load: completions (/v1/completions) or chat (/v1/chat/completions)",
    )  # fmt: skip
    g = p.add_argument_group("load")
    g.add_argument(
        "--max-concurrency", type=int, nargs="+", metavar="N",
        default=list(d["max_concurrency"]),
        help="requests in flight at most; one sweep point per value (default: "
        f"{' '.join(map(str, d['max_concurrency']))})",
    )  # fmt: skip
    g.add_argument(
        "--request-rate", type=float, default=d["request_rate"], metavar="R",
        help="requests/s, Poisson arrivals; inf: all at once (the concurrency bounds them)",
    )  # fmt: skip
    g.add_argument(
        "--num-prompts", type=int, default=d["num_prompts"], help="requests sent per sweep point"
    )
    g.add_argument(
        "--time-limit", type=float, default=d["time_limit_s"], metavar="S",
        help="seconds per sweep point; requests still running then are cancelled",
    )  # fmt: skip
    g.add_argument("--seed", type=int, default=d["seed"], help="prompt order and arrivals")
    g.add_argument(
        "--client-processes", type=int, default=d["client_processes"], metavar="N",
        help="processes sending each point's requests, each a share of the streams, prompts "
        "and rate (default: one per 16 streams, at most half the cores): one process parsing "
        "every stream's chunks becomes the bottleneck at high concurrency",
    )  # fmt: skip
    g = p.add_argument_group("requests")
    g.add_argument(
        "--dataset", nargs="+", default=[d["dataset"]], metavar=("NAME", "PATH"),
        help=f"{', '.join(DATASETS)}: the built-in chat prompts; the built-in tasks on a text "
        f"given in the prompt (rewrite, fix, answer from it); a ShareGPT-style JSON/JSONL file "
        f"(--dataset sharegpt PATH; first user turn of each record); random words (default: "
        f"{d['dataset']})",
    )  # fmt: skip
    g.add_argument(
        "--random-input-len", type=int, default=d["random_input_len"],
        help="--dataset random: words per prompt (about one token each)",
    )  # fmt: skip
    g.add_argument(
        "--random-output-len", type=int, default=d["random_output_len"],
        help="--dataset random: max tokens per request",
    )  # fmt: skip
    g.add_argument("--max-tokens", type=int, default=d["max_tokens"], help="max tokens per request")
    g.add_argument(
        "--temperature", type=float, default=d["temperature"],
        help="the sampling temperature each request asks for (0: greedy)",
    )  # fmt: skip
    g.add_argument(
        "--ignore-eos", action="store_true",
        help="ask the server to generate max tokens whatever the model says (outrider, vLLM)",
    )  # fmt: skip
    g = p.add_argument_group("goodput (requests meeting every SLO given, per second)")
    g.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="time to first token at most (default: no SLO)",
    )
    g.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="time per output token at most (default: no SLO)",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--out-dir", "--result-dir", dest="out_dir", default="bench-results",
        help="where the JSON and PNGs go (--result-dir: vLLM's name)",
    )  # fmt: skip
    g.add_argument(
        "--result-filename", default=None, metavar="NAME",
        help="the JSON's file name in --out-dir (default: serve-LABEL-TIME.json)",
    )  # fmt: skip
    g.add_argument(
        "--save-result", action="store_true",
        help="accepted for `vllm bench serve` command lines: the result is always saved",
    )  # fmt: skip
    g.add_argument("--label", default=None, help="names the run in plots (default: the model)")
    g.add_argument("--no-plot", action="store_true", help="write the JSON only")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _add_plot_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="`bench serve` (or vLLM --save-result) JSON files")
    p.add_argument("--out-dir", default=None, help="where the PNGs go (default: the first file's)")


def _add_comm_flags(p: argparse.ArgumentParser) -> None:
    from outrider.bench.comm import DTYPE_BYTES, NCCL_CANDIDATES, CommConfig

    d = {f.name: f.default for f in dataclasses.fields(CommConfig)}
    g = p.add_argument_group("ranks")
    g.add_argument(
        "--world-size", type=int, default=d["world_size"], metavar="N",
        help="processes started on this machine, one per GPU (on the CPU: gloo ranks)",
    )  # fmt: skip
    g.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default=d["device"],
        help="auto: NCCL when there are N GPUs, else gloo on the CPU",
    )  # fmt: skip
    g = p.add_argument_group("sizes")
    g.add_argument(
        "--model", default=d["model"],
        help="a planner model (built-in name, config.json or directory): its hidden size and "
        "vocabulary set the sizes, its layers weigh the candidates",
    )  # fmt: skip
    g.add_argument(
        "--batch", type=int, nargs="+", default=list(d["batch_sizes"]), metavar="B",
        help="sequences per step, one timing each",
    )  # fmt: skip
    g.add_argument(
        "--k", type=int, nargs="+", default=list(d["ks"]), metavar="K",
        help="drafts verified per sequence (0: decode); a step sends B(1+k) tokens",
    )  # fmt: skip
    g.add_argument(
        "--dtype", choices=tuple(DTYPE_BYTES), default=d["dtype"],
        help="the activations' dtype, which sets the bytes per element sent",
    )  # fmt: skip
    g.add_argument(
        "--sizes", type=int, nargs="+", default=None, metavar="BYTES",
        help="time these sizes instead (all-reduce buffers and all-gather outputs)",
    )  # fmt: skip
    g = p.add_argument_group("timing")
    g.add_argument("--warmup", type=int, default=d["warmup"], help="untimed calls per size")
    g.add_argument("--iters", type=int, default=d["iters"], help="timed calls per run")
    g.add_argument("--trials", type=int, default=d["trials"], help="runs per size (median)")
    g.add_argument(
        "--timeout", type=float, default=d["timeout_s"], metavar="S",
        help="seconds one candidate may take before it is stopped",
    )  # fmt: skip
    g = p.add_argument_group("NCCL candidates (GPUs only; gloo has none)")
    g.add_argument(
        "--candidates", nargs="+", default=None, metavar="NAME",
        help=f"built-in candidates to try, 'default' always among them (default: all: "
        f"{', '.join(NCCL_CANDIDATES)})",
    )  # fmt: skip
    g.add_argument(
        "--candidate", action="append", default=[], metavar="KEY=VALUE,...",
        help="a candidate of your own (repeatable), e.g. NCCL_PROTO=LL,NCCL_MIN_NCHANNELS=8",
    )  # fmt: skip
    g = p.add_argument_group("output")
    g.add_argument(
        "--out-dir", default="bench-results",
        help="where comm.json (every candidate and size) goes",
    )  # fmt: skip
    g.add_argument(
        "--link-out", default=None, metavar="PATH",
        help="the best figures for `outrider plan --link` (default: OUT_DIR/link.json)",
    )  # fmt: skip
    g.add_argument(
        "--env-out", default=None, metavar="PATH",
        help="the best settings as KEY=VALUE lines (default: OUT_DIR/comm.env)",
    )  # fmt: skip


def cmd_bench(args: argparse.Namespace) -> int:
    from outrider.bench.serve import BenchError

    try:
        if args.bench_command == "serve":
            return _serve(args)
        if args.bench_command == "comm":
            return _comm(args)
        if args.bench_command == "routing":
            return _routing(args)
        return _plot(args)
    except BenchError as e:
        print(f"outrider: error: {e}", file=sys.stderr)
        return 1


def _routing(args: argparse.Namespace) -> int:
    import json

    from outrider import LLM
    from outrider.bench.prompts import load_prompts
    from outrider.bench.routing import measure_routing, summary
    from outrider.bench.serve import BenchConfig

    for name in ("num_prompts", "max_tokens"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"invalid {flag} {getattr(args, name)}: use an integer >= 1")
    cfg = BenchConfig(
        base_url="http://127.0.0.1", dataset=args.dataset, num_prompts=args.num_prompts
    )  # (no server: only the prompt set is read)
    prompts = [p.text for p in load_prompts(cfg)]
    llm = LLM(
        args.model, device=args.device, dtype=args.dtype, enforce_eager=True,
        tensor_parallel_size=args.tensor_parallel_size,
    )  # fmt: skip
    try:
        result = measure_routing(llm, prompts, args.max_tokens)
    finally:
        llm.shutdown()
    result = {"model": args.model, "dataset": args.dataset, **result}
    Path(args.out).write_text(json.dumps(result) + "\n")
    print(summary(result))
    print(f"wrote {args.out}: outrider plan {args.model} --routing {args.out}")
    return 0


def _comm(args: argparse.Namespace) -> int:
    from outrider.bench.comm import CommConfig, CommError, bench_comm, summary, write_outputs

    cfg = CommConfig(
        world_size=args.world_size,
        device=args.device,
        model=args.model,
        batch_sizes=tuple(args.batch),
        ks=tuple(args.k),
        dtype=args.dtype,
        sizes=tuple(args.sizes or ()),
        warmup=args.warmup,
        iters=args.iters,
        trials=args.trials,
        candidates=tuple(args.candidates) if args.candidates is not None else None,
        extra_candidates=tuple(args.candidate),
        timeout_s=args.timeout,
    )  # bad values fail here, before a rank starts
    try:
        result = bench_comm(cfg, say=lambda line: print(line, file=sys.stderr))
    except CommError as e:
        print(f"outrider: error: {e}", file=sys.stderr)
        return 1
    print(summary(result))
    link = Path(args.link_out) if args.link_out else None
    env_file = Path(args.env_out) if args.env_out else None
    for path in write_outputs(result, Path(args.out_dir), link, env_file):
        print(f"wrote {path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from outrider.bench.prompts import load_prompts
    from outrider.bench.serve import BenchConfig, run, write_result

    name, *path = args.dataset
    if len(path) > 1:
        raise ValueError(f"--dataset {' '.join(args.dataset)}: give NAME and at most one PATH")
    cfg = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        max_concurrency=tuple(args.max_concurrency),
        request_rate=args.request_rate,
        num_prompts=args.num_prompts,
        dataset=name,
        dataset_path=path[0] if path else None,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        time_limit_s=args.time_limit,
        client_processes=args.client_processes,
    )  # bad values fail here, before a prompt is read or a request sent
    prompts = load_prompts(cfg)
    result = run(
        cfg, prompts, label=args.label, on_point=_print_point, progress=not args.no_progress
    )
    path = write_result(result, args.out_dir, args.result_filename)
    print(f"wrote {path}")
    if not args.no_plot:
        from outrider.bench.plot import load_results, plot_results

        for png in plot_results(load_results([path]), args.out_dir, prefix=path.stem + "-"):
            print(f"wrote {png}")
    return 0 if all(p["completed"] > 0 for p in result["points"]) else 1


def _print_point(p: dict) -> None:
    """One line per sweep point on stderr, as it finishes."""
    from outrider.bench.stats import accept_summary

    def ms(key: str) -> str:
        return "-" if p[key] is None else f"{p[key]:.1f}"

    limited = " (time limit)" if p["time_limited"] else ""
    print(
        f"[bench] concurrency {p['max_concurrency']}: {p['completed']}/{p['num_prompts']} "
        f"completed, {p['failed']} failed{limited} in {p['duration']:.1f} s; "
        f"{p['request_throughput']:.2f} req/s, {p['output_throughput']:.1f} output tok/s; "
        f"TTFT p50 {ms('median_ttft_ms')} p99 {ms('p99_ttft_ms')} ms, "
        f"TPOT p50 {ms('median_tpot_ms')} p99 {ms('p99_tpot_ms')} ms; "
        f"accept length {accept_summary(p)}",
        file=sys.stderr,
    )
    for error, count in p["errors"].items():
        print(f"[bench]   {count} x {error}", file=sys.stderr)


def _plot(args: argparse.Namespace) -> int:
    from outrider.bench.plot import load_results, plot_results

    paths = [Path(r) for r in args.results]
    series = load_results(paths)
    prefix = paths[0].stem + "-" if len(paths) == 1 else "compare-"
    out_dir = args.out_dir or paths[0].parent
    for png in plot_results(series, out_dir, prefix=prefix, say=lambda line: print(line)):
        print(f"wrote {png}")
    return 0
