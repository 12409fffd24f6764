"""`outrider bench serve`: load on any OpenAI-compatible endpoint (outrider, vLLM, SGLang), one
sweep point per concurrency, measured the way `vllm bench serve` measures it so results compare
across tools:

    TTFT    request sent -> first chunk with text
    ITL     gaps between chunks with text (a chunk may hold several tokens: speculative steps)
    TPOT    (e2e - TTFT) / (output tokens - 1), per request with more than one token
    e2el    request sent -> end of stream
    throughput: completed requests and tokens over the point's wall time; goodput: the requests
    that met every SLO given, over the same time.

Output tokens come from the server's `usage` (asked for with stream_options.include_usage);
a server that sends none is counted one token per chunk, which undercounts speculative steps.
Accept length under load comes from the server's own speculative counters on /metrics, read
before and after each point; servers without them report null.

Start-up: stdlib imports only; httpx (and tqdm) are imported when a sweep runs, so
`outrider bench --help` stays fast.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import queue
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from outrider.bench.prompts import Prompt, arrival_times
from outrider.bench.request import RequestResult, send_request
from outrider.bench.stats import (
    latency_stats,
    ledger_counters,
    ledger_delta,
    run_metadata,
    spec_counters,
    spec_delta,
    tp_counters,
    tp_delta,
)

if TYPE_CHECKING:
    import httpx

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DATASETS = ("builtin", "grounded", "sharegpt", "random")


class BenchError(RuntimeError):
    """The endpoint cannot be benchmarked (unreachable, wrong path, no model)."""


@dataclass(frozen=True)
class BenchConfig:
    """One `bench serve` run; `outrider bench serve`'s flags read their defaults from here."""

    base_url: str
    model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    endpoint: str = "chat"
    max_concurrency: tuple[int, ...] = (1, 4, 16)
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    num_prompts: int = 100  # per sweep point
    dataset: str = "builtin"
    dataset_path: str | None = None
    random_input_len: int = 1024  # words, about one token each
    random_output_len: int = 128
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    time_limit_s: float = 300.0  # per sweep point
    client_processes: int | None = None  # None: one per 16 streams (client_processes_at)

    def __post_init__(self) -> None:
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(
                f"--base-url {self.base_url!r} is not an http(s) URL: give the server's root, "
                "e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)"
            )
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint {self.endpoint!r}: use one of {', '.join(ENDPOINTS)}")
        if not self.max_concurrency or any(c < 1 for c in self.max_concurrency):
            raise ValueError(
                f"--max-concurrency {' '.join(map(str, self.max_concurrency))}: every value "
                "must be a positive integer, e.g. --max-concurrency 1 2 4 8"
            )
        positive = {
            "--num-prompts": self.num_prompts,
            "--max-tokens": self.max_tokens,
            "--random-input-len": self.random_input_len,
            "--random-output-len": self.random_output_len,
            "--request-rate": self.request_rate,
            "--time-limit": self.time_limit_s,
            "--slo-ttft-ms": self.slo_ttft_ms,
            "--slo-tpot-ms": self.slo_tpot_ms,
            "--client-processes": self.client_processes,
        }
        for flag, value in positive.items():
            if value is not None and not value > 0:
                hint = " (inf: no gaps between arrivals)" if flag == "--request-rate" else ""
                raise ValueError(f"{flag} {value} must be positive{hint}")
        if self.dataset not in DATASETS:
            raise ValueError(
                f"--dataset {self.dataset!r}: use builtin, grounded, sharegpt PATH or random"
            )
        if (self.dataset == "sharegpt") != (self.dataset_path is not None):
            given = " ".join(v for v in (self.dataset, self.dataset_path) if v)
            raise ValueError(
                "--dataset sharegpt takes a file (--dataset sharegpt PATH); builtin, grounded "
                f"and random take none (got --dataset {given})"
            )
        if self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature} must be 0 (greedy) or more")

    @property
    def root(self) -> str:
        """The server's root URL: /v1/... and /metrics hang below it."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    def client_processes_at(self, concurrency: int) -> int:
        """Processes sending a point's requests: --client-processes, else one per 16 streams
        (at most half this machine's cores), never more than the streams. One asyncio process
        parses every chunk of every stream; at 64 streams of EAGLE-3 on an H100 it ran a core
        at 95% and capped the point at 11k tok/s with a median TTFT of 273 ms, where two
        processes of 32 streams each measured 25k tok/s and 20 ms."""
        if self.client_processes is not None:
            return min(self.client_processes, concurrency)
        cores = max(1, (os.cpu_count() or 2) // 2)
        return max(1, min(math.ceil(concurrency / 16), cores, concurrency))


# -- a request's body --------------------------------------------------------------------------


def payload(cfg: BenchConfig, model: str, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": prompt.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


# -- server metrics ----------------------------------------------------------------------------


async def scrape_metrics(client: httpx.AsyncClient, root: str) -> str:
    """The server's /metrics text; "" when it has none."""
    import httpx

    try:
        r = await client.get(root + "/metrics")
    except httpx.HTTPError:
        return ""
    return r.text if r.status_code == 200 else ""


# -- a sweep point -----------------------------------------------------------------------------


def summarize(results: list[RequestResult], duration: float, cfg: BenchConfig) -> dict[str, Any]:
    """A point's numbers from its requests (failed ones count only as failures)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok]
    in_tokens = None if None in prompt_counts else sum(prompt_counts)  # only the server counts
    tpots = [r.tpot for r in ok if r.tpot is not None]
    slo = cfg.slo_ttft_ms is not None or cfg.slo_tpot_ms is not None
    good = sum(1 for r in ok if _meets_slo(r, cfg)) if slo else None
    point: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": None if good is None else good / duration,
        "good_completed": good,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": None,
    }
    if in_tokens is not None:
        point["total_token_throughput"] = (in_tokens + out_tokens) / duration
    point.update(latency_stats("ttft", [r.ttft for r in ok]))
    point.update(latency_stats("tpot", tpots))
    point.update(latency_stats("itl", [g for r in ok for g in r.itl]))
    point.update(latency_stats("e2el", [r.latency for r in ok]))
    point["errors"] = dict(Counter(r.error for r in results if not r.ok).most_common(5))
    return point


def _meets_slo(r: RequestResult, cfg: BenchConfig) -> bool:
    tpot = r.tpot or 0.0  # one token: no time per output token to miss (vLLM counts 0)
    return (cfg.slo_ttft_ms is None or r.ttft * 1000 <= cfg.slo_ttft_ms) and (
        cfg.slo_tpot_ms is None or tpot * 1000 <= cfg.slo_tpot_ms
    )


async def run_point(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    prompts: list[Prompt],
    concurrency: int,
    progress: bool = True,
) -> dict[str, Any]:
    """Send `prompts` with at most `concurrency` in flight, arriving at cfg.request_rate; stop
    at cfg.time_limit_s, cancelling what is still running (counted as `incomplete`). Sent from
    cfg.client_processes_at(concurrency) processes, each a share of the prompts, the streams
    and the rate (Poisson arrivals split are Poisson at the split rates)."""
    processes = cfg.client_processes_at(concurrency)
    bar = _progress(len(prompts), f"concurrency {concurrency}", progress)
    before = await scrape_metrics(client, cfg.root)
    if processes == 1:
        results, duration, time_limited = await _send_all(
            client, cfg, model, prompts, concurrency, cfg.request_rate, cfg.seed, bar.update
        )
    else:
        results, duration, time_limited = await asyncio.to_thread(
            _send_from_processes, cfg, model, prompts, concurrency, processes, bar
        )
    bar.close()
    if progress and not sys.stderr.isatty():
        # Off a terminal tqdm's last "\r"-redrawn line has no newline: end it, so what is
        # printed next (the point's summary) starts on its own line in a log.
        print(file=sys.stderr)
    after = await scrape_metrics(client, cfg.root)
    spec = spec_delta(spec_counters(before), spec_counters(after))
    return {
        "max_concurrency": concurrency,
        "request_rate": _json_rate(cfg.request_rate),
        "num_prompts": len(prompts),
        "client_processes": processes,
        "incomplete": len(prompts) - len(results),
        "time_limited": time_limited,
        **summarize(results, duration, cfg),
        "accept_length": spec["accept_length"] if spec else None,
        "spec_decode": spec,
        "tensor_parallel": tp_delta(tp_counters(before), tp_counters(after)),
        "engine_steps": ledger_delta(ledger_counters(before), ledger_counters(after), duration),
    }


async def _send_all(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    prompts: list[Prompt],
    concurrency: int,
    rate: float,
    seed: int,
    done: Callable[[int], Any],
) -> tuple[list[RequestResult], float, bool]:
    """One process's requests: (results, seconds from the first arrival to the last answer or
    the time limit, whether the limit cut it). done(1) after each request."""
    url = cfg.root + ENDPOINTS[cfg.endpoint]
    gate = asyncio.Semaphore(concurrency)
    results: list[RequestResult] = []
    arrivals = arrival_times(len(prompts), rate, random.Random(seed))

    async def one(prompt: Prompt) -> None:
        async with gate:
            results.append(await send_request(client, url, payload(cfg, model, prompt)))
        done(1)

    async def issue_all(start: float) -> None:
        tasks = []
        for prompt, at in zip(prompts, arrivals):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(prompt)))
        await asyncio.gather(*tasks)

    start = time.perf_counter()
    try:
        await asyncio.wait_for(issue_all(start), cfg.time_limit_s)
        time_limited = False
    except asyncio.TimeoutError:  # wait_for has cancelled the requests still running
        time_limited = True
    return results, time.perf_counter() - start, time_limited


def _send_from_processes(
    cfg: BenchConfig,
    model: str,
    prompts: list[Prompt],
    concurrency: int,
    processes: int,
    bar: Any,
) -> tuple[list[RequestResult], float, bool]:
    """_send_all's results from `processes` spawned processes, started together (a barrier:
    each has its client and its imports ready first); the point lasts as long as the slowest."""
    ctx = multiprocessing.get_context("spawn")
    barrier, answers, count = ctx.Barrier(processes + 1), ctx.Queue(), ctx.Value("i", 0)
    procs = []
    for i in range(processes):
        share = (
            prompts[i::processes],
            concurrency // processes + (i < concurrency % processes),
            cfg.request_rate / processes,
            cfg.seed if i == 0 else cfg.seed * 1000 + i,
        )
        procs.append(
            ctx.Process(
                target=_client_process,
                args=(cfg, model, share, barrier, answers, count),
                daemon=True,
            )
        )
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout=120)
    except threading.BrokenBarrierError:
        for proc in procs:
            proc.kill()
        raise BenchError(
            f"the {processes} client processes did not start within 120 s: run with "
            "--client-processes 1"
        ) from None
    results, durations, limited, shown = [], [], False, 0
    for _ in procs:
        while True:
            try:
                answer = answers.get(timeout=0.2)
                break
            except queue.Empty:
                bar.update(count.value - shown)
                shown = count.value
                if not any(p.is_alive() for p in procs) and answers.empty():
                    raise BenchError("a client process died without an answer") from None
        if isinstance(answer, str):  # its error
            for proc in procs:
                proc.kill()
            raise BenchError(f"a client process failed: {answer}")
        results += answer[0]
        durations.append(answer[1])
        limited = limited or answer[2]
    bar.update(count.value - shown)
    for proc in procs:
        proc.join(timeout=10)
    return results, max(durations), limited


def _client_process(
    cfg: BenchConfig,
    model: str,
    share: tuple[list[Prompt], int, float, int],
    barrier: Any,
    answers: Any,
    count: Any,
) -> None:
    """A spawned process's share of a point (_send_from_processes: its prompts, streams, rate
    and seed): its answer, or its error as a string, goes to `answers`."""

    def done(n: int) -> None:
        with count.get_lock():
            count.value += n

    async def main() -> tuple[list[RequestResult], float, bool]:
        async with _client(cfg, share[1]) as client:
            barrier.wait()
            return await _send_all(client, cfg, model, *share, done)

    try:
        answers.put(asyncio.run(main()))
    except BaseException as e:  # noqa: BLE001 (handed to the parent, which raises it)
        answers.put(f"{type(e).__name__}: {e}")


def _client(cfg: BenchConfig, streams: int) -> httpx.AsyncClient:
    """The HTTP client of a sweep: a connection for each stream and one for /metrics, no read
    timeout (a long stream is not a failure; the point's time limit bounds it)."""
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    n = streams + 1
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    return httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits)


