"""The real sglang-router as a child process, and its worker API: the engines are added to it and
removed from it one by one as they start, die and are replaced."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rlkube_runtime.serving.auth import job_api_key
from rlkube_runtime.serving.launch import (
    PORT_ATTEMPTS,
    ManagedProcess,
    ProcessStartError,
    free_port,
    http_request,
    port_was_taken,
)
from rlkube_runtime.serving.sglang_args import ArgValue, cli_flags

# sglang-router 0.3.2 facts this module relies on (checked against the installed package): workers
# are managed with `POST /workers {"url"}` (202, queued), `GET /workers` and
# `DELETE /workers/{id}`; the router stays up with zero workers; on registration it probes a
# worker's `/health`, `/server_info` and `/model_info`, then polls `/health` and `/get_load`.


class RouterProcess:
    """The real sglang-router (its Rust router, started by serving/router_main.py) and its worker API."""

    def __init__(
        self,
        worker_urls: Sequence[str] = (),
        *,
        log_dir: str,
        model_path: str | None = None,
        host: str = "127.0.0.1",  # local only; the rollout manager passes its node's IP
        port: int | None = None,
        prometheus_port: int | None = None,
        router_args: Mapping[str, ArgValue] | None = None,
        startup_timeout_s: float = 60.0,
        api_key: str | None = None,
    ):
        self.initial_workers = list(worker_urls)
        self.log_path = pathlib.Path(log_dir) / "router.log"
        self.model_path = model_path
        self.host = host
        self._own_ports = port is None and prometheus_port is None
        self.port = port or free_port(host)
        self.prometheus_port = prometheus_port or free_port(host)
        self.router_args = dict(router_args or {})
        self.startup_timeout_s = startup_timeout_s
        # Required of every caller but health checks, and passed on to the engines (theirs too).
        self.api_key = api_key if api_key is not None else job_api_key()
        self.url = f"http://{host}:{self.port}"
        self._process: ManagedProcess | None = None

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "rlkube_runtime.serving.router_main", "--host", self.host, "--port", str(self.port),
                   "--prometheus-port", str(self.prometheus_port), "--prometheus-host", self.host]
        if self.initial_workers:
            command += ["--worker-urls", *self.initial_workers]
        if self.model_path and pathlib.Path(self.model_path).exists():
            # A local path only: given a hub name the router would try to download a tokenizer.
            command += ["--model-path", self.model_path]
        return command + cli_flags({"api-key": self.api_key or None}) + cli_flags(self.router_args)

    def start(self) -> RouterProcess:
        """Start the router and wait until it answers and every initial worker is healthy in it.
        Ports it picked itself are picked again when another program took them first."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._process = ManagedProcess(self.command(), log_path=self.log_path)
            try:
                self._process.wait_until_ready(self.url, "/workers", self.startup_timeout_s, "sglang-router",
                                               api_key=self.api_key)
                break
            except ProcessStartError as err:
                if attempt == PORT_ATTEMPTS or not port_was_taken(err) or not self._own_ports:
                    raise
            self.port, self.prometheus_port = free_port(self.host), free_port(self.host)
            self.url = f"http://{self.host}:{self.port}"
        for url in self.initial_workers:
            self._wait_for(lambda url=url: self._find(url, healthy=True) is not None, f"worker {url} to become healthy")
        return self

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def alive(self) -> bool:
        return self._process is not None and self._process.alive()

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()

    def workers(self) -> list[dict[str, Any]]:
        """`GET /workers`: each worker's id, url, is_healthy, load and metadata."""
        status, body = http_request("GET", f"{self.url}/workers", api_key=self.api_key)
        _expect(status, body, 200, "GET /workers")
        return json.loads(body)["workers"]

    def add_worker(self, url: str, *, wait: bool = True) -> None:
        """Register `url`; with `wait`, return once the router lists it as healthy."""
        status, body = http_request("POST", f"{self.url}/workers", {"url": url}, api_key=self.api_key)
        _expect(status, body, (200, 201, 202), f"POST /workers {url}")
        if wait:
            self._wait_for(lambda: self._find(url, healthy=True) is not None, f"worker {url} to be added")

    def remove_worker(self, url: str, *, wait: bool = True) -> bool:
        """Deregister `url` (False if the router did not list it); with `wait`, until it is gone."""
        worker = self._find(url)
        if worker is None:
            return False
        status, body = http_request("DELETE", f"{self.url}/workers/{worker['id']}", api_key=self.api_key)
        _expect(status, body, (200, 202, 204), f"DELETE /workers/{worker['id']} ({url})")
        if wait:
            self._wait_for(lambda: self._find(url) is None, f"worker {url} to be removed")
        return True

    def _find(self, url: str, *, healthy: bool = False) -> dict[str, Any] | None:
        for worker in self.workers():
            if worker["url"].rstrip("/") == url.rstrip("/") and (worker.get("is_healthy", True) or not healthy):
                return worker
        return None

    def _wait_for(self, condition, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if not self.alive():
                raise ProcessStartError(f"sglang-router exited while waiting for {what}; last lines of {self.log_path}:\n"
                                        f"{self._process.log_tail() if self._process else ''}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router at {self.url}: timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.05)


def _expect(status: int, body: bytes, ok: int | tuple[int, ...], what: str) -> None:
    if status not in ((ok,) if isinstance(ok, int) else ok):
        raise RuntimeError(f"sglang-router {what} answered HTTP {status}: {body[:500].decode(errors='replace')}")
