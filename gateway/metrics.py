"""The gateway's Prometheus metrics (one registry per process)."""

from prometheus_client import Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests = Counter("arena_req_total", "Chat requests answered", ["model", "status"])
        self.latency = Histogram(
            "arena_req_latency_seconds",
            "End-to-end request latency",
            ["model"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60),
        )
        self.ttft = Histogram(
            "arena_time_to_first_token_seconds",
            "Time to first streamed token",
            ["model"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 15),
        )
        self.in_flight = Gauge("arena_requests_in_flight", "Requests waiting for an answer", ["model"])
        self.idempotent_hits = Counter("arena_idempotent_hits_total", "Retries answered from an earlier request")
        self.rejections = Counter("arena_rejections_total", "Requests refused", ["reason"])
        self.admission_margin = Gauge(
            "arena_admission_margin", "The margin admission multiplies step times by, learned per model", ["model"]
        )
        #: Read from gateway.edge.WebSocketProtocol.open where uvicorn serves (gateway.app.main).
        self.websockets = Gauge("arena_websockets_open", "Open WebSocket connections")
        self.live_skipped = Counter(
            "arena_live_messages_skipped_total", "Messages on a request's live subject that were no event, skipped"
        )
        self.votes_not_counted = Counter(
            "arena_votes_not_counted_total",
            "Arena votes cast that do not count, by the rule that took them out",
            ["rule"],
        )
        self.vote_checks_skipped = Counter(
            "arena_vote_checks_skipped_total", "Arena votes counted without their history rules (Redis or NATS down)"
        )
        self.websocket_idle_closes = Counter(
            "arena_websocket_idle_closes_total", "WebSockets closed after ws_idle_timeout_s with no frame"
        )


METRICS = GatewayMetrics()
