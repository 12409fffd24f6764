"""What the server's own path costs a streamed token, with no model: `outrider serve`'s app
(the same ServerThread, routes, guards and AsyncEngine) over a stand-in engine whose every step
takes --step-ms (time.sleep: a GPU step, the interpreter free meanwhile) and gives each running
request one token (outrider/testing/server_core.py), streamed by raw-socket clients in another
process.

    python benchmarks/serve_overhead.py [--concurrency 1 16 64] [--step-ms 2] [--tokens 128]
        [--engine-us 0 15] [--streams-per-client 4] [--out NAME] [--out-dir DIR]

At concurrency C the stand-in engine could emit C x 1000 / step-ms tokens a second; what the
server delivers below that is its own cost. --engine-us adds Python work a token to each step,
holding the interpreter as a real engine's bookkeeping does (scheduling, postprocessing,
detokenizing: about 10 us a token at C=64 on 2 CPU cores, and the CUDA launches besides), which
the event loop then waits for: one point a value. Reported per C: chunks (one token each) a second,
that ceiling, the event loop thread's CPU microseconds a chunk (time.thread_time read inside
the loop) and the engine thread's (its steps' own Python: delivering deltas, metrics), and
the steps the engine ran. On an H100 host the server gave 7.9-8.4k tok/s of plain decoding at
C=64 where `LLM` gave 34k (benchmarks/results/spec_serve_apart.json, deterministic_c1_c64.json):
this measures that gap without a GPU. Writes benchmarks/results/serve_overhead.json (on a
machine without a GPU: serve_overhead_cpu.json)."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

PROMPT = [1, 2, 3]


async def _stream(host: str, port: int, tokens: int) -> int:
    """One streamed completion over a raw socket: its `data:` events but [DONE]."""
    body = (
        f'{{"model": "standin", "prompt": {PROMPT}, "max_tokens": {tokens}, "stream": true}}'
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head + body)
    data = b""
    while chunk := await reader.read(1 << 16):
        data += chunk
    writer.close()
    return data.count(b"data: {")


async def _clients(host: str, port: int, concurrency: int, streams: int, tokens: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with sem:
            return await _stream(host, port, tokens)

    warm = await asyncio.gather(*[one() for _ in range(concurrency)])  # connections, first use
    t0 = time.perf_counter()
    counts = await asyncio.gather(*[one() for _ in range(concurrency * streams)])
    print(sum(warm) + sum(counts), sum(counts), time.perf_counter() - t0, flush=True)


def _loop_cpu(server) -> float:
    """The event loop thread's CPU seconds so far, read inside that thread."""
    loop, done, out = server.loop, threading.Event(), []

    def read() -> None:
        out.append(time.thread_time())
        done.set()

    loop.call_soon_threadsafe(read)
    done.wait(10)
    return out[0]


def measure(
    concurrency: int, step_ms: float, tokens: int, streams: int, engine_us: float, mode: str
) -> dict:
    import functools

    from outrider.server.config import ServerConfig
    from outrider.server.engine_process import EngineProcess
    from outrider.server.server import ServerThread
    from outrider.testing.server_core import StandInCore

    class Served(ServerThread):
        """ServerThread, keeping the loop it serves on (to read that thread's CPU time)."""

        def _run(self) -> None:
            async def serve() -> None:
                self.loop = asyncio.get_running_loop()
                await self.server.serve(sockets=[self._sock])

            asyncio.run(serve())

    build = functools.partial(
        StandInCore, tokens, max_model_len=4096, step_ms=step_ms, engine_us=engine_us
    )
    # "process": the stand-in steps in an engine process (EngineProcess), as `outrider serve`
    # runs a core by default; "thread": in a thread of the server's process.
    core = EngineProcess(build) if mode == "process" else build()
    with Served(ServerConfig(served_model_name="standin"), core) as s:
        loop_before = _loop_cpu(s)
        steps_before, engine_before = _core_counts(core)
        client = subprocess.run(
            [sys.executable, __file__, "--client", "127.0.0.1", str(s.port), str(concurrency),
             str(streams), str(tokens)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        loop_after = _loop_cpu(s)
        steps_after, engine_after = _core_counts(core)
    every, timed, seconds = client.stdout.split()  # chunks in all (warm-up included), timed
    every, chunks, seconds = int(every), int(timed), float(seconds)
    steps = steps_after - steps_before
    row = {
        "engine": mode,
        "concurrency": concurrency,
        "engine_us_per_token": engine_us,
        "chunks": chunks,
        "seconds": round(seconds, 3),
        "chunks_per_s": round(chunks / seconds, 1),
        # what the stand-in emits with nothing else running: steps of step_ms + its Python
        "ceiling_per_s": round(concurrency / (step_ms / 1e3 + engine_us * concurrency / 1e6), 1),
        "steps": steps,
        "tokens_per_step": round(every / max(steps, 1), 2),
        # CPU time over the whole client run, warm-up included, so over every chunk
        "loop_cpu_us_per_chunk": round((loop_after - loop_before) / every * 1e6, 2),
        "engine_cpu_us_per_chunk": round((engine_after - engine_before) / every * 1e6, 2),
    }
    return row


def _core_counts(core) -> tuple[int, float]:
    """The stand-in's steps and its stepping thread's CPU seconds; beside an engine process, the
    steps the server received and that whole process's CPU seconds (Linux's /proc)."""
    if hasattr(core, "pid"):
        fields = Path(f"/proc/{core.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
        return core.steps_received, ticks / os.sysconf("SC_CLK_TCK")
    return core.steps, core.thread_cpu


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        host, port, c, streams, tokens = sys.argv[2:7]
        asyncio.run(_clients(host, int(port), int(c), int(streams), int(tokens)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--engine-us", type=float, nargs="+", default=[0.0])
    ap.add_argument(
        "--engine", nargs="+", default=["process", "thread"], choices=["process", "thread"],
        help="where the stand-in steps: an engine process (outrider serve's default) or a "
        "thread of the server's process (--no-engine-process); a row each",
    )  # fmt: skip
    ap.add_argument("--streams-per-client", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.step_ms <= 0 or args.tokens < 1 or min(args.concurrency) < 1:
        ap.error("--step-ms must be > 0, --tokens and every --concurrency >= 1")
    if min(args.engine_us) < 0:
        ap.error(f"--engine-us {args.engine_us}: every value must be >= 0")
    import torch

    name = args.out or ("serve_overhead" if torch.cuda.is_available() else "serve_overhead_cpu")
    rows = []
    for us in args.engine_us:
        for c in args.concurrency:
            for mode in args.engine:
                row = measure(c, args.step_ms, args.tokens, args.streams_per_client, us, mode)
                rows.append(row)
                print(
                    f"{mode:7} engine {us:g} us C={c:<3} {row['chunks_per_s']:9.1f} chunks/s of "
                    f"{row['ceiling_per_s']:9.1f}  "
                    f"loop {row['loop_cpu_us_per_chunk']} us, engine thread "
                    f"{row['engine_cpu_us_per_chunk']} us a chunk, {row['tokens_per_step']} a step",
                    flush=True,
                )
    print(write_result(name, {"step_ms": args.step_ms, "tokens": args.tokens, "rows": rows},
                       args.out_dir))  # fmt: skip


if __name__ == "__main__":
    main()
