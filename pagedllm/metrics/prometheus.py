"""Prometheus exporter under vLLM's metric names and labels, so vLLM's dashboards and alerts work.

    vllm:num_requests_running{model_name="SmolLM2-135M-Instruct"} 3.0
    vllm:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.125
    vllm:request_success_total{finished_reason="stop",model_name="..."} 17.0

Besides vLLM 0.21's names, the older names that vLLM's own Grafana dashboard still queries are
exported with the same values (vllm:gpu_cache_usage_perc, vllm:time_per_output_token_seconds,
vllm:num_requests_swapped: always 0, a swapped request waits in the waiting queue here); the test
holds the dashboard's list of names (tests/metrics/grafana_metric_names.txt) against /metrics.
The project's own metrics, which vLLM has no name for, keep the `pagedllm:` prefix
(pagedllm:request_rejected_total, pagedllm:num_admitted_seqs).

Each logger owns its own CollectorRegistry, so several servers (or tests) in one process do not
collide in prometheus_client's global registry. The metric objects are attributes named after the
metric (`self.request_success[reason]`, `self.e2e_request_latency`, ...) for other modules to use.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.metrics.stats import IterationStats


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for each of `values`, with one update of the sum and of each bucket hit
    instead of a locked update per value (the inter-token latencies are one value per stream per step:
    ~5% of the frontend's samples at 256 streams, BENCHMARKS.md issue 16, h39). Reads prometheus_client's
    histogram fields (`_upper_bounds`, `_buckets`, `_sum`, stable since 0.4); without them, observe()."""
    if not values:
        return
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for v in values:
            histogram.observe(v)
        return
    # observe() counts a value in the first bucket whose upper bound is >= it; the last bound is +Inf.
    for i, n in Tally(bisect_left(bounds, v) for v in values).items():
        buckets[i].inc(n)
    total.inc(sum(values))


PREFIX = "vllm:"
PROJECT_PREFIX = "pagedllm:"
FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("queue_full", "shutting_down")

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value. 100 -> [1, 2, 5, 10, 20, 50, 100]"""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    def __init__(self, model_name: str, cache_info: dict[str, str] | None = None, max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        token_buckets = build_1_2_5_buckets(max_model_len)

        def gauge(name: str, doc: str, prefix: str = PREFIX) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            # prometheus_client adds the `_total` suffix to counters.
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        # -- engine state ----------------------------------------------------------------------------
        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.num_requests_swapped = gauge(
            "num_requests_swapped", "Older vLLM's swapped queue: always 0 (swapped requests wait in the waiting queue)."
        )
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage_perc = gauge("gpu_cache_usage_perc", "Older vLLM's name of vllm:kv_cache_usage_perc.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # -- tokens ------------------------------------------------------------------------------------
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        # -- requests ----------------------------------------------------------------------------------
        success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests (one per sequence, n > 1 counts each choice).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success_family = success
        # -- latencies ---------------------------------------------------------------------------------
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Older vLLM's name of vllm:inter_token_latency_seconds.", ITL_BUCKETS
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request (server: from arrival to the first token).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        # -- not in vLLM: the server's admission control -------------------------------------------
        rejected = Counter(
            PROJECT_PREFIX + "request_rejected",
            "Requests refused before reaching the engine: queue_full (503, --max-num-queued-reqs) or "
            "shutting_down (503 while draining).",
            ["model_name", "reason"],
            registry=r,
        )
        self.request_rejected = {reason: rejected.labels(model_name, reason) for reason in REJECT_REASONS}
        self.num_admitted_seqs = gauge(
            "num_admitted_seqs", "Sequences admitted by the server and not finished (running, waiting or tokenizing).",
            prefix=PROJECT_PREFIX,
        )
        if cache_info:
            info = Gauge(PREFIX + "cache_config_info", "Information of the KV cache config.", sorted(cache_info),
                         registry=r)
            info.labels(**cache_info).set(1)
        # SchedulerStats' counters are cumulative; Prometheus counters take increments.
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            s = scheduler_stats
            self.num_requests_running.set(s.num_running_reqs)
            self.num_requests_waiting.set(s.num_waiting_reqs)
            self.kv_cache_usage_perc.set(s.kv_cache_usage)
            self.gpu_cache_usage_perc.set(s.kv_cache_usage)
            self._last_preemptions = self._inc(self.num_preemptions, s.num_preemptions, self._last_preemptions)
            self._last_queries = self._inc(self.prefix_cache_queries, s.prefix_cache_queries, self._last_queries)
            self._last_hits = self._inc(self.prefix_cache_hits, s.prefix_cache_hits, self._last_hits)
        if iteration_stats is None:
            return
        it = iteration_stats
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_prompt_tokens or it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        observe_many(self.time_to_first_token, it.time_to_first_tokens)
        observe_many(self.inter_token_latency, it.inter_token_latencies)
        observe_many(self.time_per_output_token, it.inter_token_latencies)
        observe_many(self.request_queue_time, it.queue_times)
        for f in it.finished_requests:
            self.record_finished(f.finish_reason)
            self.e2e_request_latency.observe(f.e2e_latency)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
            self.request_max_num_generation_tokens.observe(f.num_generation_tokens)
            self.request_params_n.observe(f.n_param)
            if f.max_tokens_param is not None:
                self.request_params_max_tokens.observe(f.max_tokens_param)
            self.request_prefill_time.observe(f.prefill_time)
            self.request_decode_time.observe(f.decode_time)
            self.request_inference_time.observe(f.prefill_time + f.decode_time)
            if f.num_generation_tokens > 1:
                self.request_time_per_output_token.observe(f.decode_time / (f.num_generation_tokens - 1))

    def record_finished(self, finish_reason: str) -> None:
        """Count one finished sequence under vllm:request_success_total{finished_reason=...}."""
        counter = self.request_success.get(finish_reason)
        if counter is None:
            counter = self.request_success[finish_reason] = self._success_family.labels(self.model_name, finish_reason)
        counter.inc()

    def record_rejection(self, reason: str) -> None:
        self.request_rejected[reason].inc()

    def set_admitted(self, num_seqs: int) -> None:
        self.num_admitted_seqs.set(num_seqs)

    @staticmethod
    def _inc(counter: Counter, cumulative: int, last: int) -> int:
        if cumulative > last:
            counter.inc(cumulative - last)
        return max(cumulative, last)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST
