"""A bounded reliability run of `outrider serve` over loopback: hostile requests, abort waves,
KV oversubscription, attacks on the server's request and connection bounds, and SIGTERM under
load, against a real server process and the default model.

    python benchmarks/soak.py [--spec none|ngram|eagle3] [--seed 0] [--fuzz-requests 300]
                              [--num-blocks 32] [--out-dir DIR]

Phases, in order, against one `python -m outrider serve --api-key KEY` on 127.0.0.1 (with
header_timeout --header-timeout, 2 s, and max_connections --max-connections, 64):
  1. start: wait for GET /health 200; the free-block gauge must equal the configured cache size.
  2. fuzz: a corpus built from --seed (bad JSON, wrong types, huge values, numbers longer than
     Python reads, empty and out-of-range prompts, booleans as token ids, lone surrogates, past
     the request limits, structured outputs, reserved chat_template_kwargs, huge model names,
     wrong content types, bad Content-Length, broken framing, missing or malformed API keys),
     sent as raw bytes. Every 5xx and every request without an answer after --request-timeout
     seconds is flagged; answers that differ from the expected status (or name another field
     than the expected one) are listed.
  3. aborts: streams closed after their first chunks, and sockets dropped right after the
     request was sent; once idle, the free-block gauge must be back where it started.
  4. oversubscription: concurrent greedy completions (ignore_eos) whose KV needs exceed the
     cache several times over, each must return max_tokens tokens; compared with the same
     requests run one at a time.
  5. stop list: the median inter-token gap of a --stop-tokens stream alone, beside a plain
     stream and beside one carrying the largest stop list the server takes (max_stop_strings x
     max_stop_string_chars random characters), --stop-rounds times; beside the attack it must
     stay within 1.5x of beside the plain stream (the median of the rounds' ratios: the same
     batch size, so the ratio is what the stop list costs others). A list one string or one
     character past the limits must be a 400.
  6. forged role markers: a user message holding a conversation as the template renders it
     (role markers, a system turn, the assistant's opening) must add no control token to the
     prompt POST /tokenize renders (the template's own markers only).
  7. slow heads: --max-connections connections at once, --slow-heads of them sending part of a
     request head, the rest nothing; one more request must get 503 and /health 200 while they
     are open; the server must close each within header_timeout + 2 s, then answer 200 again.
  8. loop stall: --stall-parallel POST /tokenize of a --stall-chars prompt at once (by default
     the largest the server takes, max_prompt_chars: 2 Mi characters), and the same prompt to
     both completion endpoints (which the context refuses), while GET /health is polled every
     20 ms; /health's p99 latency must stay under 0.2 s, every /tokenize must answer 200, every
     poll 200. /health's latency with the server idle is recorded beside it.
  9. SIGTERM with streams in flight: every stream must end with a finish_reason, the process
     must exit 0; the drain time is recorded.
  10. `outrider --help` wall time (median of --help-runs subprocess runs).

Writes benchmarks/results/soak.json (soak_<spec>.json with speculation) and exits 1 when a
must-hold fails: a 5xx, a hang, a leaked KV block, an oversubscribed request that did not
complete, a stream that did not end cleanly, a non-zero exit code, a cache size the server
did not take, a /health p99 over 0.2 s while large inputs are tokenized, a stop list that slows
another stream past 1.5x (or is refused within the limits, or taken past them), a forged
control token, a request head left open past header_timeout + 2 s, or a connection cap that
does not answer 503 (or /health that does not answer) while full. Other checks (answers that
differ from the expected, error bodies not in OpenAI's shape, outputs that differ from
one-at-a-time runs, tracebacks in the server log) are warnings: printed and recorded, not fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from soak_attacks import run_forged_markers, run_slow_heads, run_stop_list  # noqa: E402
from soak_corpus import (  # noqa: E402
    CHAT,
    COMPLETIONS,
    HOST,
    Case,
    Outcome,
    auth_headers,
    build_corpus,
    completion_body,
    http_request,
    json_bytes,
    metric_values,
    parse_response,
    quantile,
    summary,
    tally,
    traceback_exceptions,
    verdict,
)

from outrider.server.config import ServerConfig  # noqa: E402

# -- the run -------------------------------------------------------------------------------------

FREE, RUNNING, WAITING, PREEMPT = (
    "outrider:num_free_kv_blocks",
    "outrider:num_requests_running",
    "outrider:num_requests_waiting",
    "outrider:num_preemptions_total",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


async def send_raw(port: int, case: Case, timeout: float) -> Outcome:
    t0 = time.monotonic()
    chunks: list[bytes] = []
    status = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
    except (OSError, TimeoutError):
        return Outcome("refused", time.monotonic() - t0)
    try:
        try:
            writer.write(case.raw)
            await writer.drain()
            if case.half_close:
                writer.write_eof()
        except OSError:  # the server answered (413) and closed before reading it all
            pass

        async def read_all() -> None:
            while chunk := await reader.read(1 << 16):
                chunks.append(chunk)

        await asyncio.wait_for(read_all(), timeout)
    except TimeoutError:
        status = "hang"
    except OSError:
        status = "reset" if not chunks else None
    finally:
        writer.close()
    code, _, body = parse_response(b"".join(chunks))
    return Outcome(status or code, time.monotonic() - t0, body)


async def run_fuzz(port: int, cases: list[Case], concurrency: int, timeout: float) -> list:
    gate = asyncio.Semaphore(concurrency)

    async def one(case: Case) -> tuple[Case, Outcome]:
        async with gate:
            return case, await send_raw(port, case, timeout)

    return await asyncio.gather(*(one(c) for c in cases))


async def metrics(c) -> dict[str, float | None]:
    r = await c.get("/metrics")
    r.raise_for_status()
    return metric_values(r.text, (FREE, RUNNING, WAITING, PREEMPT))


async def wait_idle(c, want: float | None, timeout: float = 60.0) -> float | None:
    """Free blocks once no request runs or waits and the gauge holds still for one poll; waits
    up to `timeout` for it to reach `want`. None: never idle."""
    deadline, last, idle_free = time.monotonic() + timeout, None, None
    while time.monotonic() < deadline:
        m = await metrics(c)
        if m[RUNNING] == 0 and m[WAITING] == 0:
            if last == m[FREE]:
                idle_free = m[FREE]
                if want is None or idle_free == want:
                    return idle_free
            last = m[FREE]
        else:
            last = None
        await asyncio.sleep(0.5)
    return idle_free


async def run_aborts(
    c, port: int, key: str, streams: int, drops: int, seed: int, context: int
) -> dict:
    """Streams closed after 1-3 content chunks, then requests whose socket closes (FIN or RST)
    0-0.3 s after sending. Every request fits the context, so each is admitted."""
    rng = random.Random(seed + 1)
    gate, saw, statuses = asyncio.Semaphore(8), 0, Counter()

    async def stream(i: int) -> None:
        nonlocal saw
        chat = i % 2 == 1
        body = {"max_tokens": min(128, context // 2), "ignore_eos": True, "stream": True}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell a story {i}"}]
        else:
            body["prompt"] = f"Once upon a time {i}"
        want, seen = rng.randint(1, 3), 0
        try:
            async with gate, c.stream("POST", CHAT if chat else COMPLETIONS, json=body) as r:
                statuses[str(r.status_code)] += 1
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = (json.loads(line[6:])["choices"] or [{}])[0]
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        seen += 1
                    if seen >= want:
                        saw += 1
                        break  # leaving the block closes the connection mid-generation
        except Exception as e:  # counted: the server's answer is what this phase checks
            statuses[type(e).__name__] += 1

    await asyncio.gather(*(stream(i) for i in range(streams)))
    auth = auth_headers("good", key) + [("Content-Type", "application/json")]
    for i in range(drops):
        body = completion_body(
            prompt=f"Write a long essay number {i}.",
            max_tokens=min(64, context // 2),
            ignore_eos=True,
            stream=i % 3 == 0,
            temperature=0.8,
        )
        _, writer = await asyncio.open_connection(HOST, port)
        writer.write(http_request("POST", COMPLETIONS, json_bytes(body), auth))
        await writer.drain()
        await asyncio.sleep(rng.uniform(0, 0.3))
        if i % 2:  # an abortive close: RST instead of FIN
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
    return {
        "abort_streams": streams,
        "abort_streams_saw_content": saw,
        "abort_stream_statuses": dict(statuses),
        "abort_drops": drops,
    }


async def run_oversubscription(c, n: int, max_tokens: int, block_size: int) -> dict:
    bodies = [
        {
            "prompt": f"Story number {i}:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        for i in range(n)
    ]

    async def post(body: dict):  # the response, or what went wrong: an incomplete request
        try:
            return await c.post(COMPLETIONS, json=body)
        except Exception as e:
            return e

    def check(r) -> tuple[bool, str | None, int]:
        if isinstance(r, Exception) or r.status_code != 200:
            return False, None, 0
        j = r.json()
        ok = j["choices"][0]["finish_reason"] == "length"
        ok = ok and j["usage"]["completion_tokens"] == max_tokens
        return ok, j["choices"][0]["text"], j["usage"]["prompt_tokens"]

    before = (await metrics(c))[PREEMPT]
    t0 = time.monotonic()
    together = [check(r) for r in await asyncio.gather(*(post(b) for b in bodies))]
    t_together = time.monotonic() - t0
    after = (await metrics(c))[PREEMPT]
    t0 = time.monotonic()
    alone = [check(await post(b)) for b in bodies]
    differ = [i for i, (a, b) in enumerate(zip(together, alone)) if a[1] != b[1]]
    return {
        "oversubscribed_total": n,
        "oversubscribed_completed": sum(ok for ok, _, _ in together),
        "sequential_completed": sum(ok for ok, _, _ in alone),
        "outputs_equal_sequential": not differ,
        "outputs_differ": differ,
        "kv_blocks_needed": sum(math.ceil((p + max_tokens) / block_size) for _, _, p in together),
        "preemptions": None if before is None else after - before,
        "oversubscribed_seconds": round(t_together, 2),
        "sequential_seconds": round(time.monotonic() - t0, 2),
    }


STALL_POLL_S = 0.02  # /health is polled this often while the large inputs are in flight
STALL_IDLE_POLLS = 50  # polls of an idle server first: the latency this machine adds anyway


def large_prompt(chars: int, seed: int) -> str:
    """`chars` characters of seeded words, digits and punctuation: ~4 characters a token."""
    rng = random.Random(seed + 2)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "1984", "3.14",
             "don't", "state-of-the-art", "(x)", "naïve", "zürich", "\n"]  # fmt: skip
    text = " ".join(rng.choice(words) for _ in range(chars // 4 + 1))
    return text[:chars]


async def run_loop_stall(c, parallel: int, chars: int, seed: int, timeout: float) -> dict:
    """`parallel` POST /tokenize of a `chars`-character prompt at once (one asking for the token
    strings too), with the same prompt to /v1/completions and /v1/chat/completions (which the
    context refuses), while GET /health is polled every STALL_POLL_S on fresh connections: its
    latencies are how long the server's event loop stalls behind the large inputs. Ends when
    the requests do, or after `timeout` seconds. The bodies are encoded beforehand and the
    answers never parsed whole, so this client's own loop stays free to poll."""
    prompt = large_prompt(chars, seed)
    bodies = [
        ("/tokenize", {"prompt": prompt, "return_token_strs": i == 0}) for i in range(parallel)
    ]
    bodies += [
        (COMPLETIONS, completion_body(prompt=prompt)),
        (CHAT, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}),
    ]
    encoded = [(path, json.dumps(body, ensure_ascii=False).encode()) for path, body in bodies]
    json_type = {"Content-Type": "application/json"}

    async def post(path: str, body: bytes) -> dict:
        t0 = time.monotonic()
        count = None
        try:
            r = await c.post(path, content=body, headers=json_type, timeout=timeout)
            status = str(r.status_code)
            if found := re.match(rb'\{"count":(\d+)', r.content):
                count = int(found[1])
        except Exception as e:  # recorded: the verdict wants every answer
            status = type(e).__name__
        return {"path": path, "status": status, "count": count,
                "seconds": round(time.monotonic() - t0, 2)}  # fmt: skip

    statuses = Counter()

    async def health() -> float:
        t0 = time.monotonic()
        try:
            statuses[str((await c.get("/health", timeout=timeout)).status_code)] += 1
        except Exception as e:
            statuses[type(e).__name__] += 1
        await asyncio.sleep(STALL_POLL_S)
        return time.monotonic() - t0 - STALL_POLL_S

    idle = [await health() for _ in range(STALL_IDLE_POLLS)]
    statuses.clear()
    work = asyncio.gather(*(post(path, body) for path, body in encoded))
    latencies = []
    deadline = time.monotonic() + timeout
    while not work.done() and time.monotonic() < deadline:
        latencies.append(await health())
    requests = await asyncio.wait_for(work, max(deadline - time.monotonic(), 0) + 5)
    return {
        "stall_parallel": parallel,
        "stall_prompt_chars": chars,
        "stall_body_bytes": len(encoded[0][1]),
        "stall_requests": requests,
        "stall_health_polls": len(latencies),
        "stall_health_statuses": dict(statuses),
        "stall_health_p50_s": quantile(latencies, 0.5),
        "stall_health_p99_s": quantile(latencies, 0.99),
        "stall_health_max_s": quantile(latencies, 1.0),
        "stall_idle_health_p99_s": quantile(idle, 0.99),
        "stall_idle_health_max_s": quantile(idle, 1.0),
    }


