"""The engines' own Prometheus series (SGLang's `sglang:*`; the built-in engine serves the same
names) passed through the driver's /metrics, each labelled with its RLJob and engine.

Engines listen on ports picked when they start and move when they restart, so nothing outside
the job can point a scrape at them; the driver knows where they are (the rollout manager tells it
after every rollout). A thread fetches every engine's /metrics each few seconds and the driver's
endpoint serves the latest answers: a scrape of the driver never waits on a busy or dead engine
(Prometheus would drop the whole scrape past its timeout). An engine whose last fetch failed is
left out and shows as `rlkube_engine_metrics_up 0`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

ENGINE_METRICS_UP = "rlkube_engine_metrics_up"
REFRESH_INTERVAL_S = 5.0
FETCH_TIMEOUT_S = 3.0  # under the refresh interval, with every engine fetched at once


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
    """A prometheus_client collector of the watched engines' latest answers (see the module
    docstring); `refresh()` fetches them, `start()` runs it every `interval_s` in a thread."""

    def __init__(self, job_name: str, fetch=fetch_metrics_text, interval_s: float = REFRESH_INTERVAL_S):
        self.job_name, self.interval_s = job_name, interval_s
        self._fetch = fetch
        self._urls: tuple[str, ...] = ()
        self._answers: dict[str, str | None] = {}  # url -> its last /metrics text, None if it failed
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, urls: Sequence[str]) -> None:
        """The engines to fetch from now on (replaces the last list; restarts move engines); collect()
        shows only these, so an engine no longer watched goes from the next scrape."""
        self._urls = tuple(urls)

    def refresh(self) -> None:
        urls = self._urls
        if not urls:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool:
            self._answers = dict(zip(urls, pool.map(self._fetch_or_none, urls)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rlkube-engine-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=FETCH_TIMEOUT_S + 1)

    def collect(self) -> Iterator[Metric]:
        answers = self._answers  # one snapshot for the whole scrape
        up = GaugeMetricFamily(ENGINE_METRICS_UP, "1 when the engine's own /metrics answered the driver's last fetch, "
                               "else 0.", labels=["rljob", "engine"])
        for url in self._urls:
            if url not in answers:
                continue  # not fetched yet
            text = answers[url]
            up.add_metric([self.job_name, engine_label(url)], 0.0 if text is None else 1.0)
            if text is not None:
                yield from relabelled(text_string_to_metric_families(text),
                                      {"rljob": self.job_name, "engine": engine_label(url)})
        yield up

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.refresh()

    def _fetch_or_none(self, url: str) -> str | None:
        try:
            return self._fetch(url)
        except Exception as err:  # a restarting engine; the next fetch tries again
            log.debug("engine metrics from %s: %s", url, err)
            return None
