"""The engines' own Prometheus series (SGLang's `sglang:*`; the built-in engine serves the same
names) passed through the driver's /metrics, each labelled with its RLJob and engine.

Engines listen on ports picked when they start and move when they restart, so nothing outside
the job can point a scrape at them; the driver knows where they are (the rollout manager tells it
after every rollout) and fetches each one's /metrics when Prometheus scrapes the driver. An engine
that does not answer in time is left out of that scrape and shows as `rlkube_engine_metrics_up 0`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

ENGINE_METRICS_UP = "rlkube_engine_metrics_up"
# Under Prometheus' default scrape timeout (10 s), with every engine fetched at once.
FETCH_TIMEOUT_S = 3.0


def engine_label(url: str) -> str:
    """host:port of an engine URL: what tells engines apart on the dashboard."""
    return urllib.parse.urlsplit(url).netloc


def relabelled(families: Iterator[Metric], labels: dict[str, str]) -> Iterator[Metric]:
    """The same families with `labels` added to every sample (replacing any of the same name)."""
    for family in families:
        out = Metric(family.name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            out.add_sample(sample.name, {**sample.labels, **labels}, sample.value, sample.timestamp, sample.exemplar)
        yield out


def fetch_metrics_text(url: str, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout_s) as response:
        return response.read().decode("utf-8")


class EngineMetricsScrape:
    """A prometheus_client collector: on each collect, every watched engine's series, relabelled."""

    def __init__(self, job_name: str, fetch=fetch_metrics_text):
        self.job_name = job_name
        self._fetch = fetch
        self._urls: tuple[str, ...] = ()

    def watch(self, urls: Sequence[str]) -> None:
        """The engines to scrape from now on (replaces the last list; restarts move engines)."""
        self._urls = tuple(urls)

    def collect(self) -> Iterator[Metric]:
        urls = self._urls  # one list for the whole scrape, whatever watch() does meanwhile
        up = GaugeMetricFamily(ENGINE_METRICS_UP, "1 when the engine's own /metrics answered the last scrape, else 0.",
                               labels=["rljob", "engine"])
        if not urls:
            yield up
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool:
            texts = list(pool.map(self._fetch_or_none, urls))
        for url, text in zip(urls, texts):
            up.add_metric([self.job_name, engine_label(url)], 0.0 if text is None else 1.0)
            if text is not None:
                yield from relabelled(text_string_to_metric_families(text),
                                      {"rljob": self.job_name, "engine": engine_label(url)})
        yield up

    def _fetch_or_none(self, url: str) -> str | None:
        try:
            return self._fetch(url)
        except Exception as err:  # a restarting engine; the next scrape tries again
            log.debug("engine metrics from %s: %s", url, err)
            return None