async def run_sigterm(
    c, proc: subprocess.Popen, k: int, shutdown_timeout: float, context: int
) -> dict:
    """k streams (half short enough to finish in the drain, half not), SIGTERM once each has
    content, then probes during the drain; returns the drain time and how each stream ended."""
    started = [asyncio.Event() for _ in range(k)]

    async def stream(i: int) -> dict:
        max_tokens = 16 if i % 2 == 0 else min(200, context - 16)
        body = {
            "prompt": f"Once upon a time {i}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        rec = {
            "max_tokens": max_tokens,
            "status": None,
            "tokens": None,
            "finish_reason": None,
            "done": False,
            "error": None,
        }
        try:
            async with c.stream("POST", COMPLETIONS, json=body, timeout=shutdown_timeout + 60) as r:
                rec["status"] = r.status_code
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        rec["done"] = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices") or ():
                            started[i].set()
                            rec["finish_reason"] = (
                                choice.get("finish_reason") or rec["finish_reason"]
                            )
                        if chunk.get("usage"):
                            rec["tokens"] = chunk["usage"]["completion_tokens"]
        except Exception as e:  # an unclean end is what this phase looks for
            rec["error"] = repr(e)
        finally:
            started[i].set()
        return rec

    tasks = [asyncio.create_task(stream(i)) for i in range(k)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)

    async def probe(method: str, path: str, **kw) -> str:
        try:
            return str((await c.request(method, path, timeout=5, **kw)).status_code)
        except Exception:
            return "refused"

    health = await probe("GET", "/health")
    refused = await probe("POST", COMPLETIONS, json=completion_body())
    exit_code = None
    while time.monotonic() - t0 < shutdown_timeout + 30 and exit_code is None:
        exit_code = proc.poll()
        await asyncio.sleep(0.05)
    drain = time.monotonic() - t0
    records = await asyncio.gather(*tasks)
    clean = [
        r
        for r in records
        if r["status"] == 200
        and r["error"] is None
        and r["finish_reason"] in ("length", "stop", "abort")
    ]
    return {
        "sigterm_streams": k,
        "sigterm_streams_clean": len(clean),
        "sigterm_streams_done": sum(r["done"] for r in records),
        "sigterm_finish_reasons": dict(Counter(str(r["finish_reason"]) for r in records)),
        "sigterm_records": records,
        "health_while_draining": health,
        "request_while_draining": refused,
        "drain_seconds": round(drain, 2),
        "exit_code": exit_code,
    }


