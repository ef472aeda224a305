"""Helpers for RLJobs on the real node: the example job made to measure, `kubectl get rljobs` read
as a user reads it, what a job left on its claim, and finding a process inside a pod.

A job's output directory (spec.model.save) lies on the checkpoint claim, and the claim is a
directory of this machine (tests/node/provisioner.py), so the tests read the run's files where
the pods wrote them.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from node import VOLUMES, Cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "manifests" / "examples" / "cluster-tiny.yaml"
CLAIM = REPO / "manifests" / "cluster" / "checkpoints-pvc.yaml"
RESULTS = Path(__file__).resolve().parent / ".results"


def tiny_job(name: str, *, placement: str = "separate", num_rollout: int, interval: int, **spec: Any) -> dict:
    """manifests/examples/cluster-tiny.yaml as `name`, writing to /ckpt/<name> on the claim;
    colocated: one trainer pod carries the engine and the router too. `spec` sections are merged in."""
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["name"] = name
    s = job["spec"]
    s["model"]["save"] = s["model"]["load"] = f"/ckpt/{name}"
    s["training"]["numRollout"] = num_rollout
    s["checkpoint"]["interval"] = interval
    if placement == "colocated":
        s["resources"]["placement"] = "colocated"
        del s["resources"]["rollout"]
    for key, value in spec.items():
        s[key] = {**s.get(key, {}), **value} if isinstance(value, dict) else value
    return job


def apply(cluster: Cluster, namespace: str, *objects: dict) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects))


def claim() -> dict:
    return yaml.safe_load(CLAIM.read_text())


def rljob(cluster: Cluster, namespace: str, name: str) -> dict:
    return cluster.get_json("rljob", "-n", namespace, name)


def table(cluster: Cluster, namespace: str) -> list[dict[str, str]]:
    """`kubectl get rljobs` rows as {column: cell}, cut at the header's column offsets (cells may be empty)."""
    lines = cluster.kubectl("-n", namespace, "get", "rljobs").stdout.rstrip().splitlines()
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    bounds = list(zip(starts, starts[1:] + [None]))
    return [{n: line[a:b].strip() for n, (a, b) in zip(names, bounds)} for line in lines[1:]]


@dataclass
class Watch:
    """What `kubectl get rljobs` showed of one job, row by row as it changed."""

    cluster: Cluster
    namespace: str
    name: str
    rows: list[dict[str, str]] = field(default_factory=list)

    def poll(self) -> dict[str, str]:
        [row] = [r for r in table(self.cluster, self.namespace) if r["NAME"] == self.name]
        shown = {k: v for k, v in row.items() if k != "AGE"}
        if not self.rows or shown != self.rows[-1]:
            self.rows.append(shown)
        return shown

    def until(self, predicate, timeout: float, what: str) -> dict[str, str]:
        """Poll every half second until `predicate(row)`; a Failed job or a timeout fails the
        test with the rows seen and the cluster's state."""
        deadline = time.monotonic() + timeout
        while True:
            row = self.poll()
            if predicate(row):
                return row
            if row.get("PHASE") == "Failed" or time.monotonic() > deadline:
                raise AssertionError(f"RLJob {self.namespace}/{self.name}: {what} not reached "
                                     f"({'Failed' if row.get('PHASE') == 'Failed' else f'{timeout:g} s'}); "
                                     f"rows seen:\n{self.history()}\n{describe(self.cluster, self.namespace, self.name)}")
            time.sleep(0.5)

    def history(self) -> str:
        return "\n".join("  " + "  ".join(f"{k}={v}" for k, v in r.items()) for r in self.rows)

    def phases(self) -> list[str]:
        out: list[str] = []
        for r in self.rows:
            if not out or out[-1] != r["PHASE"]:
                out.append(r["PHASE"])
        return out


def rollouts_done(row: dict[str, str]) -> int:
    """k of the PROGRESS column `k/N` (0 when empty)."""
    done = row.get("PROGRESS", "").split("/")[0]
    return int(done) if done.isdigit() else 0


def describe(cluster: Cluster, namespace: str, name: str) -> str:
    """The job's status, its objects and the tail of its head's log, for a failure message."""
    out = [cluster.kubectl("-n", namespace, "get", "rljobs,rayjobs,rayclusters,jobs,pods", "-o", "wide",
                           check=False).stdout]
    status = cluster.kubectl("-n", namespace, "get", "rljob", name, "-o", "jsonpath={.status}", check=False).stdout
    out.append(f"status: {status}")
    heads = cluster.kubectl("-n", namespace, "get", "pods", "-l", f"rlkube.io/rljob={name}", "-o", "name",
                            check=False).stdout.split()
    for pod in heads:
        if "head" in pod or "submitter" in pod or pod.split("/")[-1].startswith(f"{name}-"):
            log = cluster.kubectl("-n", namespace, "logs", pod, "--tail=30", check=False)
            out.append(f"--- {pod}:\n{log.stdout}{log.stderr}")
    return "\n".join(out)