def _progress(total: int, desc: str, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not show, leave=False)


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity (vLLM writes "inf" too)


# -- the sweep ---------------------------------------------------------------------------------


async def run_sweep(
    cfg: BenchConfig,
    prompts: list[Prompt],
    label: str | None = None,
    on_point: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Every concurrency in cfg.max_concurrency over the same prompts, after one warm-up
    request that checks the endpoint; returns the result (metadata + `points`). Stops early
    when a point completes nothing: the next ones would fail the same way."""
    try:
        import httpx  # noqa: F401 (here to fail early; _client imports it)
    except ImportError:
        raise BenchError("`outrider bench serve` needs httpx: pip install httpx") from None

    async with _client(cfg, max(cfg.max_concurrency)) as client:
        server = await _models(client, cfg)
        model = cfg.model or server[0]["id"]
        url = cfg.root + ENDPOINTS[cfg.endpoint]
        warm = dataclasses.replace(prompts[0], max_tokens=min(4, prompts[0].max_tokens))
        first = await send_request(client, url, payload(cfg, model, warm))
        if not first.ok:
            raise BenchError(
                f"the warm-up request to {url} failed ({first.error}): check --base-url, "
                f"--endpoint (completions or chat) and --model (sent {model!r})"
            )
        points = []
        for c in cfg.max_concurrency:
            point = await run_point(client, cfg, model, prompts, c, progress)
            points.append(point)
            if on_point is not None:
                on_point(point)
            if point["completed"] == 0:
                break
    config = dataclasses.asdict(cfg) | {"request_rate": _json_rate(cfg.request_rate)}
    config.pop("api_key")
    return {
        **run_metadata(),
        "base_url": cfg.base_url,
        "endpoint": ENDPOINTS[cfg.endpoint],
        "model": model,
        "label": label or model,
        "server_models": server,
        "config": config,
        "points": points,
    }


async def _models(client: httpx.AsyncClient, cfg: BenchConfig) -> list[dict]:
    """/v1/models' cards; [] when the server lists none and --model was given, an error when
    it was not."""
    import httpx

    url = cfg.root + "/v1/models"
    try:
        r = await client.get(url)
    except httpx.HTTPError as e:
        raise BenchError(
            f"could not reach {url} ({type(e).__name__}: {e}): is the server running, and is "
            f"--base-url {cfg.base_url!r} its root?"
        ) from None
    try:
        cards = r.json().get("data", []) if r.status_code == 200 else []
    except (json.JSONDecodeError, AttributeError):
        cards = []
    if not cards and cfg.model is None:
        raise BenchError(
            f"GET {url} answered {r.status_code} with no model: give one with --model NAME"
        )
    return cards


def run(cfg: BenchConfig, prompts: list[Prompt], **kwargs: Any) -> dict[str, Any]:
    """run_sweep from synchronous code."""
    return asyncio.run(run_sweep(cfg, prompts, **kwargs))


def write_result(result: dict[str, Any], out_dir: str | Path, filename: str | None = None) -> Path:
    """`out_dir`/`filename`, by default serve-<label>-<UTC time>.json."""
    if filename is None:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", result["label"]).strip("_") or "run"
        stamp = datetime.datetime.fromisoformat(result["date"]).strftime("%Y%m%d-%H%M%S")
        filename = f"serve-{safe}-{stamp}.json"
    path = Path(out_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