def time_help(runs: int) -> tuple[float, list[float], str]:
    script = Path(sys.executable).with_name("outrider")
    cmd = (
        [str(script), "--help"] if script.exists() else [sys.executable, "-m", "outrider", "--help"]
    )
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(round(time.perf_counter() - t0, 3))
    return statistics.median(times), times, " ".join([Path(cmd[0]).name, *cmd[1:]])


def start_server(args, port: int, workdir: Path) -> tuple[subprocess.Popen, Path]:
    config = workdir / "server.yaml"
    config.write_text(
        f"server: {{host: {HOST}, port: {port}, shutdown_timeout: {args.shutdown_timeout}, "
        f"default_max_tokens: 16, header_timeout: {args.header_timeout}, "
        f"max_connections: {args.max_connections}}}\n"
        f"cache: {{num_blocks: {args.num_blocks}, block_size: {args.block_size}}}\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "outrider",
        "serve",
        "--config",
        str(config),
        "--api-key",
        args.api_key,
    ]
    cmd += [] if args.spec == "none" else ["--spec", args.spec]
    cmd += args.serve_arg
    log = workdir / "server.log"
    args.server_command = " ".join(cmd).replace(args.api_key, "KEY")
    args.server_config = config.read_text()
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    return proc, log


async def wait_healthy(c, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health said 200")
        try:
            if (await c.get("/health", timeout=5)).status_code == 200:
                return
        except Exception:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"/health not 200 after {timeout} s: raise --startup-timeout or see the log")