def pods(cluster: Cluster, namespace: str, name: str, role: str | None = None) -> list[dict]:
    selector = f"rlkube.io/rljob={name}" + (f",rlkube.io/role={role}" if role else "")
    return cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]


def running_pod(cluster: Cluster, namespace: str, name: str, role: str, timeout: float = 120) -> dict:
    """The job's one Running, not terminating, pod of `role` (head, trainer, rollout)."""
    def find():
        live = [p for p in pods(cluster, namespace, name, role)
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
        return live[0] if len(live) == 1 else None

    return cluster.wait_for(find, timeout, f"one Running {role} pod of {namespace}/{name}")


def kill_in_pod(cluster: Cluster, namespace: str, pod: str, marker: str) -> list[int]:
    """SIGKILL every process in `pod` whose command line contains `marker` (Ray names its actor
    processes `ray::<Class>`); the pids killed. Python, because the images have no pkill."""
    script = (
        "import os, signal, sys\n"
        "hits = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()\n"
        "        and sys.argv[1].encode() in open(f'/proc/{p}/cmdline', 'rb').read()]\n"
        "[os.kill(p, signal.SIGKILL) for p in hits]\n"
        "print(hits)\n"
    )
    result = cluster.kubectl("-n", namespace, "exec", pod, "--", "python", "-c", script, marker)
    return json.loads(result.stdout)


def claim_dir(cluster: Cluster, namespace: str, claim_name: str) -> Path:
    """Where the claim's volume lies on this machine."""
    volume = cluster.get_json("pvc", "-n", namespace, claim_name)["spec"]["volumeName"]
    return VOLUMES / volume


@dataclass(frozen=True)
class Trained:
    """What a run trained, from its output directory: each rollout's last samples.jsonl record
    (a rollout redone after a crash is recorded again; only its last record is in the weights),
    how often each was recorded, and the rewards metrics.jsonl logged per rollout."""

    records: dict[int, dict[str, Any]]
    recorded: Counter
    rewards: dict[int, float]

    @classmethod
    def read(cls, out: Path) -> Trained:
        records: dict[int, dict[str, Any]] = {}
        recorded: Counter = Counter()
        for line in (out / "samples.jsonl").read_text().splitlines():
            record = json.loads(line)
            records[record["rollout"]] = record
            recorded[record["rollout"]] += 1
        rewards = {}
        for line in (out / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "rollout/raw_reward" in row:
                rewards[row["rollout"]] = row["rollout/raw_reward"]
        return cls(records, recorded, rewards)

    def groups_trained(self) -> Counter:
        return Counter(g for r in self.records.values() for g in r["group_indices"])

    def mean_reward(self, rollouts) -> float:
        values = [self.rewards[k] for k in rollouts]
        return sum(values) / len(values)


def copy_job(job: dict) -> dict:
    return copy.deepcopy(job)


class MemoryPeak:
    """The node's resident memory (its components, containerd's shims, every pod's containers)
    sampled every 2 s while a test runs; its high-water mark is appended to
    tests/pods/.results/memory.jsonl, where the README's figure comes from."""

    def __init__(self, cluster: Cluster, label: str, interval: float = 2.0):
        self.cluster, self.label, self.interval = cluster, label, interval
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                usage = self.cluster.node.memory()
            except OSError:  # a process ended between listing and reading it
                usage = {}
            if sum(usage.values()) > sum(self.peak.values()):
                self.peak = usage
            self._stop.wait(self.interval)

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        RESULTS.mkdir(exist_ok=True)
        record = {"test": self.label, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "peak_mib": round(sum(self.peak.values()) / 2**20),
                  "parts_mib": {k: round(v / 2**20) for k, v in self.peak.items()}}
        with open(RESULTS / "memory.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def dashboard_answers(cluster: Cluster, namespace: str, name: str, token: str | None) -> tuple[int, str]:
    """Status and body of the job's Ray job API (`GET /api/jobs/` on the head's dashboard port), asked
    as a stranger on the cluster network would: with no token, or with `token`."""
    import urllib.error
    import urllib.request

    head = running_pod(cluster, namespace, name, "head")
    port = next(p["containerPort"] for c in head["spec"]["containers"] for p in c.get("ports", [])
                if p.get("name") == "dashboard")
    request = urllib.request.Request(f"http://{head['status']['podIP']}:{port}/api/jobs/")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def ray_token(cluster: Cluster, namespace: str, name: str) -> str:
    """The token KubeRay made for the job's Ray cluster (the Secret named after the RayCluster)."""
    import base64

    raycluster = running_pod(cluster, namespace, name, "head")["metadata"]["labels"]["ray.io/cluster"]
    secret = cluster.get_json("secret", "-n", namespace, raycluster)
    return base64.b64decode(secret["data"]["auth_token"]).decode()
