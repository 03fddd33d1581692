"""The server's Prometheus metrics, named after vLLM's (``vllm:`` becomes ``xpuspec:``).

Counters of finished requests (tokens, speculative drafts and accepted tokens, by position as vLLM's
``spec_decode_num_accepted_tokens_per_pos``), histograms of time to first token and between tokens, and gauges read
at each scrape (requests running and waiting, KV blocks in use), and the prefix cache's queries and hits in tokens
(vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``: counters read from the cache's own counts at each
scrape). Each :class:`ServerMetrics` has its own registry.
"""

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily

from .backend import Finished

PREFIX = "xpuspec:"
#: Seconds: vLLM's buckets for time to first token and inter-token latency, cut to a CPU's range.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5)


class ServerMetrics:
    """Prometheus metrics of one server.

    Args:
        model: the served model's name (label ``model_name``, as vLLM's).
        running, waiting, kv_blocks: read at each scrape.
        prefix_cache: ``() -> (queries, hits)``, the prefix cache's counts since the model loaded.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, running: Callable[[], float], waiting: Callable[[], float],
                 kv_blocks: Callable[[], float], prefix_cache: Callable[[], tuple] = lambda: (0, 0)):
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests.")
        self.requests = counter("request_success", "Finished requests, by finish reason.", ["finished_reason"])
        self.drafts = counter("spec_decode_num_drafts", "Speculative rounds that verified draft tokens.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", ["position"])
        registry.register(_PrefixCacheCounters(model, prefix_cache))
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Seconds from arrival to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Seconds between consecutive tokens.",
                             labels, buckets=ITL_BUCKETS, registry=registry)
        for name, doc, read in (("num_requests_running", "Requests generating.", running),
                                ("num_requests_waiting", "Requests queued for a place to run.", waiting),
                                ("kv_blocks_in_use", "KV-cache blocks held by running requests.", kv_blocks)):
            Gauge(PREFIX + name, doc, labels, registry=registry).labels(model).set_function(read)
        self.model = model

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def between_tokens(self, seconds: float) -> None:
        self.itl.labels(self.model).observe(seconds)

    def finished(self, finished: Finished, reason: str) -> None:
        """Count a finished request (``reason``: its OpenAI ``finish_reason``, or ``abort`` for a client gone)."""
        m = self.model
        self.prompt_tokens.labels(m).inc(finished.prompt_tokens)
        self.generation_tokens.labels(m).inc(finished.completion_tokens)
        self.requests.labels(m, reason).inc()
        spec = finished.speculative
        if spec is None:
            return
        self.drafts.labels(m).inc(spec.num_drafts)
        self.draft_tokens.labels(m).inc(spec.num_draft_tokens)
        self.accepted_tokens.labels(m).inc(spec.num_accepted_tokens)
        for position, accepted in enumerate(spec.accepted_per_position):
            self.accepted_per_pos.labels(m, str(position)).inc(accepted)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCounters:
    """``prefix_cache_queries`` and ``prefix_cache_hits``: counters whose values are the prefix cache's own counts,
    read at each scrape (a Prometheus custom collector)."""

    def __init__(self, model: str, read: Callable[[], tuple]):
        self.model, self.read = model, read

    def collect(self):
        queries, hits = self.read()
        for name, doc, value in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries),
                                 ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family
