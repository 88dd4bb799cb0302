"""The inference process's Prometheus metrics, labelled by model (never by request)."""

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from consumers.inference.engine.prefix import PrefixStats

_TIME = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30)


class InferenceMetrics:
    def __init__(self) -> None:
        self.batch_size = Histogram(
            "arena_batch_size",
            "Requests in a decode step",
            ["model"],
            buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128),
        )
        self.queue_wait = Histogram(
            "arena_queue_wait_seconds", "Gateway receipt to start of compute", ["model"], buckets=_TIME
        )
        self.ttft = Histogram("arena_ttft_seconds", "Gateway receipt to first token", ["model"], buckets=_TIME)
        self.tpot = Histogram(
            "arena_time_per_output_token_seconds",
            "Decode time per output token",
            ["model"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
        )
        self.tokens = Counter("arena_tokens_generated_total", "Tokens generated", ["model"])
        self.requests = Counter("arena_inference_requests_total", "Requests ended", ["model", "outcome"])
        self.running = Gauge("arena_requests_running", "Requests in the running batch", ["model"])
        self.waiting = Gauge("arena_requests_waiting", "Requests waiting to join a batch", ["model"])
        self.step_threads = Gauge(
            "arena_engine_step_threads",
            "torch threads of the engine's last step: more while no other engine of the machine steps",
            ["model"],
        )
        self.deadline_misses = Counter("arena_deadline_misses_total", "Requests past their deadline", ["model"])
        self.redeliveries = Counter("arena_redeliveries_total", "Messages delivered more than once")
        self.resumed_tokens = Counter(
            "arena_resumed_tokens_total", "Tokens a taken-over request did not regenerate (already delivered)"
        )
        self.chunks_resent = Counter(
            "arena_chunks_resent_total", "Chunks sent again at once: their ack was lost with the NATS connection"
        )
        self.upstream_busy = Counter(
            "arena_upstream_busy_total", "Upstream answers 429 or 503 (waited out, then tried again)", ["model"]
        )
        self.upstream_failures = Counter(
            "arena_upstream_failures_total", "Upstream connections refused or broken, and its 5xx answers", ["model"]
        )
        self.upstream_circuit_open = Gauge(
            "arena_upstream_circuit_open", "1 while an upstream model's circuit is open", ["model"]
        )
        self.steps = Counter("arena_engine_steps_total", "Engine steps run", ["model"])
        self.prefix_hits = Counter(
            "arena_prefix_cache_hits_total", "Prompts that reused a cached prefix's keys and values", ["model"]
        )
        self.prefix_misses = Counter(
            "arena_prefix_cache_misses_total",
            "Prompts prefilled whole (no cached prefix of a block or more)",
            ["model"],
        )
        self.prefix_reused_tokens = Counter(
            "arena_prefix_cache_reused_tokens_total",
            "Prompt tokens not prefilled: their keys and values were cached",
            ["model"],
        )
        self.prefix_evictions = Counter(
            "arena_prefix_cache_evictions_total", "Cached sequences dropped for the budget", ["model"]
        )
        self.prefix_bytes = Gauge("arena_prefix_cache_bytes", "Bytes of keys and values in the prefix cache", ["model"])
        self.watchdog_reaped = Counter(
            "arena_watchdog_reaped_total", "Jobs failed by the watchdog: still open past their deadline", ["model"]
        )


METRICS = InferenceMetrics()


class PrefixCounts:
    """An engine's prefix-cache totals (:class:`~consumers.inference.engine.prefix.PrefixStats`,
    read after its steps, or sent up by its engine process) into the counters: what grew
    since the last reading. A new engine process starts from zero, and so does this."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.seen = PrefixStats()

    def update(self, stats: PrefixStats | None) -> None:
        if stats is None:
            return
        seen = self.seen
        if stats.hits + stats.misses < seen.hits + seen.misses:  # a new engine: counted from zero again
            seen = PrefixStats()
        m = self.model
        METRICS.prefix_hits.labels(m).inc(max(0, stats.hits - seen.hits))
        METRICS.prefix_misses.labels(m).inc(max(0, stats.misses - seen.misses))
        METRICS.prefix_reused_tokens.labels(m).inc(max(0, stats.reused_tokens - seen.reused_tokens))
        METRICS.prefix_evictions.labels(m).inc(max(0, stats.evictions - seen.evictions))
        METRICS.prefix_bytes.labels(m).set(stats.bytes)
        self.seen = stats


class PoolCollector:
    """The model pool's counters, read from the pool itself at scrape time."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        st = self.pool.stats
        yield CounterMetricFamily("arena_pool_hits", "Acquires served by a resident model", value=st.hits)
        yield CounterMetricFamily("arena_pool_misses", "Acquires that waited for a load", value=st.misses)
        yield CounterMetricFamily("arena_pool_evictions", "Models evicted to make room", value=st.evictions)
        yield CounterMetricFamily("arena_model_loads", "Model loads (reloads included)", value=st.loads)
        yield CounterMetricFamily("arena_model_load_seconds", "Seconds spent loading models", value=st.load_seconds)
        yield GaugeMetricFamily("arena_pool_resident_bytes", "Bytes of resident model weights", value=st.resident_bytes)
        resident = GaugeMetricFamily("arena_pool_resident", "1 for each resident model", labels=["model"])
        for name in self.pool.resident():
            resident.add_metric([name], 1)
        yield resident


class LoadCollector:
    """Each model's step figures as this worker's heartbeats carry them (what admission
    judges by: `events.fleet.EngineLoad`), read from the service at scrape time."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        steps = GaugeMetricFamily(
            "arena_engine_step_seconds",
            "Decode step time measured (alone: one request; small and full: the batches' typical step)",
            labels=["model", "batch"],
        )
        share = GaugeMetricFamily(
            "arena_engine_prefill_share",
            "Share of the last seconds' step time newcomers' prefills took",
            labels=["model"],
        )
        for model, load in self.service.load().items():
            for batch, value in (("alone", load.alone_step_s), ("small", load.step_s), ("full", load.full_step_s)):
                if value is not None:
                    steps.add_metric([model, batch], value)
            share.add_metric([model], load.prefill_share)
        yield steps
        yield share


def register_pool(pool, service=None) -> None:
    """The pool's collector, and with `service` its models' step figures (`LoadCollector`)."""
    REGISTRY.register(PoolCollector(pool))
    if service is not None:
        REGISTRY.register(LoadCollector(service))
