"""Prometheus metrics, named after vLLM's with an `outrider:` prefix, or `vllm:` under
`--metrics-prefix vllm` (METRICS_PREFIXES), so vLLM's Grafana dashboards read outrider unchanged.

Each server owns its own CollectorRegistry (no process globals: two servers in one test process
do not share counts). Request-level series are observed from the engine thread as deltas
arrive; engine-wide gauges and counters (running, waiting, KV usage, preemptions, speculative
decoding) are read at scrape time from the engine thread's latest `EngineStats` snapshot.

    outrider:num_requests_running / _waiting            gauge
    outrider:kv_cache_usage_perc                        gauge, 0..1
    outrider:prompt_tokens_total / generation_tokens_total     counter
    outrider:request_success_total{finished_reason}     counter
    outrider:time_to_first_token_seconds                histogram
    outrider:inter_token_latency_seconds                histogram (per token)
    outrider:e2e_request_latency_seconds                histogram
    outrider:num_preemptions_total                      counter
    outrider:spec_decode_num_drafts_total / _num_draft_tokens_total / _num_accepted_tokens_total
    outrider:spec_decode_num_accepted_tokens_per_pos_total{position}
    outrider:tensor_parallel_size                       gauge
    outrider:collective_calls_total{mode, op} / collective_bytes_total{mode, op}   counter
    outrider:forwards_total{mode}                       counter

The collective series count rank 0's tensor-parallel collectives (op: all_reduce, all_gather,
broadcast) by the forward mode they ran under (decode, verify, prefill, draft, or other: step
headers and start-up), and forwards_total the target forwards rank 0 sent to the other ranks,
so rate(collective_calls_total{op="all_reduce"}) / rate(forwards_total) is what one forward
of that mode runs. Every rank runs the same collectives, so rank 0's counts are the group's
per-rank counts. On one rank nothing is counted: these counters have no samples and
tensor_parallel_size reads 1. CUDA graphs replay their collectives uncounted (distributed.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from outrider.core import RequestOutput
from outrider.server.async_engine import EngineStats
from outrider.server.config import METRICS_PREFIXES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_LONG_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(
        self, model_name: str, stats: Callable[[], EngineStats], prefix: str = "outrider"
    ) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix {prefix!r}: use one of {', '.join(METRICS_PREFIXES)}")
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self._labels = labels
        names = ("model_name",)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(f"{prefix}:{name}", doc, names + extra, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(
                f"{prefix}:{name}", doc, names, buckets=buckets, registry=self.registry
            )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**labels)
        self.request_success = counter(
            "request_success", "Requests finished, by reason.", ("finished_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LONG_BUCKETS
        ).labels(**labels)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS
        ).labels(**labels)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", _LONG_BUCKETS
        ).labels(**labels)
        self.registry.register(_EngineCollector(stats, model_name, prefix))

    # Called from the engine thread (prometheus_client is thread-safe).
    def on_delta(self, out: RequestOutput, since_last: float | None) -> None:
        """since_last: seconds since the request's previous tokens; None for its first delta
        (that wait is the time to first token, observed at finish)."""
        n = len(out.token_ids)
        if n == 0:
            return
        self.generation_tokens.inc(n)
        if since_last is not None:
            for _ in range(n):  # a speculative step brings n tokens after one wait
                self.itl.observe(since_last / n)

    def on_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.prompt_tokens.inc(m.get("num_prompt_tokens") or 0)
        self.request_success.labels(finished_reason=out.finish_reason, **self._labels).inc()
        if m.get("time_to_first_token_s") is not None:
            self.ttft.observe(m["time_to_first_token_s"])
        if m.get("e2e_latency_s") is not None:
            self.e2e.observe(m["e2e_latency_s"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine-wide series read from the latest snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, prefix: str) -> None:
        self._stats, self._model, self._prefix = stats, model_name, prefix

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        p = self._prefix
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=labels)
            g.add_metric([self._model], value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=labels)
            c.add_metric([self._model], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", s.kv_usage)
        yield gauge("num_free_kv_blocks", "KV blocks free or evictable.", s.num_free_blocks)
        yield counter("num_preemptions", "Preemptions (recompute) so far.", s.num_preemptions)
        yield counter("spec_decode_num_drafts", "Verify steps with drafts.", s.spec_num_drafts)
        yield counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            f"{p}:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first after the root).",
            labels=["model_name", "position"],
        )
        for pos, n in enumerate(s.spec_accepted_per_position):
            per_pos.add_metric([self._model, str(pos)], n)
        yield per_pos
        yield counter(
            "steps_run_ahead",
            "Decode steps launched before the step before them was read (async scheduling).",
            s.steps_run_ahead,
        )
        ledger = {
            name: CounterMetricFamily(f"{p}:engine_step_{name}", doc, labels=["model_name", "kind"])
            for name, doc in (
                ("count", "Engine steps by kind (prefill, decode, decode_ahead, verify, "
                 "verify_ahead: engine/step_ledger.py)."),
                ("seconds", "Seconds in engine steps by kind (schedule, launch, read, "
                 "bookkeeping)."),
                ("tokens", "Tokens engine steps emitted, by kind."),
                ("rows", "Sequences engine steps computed, by kind."),
            )
        }  # fmt: skip
        for kind, *values in s.step_ledger:
            for family, v in zip(ledger.values(), values):
                family.add_metric([self._model, kind], v)
        yield from ledger.values()
        yield gauge(
            "spec_decode_k",
            "Drafts the controller chose to verify in the last step (0: plain).",
            s.spec_k,
        )
        by_k = CounterMetricFamily(
            f"{p}:spec_decode_steps",
            "Decode steps by the number of drafts verified in them (0: a plain step).",
            labels=["model_name", "k"],
        )
        for k, n in s.spec_steps_by_k:
            by_k.add_metric([self._model, str(k)], n)
        yield by_k
        yield gauge("tensor_parallel_size", "Ranks the model is split over.", s.tp_size)
        calls = CounterMetricFamily(
            f"{p}:collective_calls",
            "Tensor-parallel collectives rank 0 ran, by forward mode and collective.",
            labels=["model_name", "mode", "op"],
        )
        nbytes = CounterMetricFamily(
            f"{p}:collective_bytes",
            "Bytes of those collectives, as the planner counts them (per rank; an all-gather "
            "counts its gathered output).",
            labels=["model_name", "mode", "op"],
        )
        for mode, op, n, b in s.collectives:
            calls.add_metric([self._model, mode, op], n)
            nbytes.add_metric([self._model, mode, op], b)
        yield calls
        yield nbytes
        forwards = CounterMetricFamily(
            f"{p}:forwards",
            "Target forwards sent to the other tensor-parallel ranks, by mode.",
            labels=["model_name", "mode"],
        )
        for mode, n in s.forwards:
            forwards.add_metric([self._model, mode], n)
        yield forwards
