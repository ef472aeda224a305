"""The real Prometheus (Debian's /usr/bin/prometheus, installed by build.sh) for tests: scraping
given targets every second, or whatever scrape configs a test hands it (e.g. Kubernetes service
discovery of the real node's pods), and answering range queries.

Stdlib and PyYAML only, so that the control-plane and the real-node tiers share it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS = "/usr/bin/prometheus"
BUILD_COMMAND = "bash tests/controlplane/build.sh"


class PrometheusMissing(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class Prometheus:
    """Prometheus scraping every second: `targets` ({job: host:port}, static) and/or the raw
    `scrape_configs` given."""

    def __init__(self, workdir: Path, targets: dict[str, str] | None = None,
                 scrape_configs: Iterable[dict[str, Any]] = ()):
        if not os.access(PROMETHEUS, os.X_OK):
            raise PrometheusMissing(f"{PROMETHEUS} is missing: run `{BUILD_COMMAND}` (it installs Debian's prometheus)")
        self.workdir = workdir
        self.port = _free_port()
        configs = [{"job_name": job, "static_configs": [{"targets": [target]}]} for job, target in (targets or {}).items()]
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": configs + list(scrape_configs),
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            _wait_until(self._ready, 60, "Prometheus to be ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        """Series the expression returns at any second in [start, end] (query_range, step 1 s):
        also what a run that has ended already had, without staleness in the way."""
        params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"})
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/query_range?{params}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:  # 400: the expression does not parse
            raise AssertionError(f"Prometheus refused {expr!r}: {exc.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def up(self, job: str) -> bool:
        return bool(self.query_range(f'up{{job="{job}"}} == 1', time.time() - 5, time.time()))

    def targets(self) -> list[dict[str, Any]]:
        """The active targets, as /api/v1/targets lists them (for a failure message)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/targets", timeout=10) as resp:
            return json.load(resp)["data"]["activeTargets"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def assert_every_query_returns_data(prom: Prometheus, queries: Iterable[tuple[str, str, str]], start: float,
                                    timeout: float, translate: Callable[[str], str] = lambda expr: expr) -> None:
    """Polls until each (dashboard, panel, query) has returned data at some point since `start`;
    `translate` makes a dashboard's query one Prometheus takes (Grafana's variables filled in)."""
    pending = set(queries)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for item in sorted(pending):
            if prom.query_range(translate(item[2]), start, time.time()):
                pending.discard(item)
        if pending:
            time.sleep(1)
    if pending:
        targets = "\n".join(f"  {t['scrapeUrl']}: {t['health']} (last scrape {t.get('lastScrapeDuration', 0):.2f} s) "
                            f"{t.get('lastError', '')}" for t in prom.targets())
        raise AssertionError("dashboard queries without data:\n" + "\n".join(f"  {f} / {w}: {e}" for f, w, e in sorted(pending))
                             + "\ntargets:\n" + targets)
