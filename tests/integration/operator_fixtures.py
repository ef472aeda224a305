"""The rlkube operator as a real process against the test control plane, plus small kubectl helpers
for tests/integration/test_operator.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from harness import ControlPlane, ControlPlaneError

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    """`rlkube operator --standalone` in a subprocess, logging to `log_path`."""

    def __init__(self, cp: ControlPlane, log_path: Path, env: dict[str, str] | None = None):
        self.cp = cp
        self.log_path = log_path
        self.extra_env = env or {}
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 60) -> OperatorProcess:
        env = self.cp.env()
        env.update(
            PYTHONUNBUFFERED="1",
            RLKUBE_LIVENESS_ENDPOINT=f"http://127.0.0.1:{self.liveness_port}/healthz",
            **self.extra_env,
        )
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== operator start {time.strftime('%H:%M:%S')} =====\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rlkube_runtime.cli", "operator", "--standalone",
                 "--metrics-port", str(self.metrics_port)],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self._live():
            if self.process.poll() is not None:
                raise ControlPlaneError(f"the operator exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"the operator did not come up in {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (kopf stops gracefully), SIGKILL after `timeout`; returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _live(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample (0 when absent)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        pattern = re.compile(rf"^{re.escape(name)}(\{{(?P<labels>[^}}]*)\}})? (?P<value>\S+)$")
        for line in self.metrics().splitlines():
            m = pattern.match(line)
            if m and (m.group("labels") or "") == want:
                return float(m.group("value"))
        return 0.0

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def kubectl_json(cp: ControlPlane, *args: str) -> Any:
    return json.loads(cp.kubectl(*args, "-o", "json").stdout)


def get_or_none(cp: ControlPlane, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
    proc = cp.kubectl("-n", namespace, "get", kind, name, "-o", "json", check=False)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr or "not found" in proc.stderr:
            return None
        raise ControlPlaneError(proc.stderr)
    return json.loads(proc.stdout)


def apply_file(cp: ControlPlane, path: Path, text: str, namespace: str) -> subprocess.CompletedProcess[str]:
    """`kubectl apply -f FILE` (client-side, as a user would); not checked."""
    path.write_text(text)
    return cp.kubectl("-n", namespace, "apply", "-f", str(path), check=False)


def patch_status(cp: ControlPlane, namespace: str, kind: str, name: str, status: dict[str, Any]) -> None:
    cp.kubectl("-n", namespace, "patch", kind, name, "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": status}))


def rfc3339_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def token_kubeconfig(cp: ControlPlane, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig authenticating as the service account, with a token from the TokenRequest API."""
    token = cp.kubectl("-n", namespace, "create", "token", service_account, "--duration=10m").stdout.strip()
    admin = yaml.safe_load(Path(cp.kubeconfig).read_text())
    cluster = admin["clusters"][0]
    path.write_text(json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": cluster["name"], "user": service_account,
                                                 "namespace": namespace}}],
        "current-context": "sa",
    }))
    os.chmod(path, 0o600)
    return path
