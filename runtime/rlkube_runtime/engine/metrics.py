"""The built-in engine's /metrics, under SGLang's series names (`--enable-metrics`), so the
dashboard's engine panels and the driver's scrape (`serving/engine_metrics.py`) read either
engine the same way. Values are read off the scheduler when scraped: nothing is sampled or kept."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# The SGLang series (sglang/srt/metrics/collector.py) both engines serve and the dashboard shows.
RUNNING_REQUESTS = "sglang:num_running_reqs"
QUEUED_REQUESTS = "sglang:num_queue_reqs"
USED_TOKENS = "sglang:num_used_tokens"
GENERATION_TOKENS = "sglang:generation_tokens_total"
PROMPT_TOKENS = "sglang:prompt_tokens_total"
REQUESTS = "sglang:num_requests_total"
SGLANG_SERIES = (RUNNING_REQUESTS, QUEUED_REQUESTS, USED_TOKENS, GENERATION_TOKENS, PROMPT_TOKENS, REQUESTS)


class SchedulerCollector:
    """Collects the scheduler's counts at scrape time (prometheus_client's custom-collector API)."""

    def __init__(self, scheduler, model_name: str):
        self.scheduler, self.model_name = scheduler, model_name

    def collect(self) -> Iterator[Metric]:
        s, labels = self.scheduler, ["model_name"]
        load = s.load()
        for name, help_text, value in (
            (RUNNING_REQUESTS, "The number of running requests.", load["running"]),
            (QUEUED_REQUESTS, "The number of requests in the waiting queue.", load["waiting"]),
            (USED_TOKENS, "The number of tokens held in the KV cache.", load["kv_tokens"]),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=labels)
            gauge.add_metric([self.model_name], value)
            yield gauge
        for name, help_text, value in (
            (GENERATION_TOKENS, "Number of generation tokens processed.", s.generated_tokens),
            (PROMPT_TOKENS, "Number of prefill tokens processed.", s.prefill_tokens),
            (REQUESTS, "Number of requests processed.", s.finished_requests),
        ):
            counter = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=labels)
            counter.add_metric([self.model_name], value)
            yield counter


def metrics_text(scheduler, model_name: str) -> bytes:
    """The Prometheus text exposition of the scheduler's series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(scheduler, model_name))
    return generate_latest(registry)
