"""The API's Prometheus metrics, in a registry of their own (several apps in one process do not clash)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Failovers:
    """Peer failures routed around, read from the client when scraped (it counts them already)."""

    def __init__(self, read: Callable[[], int]):
        self.read = read

    def collect(self):
        yield CounterMetricFamily(
            "swarmlm_api_failovers", "Peer failures the client banned and routed around", value=self.read()
        )


class _Speculative:
    """What speculative decoding did (`swarmlm api --speculative`), read from the backend's totals when scraped."""

    def __init__(self, totals):
        self.totals = totals

    def collect(self):
        t = self.totals
        for name, value, text in (
            ("rounds", t.rounds, "Verification steps through the swarm (one round trip each)"),
            ("drafted", t.drafted, "Draft tokens proposed"),
            ("accepted", t.accepted, "Draft tokens kept (acceptance rate: accepted / drafted)"),
            ("tokens", t.tokens, "Tokens generated speculatively (tokens per round trip: tokens / rounds)"),
        ):
            yield CounterMetricFamily(f"swarmlm_api_speculative_{name}", text, value=value)


class ApiMetrics:
    def __init__(self, failovers: Callable[[], int], speculative=None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "swarmlm_api_requests", "Requests answered, by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.time_to_first_token = Histogram(
            "swarmlm_api_time_to_first_token_seconds",
            "From a request's arrival (queueing included) to its first token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.time_per_token = Histogram(
            "swarmlm_api_time_per_output_token_seconds",
            "Between consecutive generated tokens of one request",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter("swarmlm_api_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("swarmlm_api_completion_tokens", "Tokens generated", registry=r)
        self.cancelled = Counter(
            "swarmlm_api_cancelled_generations", "Generations stopped because their client went away", registry=r
        )
        self.active = Gauge(
            "swarmlm_api_active_sessions", "Generations running now (one inference session each)", registry=r
        )
        self.queued = Gauge("swarmlm_api_queued_requests", "Requests waiting for a generation slot", registry=r)
        r.register(_Failovers(failovers))
        if speculative is not None:
            r.register(_Speculative(speculative))

    def render(self) -> bytes:
        return generate_latest(self.registry)
