"""Short requests arriving during a long prefill, at the server: time to first token with the
long-prefill threshold off (prompts take the budget in admission order) and on (its default),
one server each, the same requests.

    python benchmarks/fair_prefill.py [--long-tokens 6975] [--burst 16] [--probes-at 5 15 60]
                                      [--burst-at 30] [--configs off on] [--out-dir DIR]

For each configuration: `outrider serve` on 127.0.0.1 (the default model unless --serve-arg
says otherwise, --max-model-len 8192), then one streamed completion of --long-tokens prompt
tokens (a text's token ids), and while it prefills: single short chat streams sent
--probes-at seconds after it, and --burst short chat streams at once --burst-at seconds after
it. Each stream's time to its first content token (TTFT) and to its end are recorded; the
server is stopped before the next configuration. Writes benchmarks/results/fair_prefill.json:
per configuration the long request's TTFT, each probe's and the burst's TTFTs, and the
machine's load average (the CPU machine is shared: a neighbour's work shows in every time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import start_server, write_result  # noqa: E402

CONFIGS = {"off": ["--long-prefill-token-threshold", "0"], "on": []}
HOST, KEY = "127.0.0.1", "sk-bench"
# The long prompt: these in a seeded random order, cut to --long-tokens tokens.
SENTENCES = (
    "The river carried the last of the winter ice past the old stone mill.",
    "A letter arrived at the harbor office, three weeks late and soaked through.",
    "Copper lanterns hung along the market street, swaying in the evening wind.",
    "She counted the orchard rows twice before the storm reached the valley.",
    "The engine coughed, caught, and settled into a steady rhythm on the ridge.",
    "Nobody in the village remembered who had planted the walled garden.",
)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def stream(c, path: str, body: dict, t0: float) -> dict:
    """Send one streamed request; its send time, TTFT and end, in seconds from t0."""
    sent = time.monotonic()
    rec = {"sent_s": round(sent - t0, 2), "ttft_s": None, "total_s": None, "tokens": None}
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text and rec["ttft_s"] is None:
                    rec["ttft_s"] = round(time.monotonic() - sent, 3)
            if chunk.get("usage"):
                rec["tokens"] = chunk["usage"]["completion_tokens"]
    rec["total_s"] = round(time.monotonic() - sent, 3)
    return rec


def short_chat(i: int, max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Name a color and a fruit. ({i})"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


async def run_config(args, port: int) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(
        base_url=f"http://{HOST}:{port}", headers=headers, timeout=900
    ) as c:
        rng = random.Random(args.seed)
        text = " ".join(rng.choice(SENTENCES) for _ in range(args.long_tokens // 10))
        ids = (await c.post("/tokenize", json={"prompt": text})).json()["tokens"]
        if len(ids) < args.long_tokens:
            raise RuntimeError(f"the long text has {len(ids)} tokens, fewer than asked")
        long_body = {
            "prompt": ids[: args.long_tokens],
            "max_tokens": args.long_max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.monotonic()
        long_task = asyncio.create_task(stream(c, "/v1/completions", long_body, t0))

        async def at(delay: float, coro):
            await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
            return await coro

        def short(i: int, delay: float) -> asyncio.Task:
            body = short_chat(i, args.short_max_tokens)
            return asyncio.create_task(at(delay, stream(c, "/v1/chat/completions", body, t0)))

        probes = [short(i, d) for i, d in enumerate(args.probes_at)]
        burst = [short(100 + i, args.burst_at) for i in range(args.burst)]
        probe_recs = await asyncio.gather(*probes)
        burst_recs = await asyncio.gather(*burst)
        long_rec = await long_task
    burst_ttfts = [r["ttft_s"] for r in burst_recs]
    return {
        "long": {"prompt_tokens": args.long_tokens, **long_rec},
        "probes": probe_recs,
        "burst": burst_recs,
        "probe_ttft_s": [r["ttft_s"] for r in probe_recs],
        "burst_ttft_median_s": round(statistics.median(burst_ttfts), 3),
        "burst_ttft_max_s": max(burst_ttfts),
        "arrived_during_prefill": all(
            r["sent_s"] < long_rec["ttft_s"] for r in [*probe_recs, *burst_recs]
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--long-tokens", type=int, default=6975)
    p.add_argument("--long-max-tokens", type=int, default=8)
    p.add_argument("--probes-at", type=float, nargs="*", default=[5.0, 15.0, 60.0])
    p.add_argument("--burst", type=int, default=16, help="short streams sent at once")
    p.add_argument("--burst-at", type=float, default=30.0)
    p.add_argument("--short-max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--serve-arg", action="append", default=[], help="one more `outrider serve` argument"
    )
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default: results)")
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="outrider-fair-"))
    runs = {}
    for name in args.configs:
        flags = ["--max-model-len", str(args.max_model_len), *CONFIGS[name], *args.serve_arg]
        port, log = free_port(), workdir / f"server_{name}.log"
        load_before = os.getloadavg()
        proc = start_server(["--api-key", KEY, *flags], port, log, args.startup_timeout, HOST)
        try:
            runs[name] = {"serve_flags": flags, **asyncio.run(run_config(args, port))}
        finally:
            stop_server(proc)
        runs[name]["loadavg_before_after"] = [
            round(load_before[0], 2),
            round(os.getloadavg()[0], 2),
        ]
        r = runs[name]
        print(
            f"{name}: long TTFT {r['long']['ttft_s']} s; probe TTFTs {r['probe_ttft_s']} s; "
            f"burst of {args.burst} TTFT median {r['burst_ttft_median_s']} s, "
            f"max {r['burst_ttft_max_s']} s",
            flush=True,
        )
    params = {k: getattr(args, k) for k in ("long_tokens", "long_max_tokens", "probes_at", "burst",
                                            "burst_at", "short_max_tokens", "max_model_len")}  # fmt: skip
    path = write_result("fair_prefill", {"params": params, "runs": runs}, args.out_dir)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