async def soak(args, proc: subprocess.Popen, port: int, result: dict) -> None:
    import httpx

    phases = result["phases_s"]
    auth = {"Authorization": f"Bearer {args.api_key}"}
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=f"http://{HOST}:{port}",
        headers=auth,
        timeout=args.request_timeout * 20,
        limits=limits,
    ) as c:
        t0 = time.monotonic()
        await wait_healthy(c, proc, args.startup_timeout)
        phases["startup"] = round(time.monotonic() - t0, 2)
        card = (await c.get("/v1/models")).json()["data"][0]
        model, context = card["id"], card.get("max_model_len") or 8192
        result["max_model_len"] = context
        if args.oversub_max_tokens + 16 > context:
            raise RuntimeError(
                f"--oversub-max-tokens {args.oversub_max_tokens} does not fit the context of "
                f"{context} tokens that {args.num_blocks} blocks hold: raise --num-blocks"
            )
        kv = result["kv_free"] = {"start": await wait_idle(c, None)}
        result["cache_blocks_seen"] = kv["start"]

        t0 = time.monotonic()
        corpus = build_corpus(args.seed, args.fuzz_requests, args.api_key, model, context)
        outcomes = await run_fuzz(port, corpus, args.fuzz_concurrency, args.request_timeout)
        result["fuzz"] = fuzz = tally(outcomes)
        result.update(
            requests_by_status=fuzz["requests_by_status"],
            n_5xx=fuzz["n_5xx"],
            n_hangs=fuzz["n_hangs"],
        )
        kv["after_fuzz"] = await wait_idle(c, kv["start"])
        phases["fuzz"] = round(time.monotonic() - t0, 2)
        print(f"fuzz: {fuzz['requests_by_status']} in {phases['fuzz']} s", flush=True)

        t0 = time.monotonic()
        result.update(
            await run_aborts(
                c, port, args.api_key, args.abort_streams, args.abort_drops, args.seed, context
            )
        )
        kv["after_aborts"] = await wait_idle(c, kv["start"])
        phases["aborts"] = round(time.monotonic() - t0, 2)
        print(f"aborts: free blocks {kv['start']} -> {kv['after_aborts']}", flush=True)

        t0 = time.monotonic()
        result.update(
            await run_oversubscription(
                c, args.oversub_requests, args.oversub_max_tokens, args.block_size
            )
        )
        kv["after_oversubscription"] = await wait_idle(c, kv["start"])
        phases["oversubscription"] = round(time.monotonic() - t0, 2)
        done, total = result["oversubscribed_completed"], result["oversubscribed_total"]
        print(f"oversubscription: {done}/{total} in {phases['oversubscription']} s", flush=True)

        t0 = time.monotonic()
        limits = ServerConfig()  # the soak's server takes the default request limits
        result.update(
            await run_stop_list(
                c,
                limits.max_stop_strings,
                limits.max_stop_string_chars,
                args.stop_rounds,
                args.stop_tokens,
                args.seed,
            )
        )
        kv["after_stop_list"] = await wait_idle(c, kv["start"])
        phases["stop_list"] = round(time.monotonic() - t0, 2)
        # the worst checkpoint: a leak after the aborts does not hide behind a later recovery
        free = list(kv.values())
        result["leaked_blocks"] = None if None in free else max(free[0] - f for f in free)
        gaps = result["stop_gap_median_ms"]
        print(
            f"stop list: inter-token gap {gaps['beside_plain']} ms beside a plain stream, "
            f"{gaps['beside_attack']} ms beside {limits.max_stop_strings} x "
            f"{limits.max_stop_string_chars} stop strings (ratio {result['stop_gap_ratio']}; "
            f"alone {gaps['alone']} ms)",
            flush=True,
        )

        t0 = time.monotonic()
        result.update(await run_forged_markers(c))
        phases["forged_markers"] = round(time.monotonic() - t0, 2)
        print(
            f"forged role markers: {result['forged_control_tokens']} control tokens forged "
            f"({result['forged_plain_control_tokens']} in the same text as a plain prompt)",
            flush=True,
        )

        t0 = time.monotonic()
        result.update(
            await run_slow_heads(
                port, args.api_key, args.max_connections, args.slow_heads, args.header_timeout
            )
        )
        phases["slow_heads"] = round(time.monotonic() - t0, 2)
        print(
            f"slow heads: {result['heads_closed']}/{result['heads_held']} closed, the last after "
            f"{result['heads_close_max_s']} s (header_timeout {args.header_timeout} s); beyond "
            f"the cap {result['cap_request_beyond']}, /health {result['cap_health']}",
            flush=True,
        )

        t0 = time.monotonic()
        result.update(
            await run_loop_stall(
                c, args.stall_parallel, args.stall_chars, args.seed, args.stall_timeout
            )
        )
        phases["loop_stall"] = round(time.monotonic() - t0, 2)
        print(
            f"loop stall: /health p99 {result['stall_health_p99_s']} s, max "
            f"{result['stall_health_max_s']} s over {result['stall_health_polls']} polls "
            f"(idle p99 {result['stall_idle_health_p99_s']} s)",
            flush=True,
        )

        t0 = time.monotonic()
        result.update(
            await run_sigterm(c, proc, args.sigterm_streams, args.shutdown_timeout, context)
        )
        phases["sigterm"] = round(time.monotonic() - t0, 2)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--spec", choices=("none", "ngram", "eagle3"), default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fuzz-requests", type=int, default=300, help="corpus size (at least the fixed cases)"
    )
    p.add_argument("--fuzz-concurrency", type=int, default=4)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="a fuzz request without an answer by then hangs",
    )
    p.add_argument("--num-blocks", type=int, default=32, help="KV cache blocks (the small cache)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--abort-streams", type=int, default=32)
    p.add_argument("--abort-drops", type=int, default=32)
    p.add_argument("--oversub-requests", type=int, default=16)
    p.add_argument("--oversub-max-tokens", type=int, default=64)
    p.add_argument(
        "--stall-parallel", type=int, default=4, help="large /tokenize requests sent at once"
    )
    p.add_argument(
        "--stall-chars",
        type=int,
        default=None,
        help="characters of each large prompt (default: the server's max_prompt_chars, the most "
        "it takes; its JSON body must fit max_body_bytes)",
    )
    p.add_argument(
        "--stall-timeout", type=float, default=300.0, help="seconds the loop-stall phase may take"
    )
    p.add_argument(
        "--stop-rounds",
        type=int,
        default=4,
        help="rounds of the stop-list phase (each: alone, beside a plain and an attacking stream)",
    )
    p.add_argument(
        "--stop-tokens", type=int, default=40, help="tokens of the stream whose gaps are timed"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=2.0,
        help="the server's header_timeout: how long the slow-heads phase waits",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="the server's max_connections: the slow-heads phase holds this many",
    )
    p.add_argument(
        "--slow-heads",
        type=int,
        default=20,
        help="of the held connections, those that send part of a request head",
    )
    p.add_argument("--sigterm-streams", type=int, default=6)
    p.add_argument("--shutdown-timeout", type=float, default=8.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--help-runs", type=int, default=5)
    p.add_argument("--api-key", default="sk-soak-0123456789")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more `outrider serve` argument (repeatable)",
    )
    p.add_argument(
        "--out-dir", default=None, help="where soak.json goes (default benchmarks/results)"
    )
    args = p.parse_args()
    if args.stall_chars is None:  # the soak's server takes the default request limits
        args.stall_chars = ServerConfig().max_prompt_chars
    busiest = max(args.oversub_requests, args.sigterm_streams, 8) + 8  # 8: the abort waves
    if args.max_connections < busiest:
        p.error(
            f"--max-connections {args.max_connections} is below the {busiest} connections the "
            "other phases may open at once: raise it"
        )

    workdir = Path(tempfile.mkdtemp(prefix="outrider-soak-"))
    port = free_port()
    result: dict = {
        "spec": args.spec,
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "seed": args.seed,
        "phases_s": {},
        "server_log": None,
    }
    t_all = time.monotonic()
    proc, log = start_server(args, port, workdir)
    error = None
    try:
        asyncio.run(soak(args, proc, port, result))
    except Exception as e:  # recorded and fatal: the verdict sees the figures that are missing
        error = f"{type(e).__name__}: {e}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result.update(error=error, server_command=args.server_command, server_yaml=args.server_config)
    text = log.read_text(errors="replace")
    result["server_tracebacks"] = text.count("Traceback (most recent call last)")
    result["server_exceptions"] = traceback_exceptions(text)
    result["server_log"] = str(log)
    result["server_log_tail"] = text.splitlines()[-20:]
    t0 = time.monotonic()
    result["help_seconds"], result["help_runs"], result["help_command"] = time_help(args.help_runs)
    result["phases_s"]["help"] = round(time.monotonic() - t0, 2)
    result["phases_s"]["total"] = round(time.monotonic() - t_all, 2)
    failures, warnings = verdict(result)
    if error:
        failures.insert(0, f"the run stopped early: {error}")
    result.update(failures=failures, warnings=warnings, passed=not failures)
    name = "soak" if args.spec == "none" else f"soak_{args.spec}"
    path = write_result(name, result, args.out_dir)

    print("\n" + "\n".join(summary(result)) + f"\n  -> {path}")
    print("PASS" if not failures else f"FAIL ({len(failures)}); server log: {log}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
