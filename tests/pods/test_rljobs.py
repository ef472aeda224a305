"""RLJobs on real pods, as a user runs them: `helm install` the chart, `kubectl apply` the tiny CPU
job (manifests/examples/cluster-tiny.yaml) in both placements and watch `kubectl get rljobs`; then
the fault-tolerance paths on the pods themselves (a rollout pod deleted, the trainer process killed,
the head pod deleted with a grace period, suspend and resume, the RLJob deleted), and Prometheus
scraping the operator's and the job's pods the way the chart's ServiceMonitor and PodMonitor select
them, every Grafana panel's query returning data.

What a run trained is read from its output directory on the claim (a directory of this machine):
samples.jsonl has one record per trained rollout, in the order they were trained, so a rollout
redone after a crash appears again; the last record of each rollout is what the weights hold.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from node import Cluster
from prometheus_server import Prometheus, assert_every_query_returns_data
from rljob_pods import (
    MemoryPeak,
    Trained,
    Watch,
    apply,
    claim,
    claim_dir,
    dashboard_answers,
    kill_in_pod,
    pods,
    ray_token,
    rljob,
    rollouts_done,
    running_pod,
    tiny_job,
)

pytestmark = [pytest.mark.pods, pytest.mark.slow, pytest.mark.xdist_group("pods")]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlkube"
OPERATOR_NAMESPACE = "rlkube-system"
MOUNT = "/ckpt"  # where the example job mounts the claim
GROUPS_PER_ROLLOUT = 16  # rollout.batchSize of the example
# What the operator creates for a job (kubectl get ... -l rlkube.io/rljob=<name>).
OWNED_KINDS = "rayjobs,rayclusters,pods,services,configmaps,serviceaccounts,roles,rolebindings,networkpolicies"


def _module(name: str, path: Path):
    """A test helper module by its path, the one copy of it: registered before it runs, as
    dataclasses need (chaos_outcome defines some), and shared with the suites that import it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chart = _module("chart_render", REPO / "tests" / "unit" / "test_chart_render.py")
chaos = _module("chaos_outcome", REPO / "tests" / "chaos" / "chaos_outcome.py")  # the chaos table's figures


@pytest.fixture(scope="module")
def operator(cluster: Cluster, operator_image: str) -> str:
    """The chart installed as the README says (release rlkube), reconciling every few seconds; its
    operator pod Ready under its own service account. Yields the release's namespace."""
    t0 = time.monotonic()
    cluster.helm("install", "rlkube", str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
                 "--set", "operator.resyncSeconds=5", "--set", "operator.maxBackoffSeconds=5",
                 "--wait", "--timeout", "120s")
    try:
        [pod] = cluster.get_json("pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=rlkube")["items"]
        assert pod["spec"]["containers"][0]["image"] == operator_image
        assert pod["spec"]["serviceAccountName"] == "rlkube"
        # The release name the README uses: its Service rlkube-metrics once turned, through service
        # links, into RLKUBE_METRICS_PORT=tcp://... in the operator's pod, which crashed on it.
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        print(f"operator Ready {time.monotonic() - t0:.1f} s after helm install")
        yield OPERATOR_NAMESPACE
    finally:
        cluster.helm("uninstall", "rlkube", "--namespace", OPERATOR_NAMESPACE, "--wait")


@pytest.fixture(scope="module")
def namespace(cluster: Cluster, operator: str) -> str:
    """A namespace enforcing the restricted Pod Security Standard, with the example's claim."""
    name = f"rljobs-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(name)
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    apply(cluster, name, claim())
    return name


class Discovery:
    """What the chart's monitors select, found through the API every second and handed to
    Prometheus as file_sd target files (Debian's Prometheus is built without Kubernetes
    discovery): the operator Service's endpoints on port `metrics` (ServiceMonitor) and each job's
    head pod on port `rlkube-metrics` (PodMonitor: managed-by rlkube-operator, role head), with
    the pods' addresses of the moment, so a restarted head is followed as Prometheus would."""

    JOBS = ("rlkube-operator", "rlkube-rljobs")

    def __init__(self, cluster: Cluster, namespace: str, workdir: Path):
        self.cluster, self.namespace, self.workdir = cluster, namespace, workdir
        self.stopped = threading.Event()
        self._write()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def scrape_configs(self) -> list[dict]:
        return [{"job_name": job, "file_sd_configs": [{"files": [str(self.workdir / f"{job}.json")],
                                                       "refresh_interval": "1s"}]} for job in self.JOBS]

    def _operator(self) -> list[str]:
        endpoints = self.cluster.get_json("endpoints", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=rlkube")
        return [f"{a['ip']}:{p['port']}" for e in endpoints["items"] for sub in e.get("subsets") or []
                for a in sub.get("addresses") or [] for p in sub.get("ports") or [] if p.get("name") == "metrics"]

    def _heads(self) -> list[str]:
        heads = self.cluster.get_json("pods", "-n", self.namespace, "-l",
                                      "app.kubernetes.io/managed-by=rlkube-operator,rlkube.io/role=head")
        return [f"{p['status']['podIP']}:{port['containerPort']}" for p in heads["items"] if p["status"].get("podIP")
                for c in p["spec"]["containers"] for port in c.get("ports") or [] if port.get("name") == "rlkube-metrics"]

    def _write(self) -> None:
        for job, targets in zip(self.JOBS, (self._operator(), self._heads())):
            path = self.workdir / f"{job}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps([{"targets": targets}]))
            tmp.replace(path)

    def _loop(self) -> None:
        while not self.stopped.wait(1):
            try:
                self._write()
            except Exception:  # noqa: BLE001 - an API hiccup: the next round finds them again
                pass

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)


def on_claim(cluster: Cluster, namespace: str, pod_path: str) -> Path:
    """A path the pods wrote under the claim's mount, where it lies on this machine."""
    return claim_dir(cluster, namespace, claim()["metadata"]["name"]) / Path(pod_path).relative_to(MOUNT)


def attempts(trained_order: list[int]) -> list[list[int]]:
    """The runs of consecutive rollout ids in samples.jsonl: one per attempt that trained."""
    runs: list[list[int]] = []
    for k in trained_order:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def trained_order(out: Path) -> list[int]:
    return [json.loads(line)["rollout"] for line in (out / "samples.jsonl").read_text().splitlines()]


def assert_every_group_trained_once(trained: Trained, num_rollout: int) -> None:
    assert sorted(trained.records) == list(range(num_rollout)), "a rollout was never trained"
    groups = trained.groups_trained()
    assert sorted(groups) == list(range(num_rollout * GROUPS_PER_ROLLOUT)), "prompt groups skipped"
    assert set(groups.values()) == {1}, f"prompt groups trained twice: {[g for g, n in groups.items() if n > 1]}"


def assert_owned_objects_go(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.kubectl("-n", namespace, "delete", "rljob", name, "--wait=true", "--timeout=120s")

    def left() -> str:
        return cluster.kubectl("-n", namespace, "get", OWNED_KINDS, "-l", f"rlkube.io/rljob={name}",
                               "-o", "name").stdout.strip()

    cluster.wait_for(lambda: not left(), 120, f"the objects of RLJob {name} to be deleted")


@pytest.fixture
def node_memory(cluster, request):
    """The node's memory high-water mark while the test runs (rljob_pods.MemoryPeak)."""
    with MemoryPeak(cluster, request.node.name):
        yield


def test_a_separate_job_trains_to_succeeded_on_real_pods_through_a_lost_rollout_pod_and_a_suspend(
        cluster, namespace, rollout_image, tmp_path, node_memory):
    """Trainer pod, rollout pod (built-in engine behind the router) and head on the real node; the
    rollout pod deleted mid-run is replaced and its engine re-registered; suspended, its pods go
    and resuming continues from the checkpoint; every panel's query has data (KL, TIS and OPSM on, so
    the off-policy panel has its series too); the reward rises."""
    name, num_rollout = "separate", 150
    algorithm = {"useKlLoss": True, "klLossCoef": 0.001, "tis": {"enabled": True}, "opsm": {"enabled": True}}
    job = tiny_job(name, num_rollout=num_rollout, interval=5, algorithm=algorithm,
                   faultTolerance={"healthCheck": {"firstWaitSeconds": 5, "intervalSeconds": 5, "timeoutSeconds": 10}},
                   eval={"interval": 10, "datasets": [
                       {"name": "successor", "path": "builtin:digit-successor", "nSamples": 2, "passK": [1, 2]}]})
    for role in ("trainer", "rollout"):
        job["spec"]["resources"].setdefault(role, {})["image"] = rollout_image
    discovery = Discovery(cluster, namespace, tmp_path)
    prom = Prometheus(tmp_path, scrape_configs=discovery.scrape_configs())
    start = time.time()
    try:
        apply(cluster, namespace, job)
        watch = Watch(cluster, namespace, name)
        watch.until(lambda r: r["PHASE"] == "Running" and rollouts_done(r) >= 3, 300, "Running, 3 rollouts done")

        # Ray's job API (run any code in the job's pods) answers only KubeRay's token.
        assert dashboard_answers(cluster, namespace, name, None)[0] == 401
        assert dashboard_answers(cluster, namespace, name, "not-the-job-token")[0] == 403
        assert dashboard_answers(cluster, namespace, name, ray_token(cluster, namespace, name))[0] == 200

        # A rollout pod lost (as with its node: no grace period): KubeRay makes another, the runtime
        # restarts the engine on it.
        [lost] = pods(cluster, namespace, name, "rollout")
        cluster.kubectl("-n", namespace, "delete", "pod", lost["metadata"]["name"], "--grace-period=0", "--force")
        replacement = running_pod(cluster, namespace, name, "rollout", timeout=180)
        assert replacement["metadata"]["name"] != lost["metadata"]["name"]
        before = rollouts_done(watch.poll())
        watch.until(lambda r: rollouts_done(r) >= before + 3, 300, "rollouts after the engine's restart")
        cluster.wait_for(lambda: rljob(cluster, namespace, name)["status"]["restarts"]["engine"] >= 1, 60,
                         "the engine's restart in the status")
        assert rljob(cluster, namespace, name)["status"]["restarts"].get("job", 0) == 0, watch.history()

        # All but the MoE panel, whose losses need a mixture of experts with megatronArgs turning them on
        # (this tiny job is dense): test_megatron_loop's expert-parallel run asserts those series.
        panels = [query for query in chart.dashboard_queries() if query[1] != "MoE load balancing"]
        assert_every_query_returns_data(prom, panels, start, timeout=120, translate=chart.for_prometheus)

        # Suspend: the attempt saves and its pods go; resume continues after that checkpoint.
        cluster.kubectl("-n", namespace, "patch", "rljob", name, "--type=merge", "-p", '{"spec":{"suspend":true}}')
        watch.until(lambda r: r["PHASE"] == "Suspended", 180, "Suspended")
        cluster.wait_for(lambda: not pods(cluster, namespace, name), 180, "the suspended job's pods to go")
        suspended_at = rljob(cluster, namespace, name)["status"]["progress"]["rollout"]
        cluster.kubectl("-n", namespace, "patch", "rljob", name, "--type=merge", "-p", '{"spec":{"suspend":false}}')
        row = watch.until(lambda r: r["PHASE"] == "Succeeded", 600, "Succeeded")

        phases = [p for p in watch.phases() if p]  # the first row may precede the operator's first status
        assert phases[0] in ("Pending", "Starting") and phases[-1] == "Succeeded", watch.history()
        assert {"Running", "Suspended"} <= set(phases), watch.history()
        assert len({r["PROGRESS"] for r in watch.rows}) >= 5, f"PROGRESS hardly moved:\n{watch.history()}"
        assert row["PROGRESS"] == f"{num_rollout}/{num_rollout}"

        status = rljob(cluster, namespace, name)["status"]
        out = on_claim(cluster, namespace, f"{MOUNT}/{name}")
        trained = Trained.read(out)
        assert_every_group_trained_once(trained, num_rollout)
        # Neither the lost rollout pod nor the suspend cost a rollout: the suspended attempt saved
        # what it had trained and the next one started right after it, so nothing was redone.
        assert 0 < suspended_at < num_rollout, suspended_at
        order = trained_order(out)
        assert order == list(range(num_rollout)), attempts(order)
        assert status["lastCheckpoint"]["rollout"] == num_rollout - 1
        assert (on_claim(cluster, namespace, status["lastCheckpoint"]["path"])).is_dir()
        first, last = trained.mean_reward(range(5)), trained.mean_reward(range(num_rollout - 5, num_rollout))
        assert last > first + 0.3, f"reward did not rise: first rollouts {first:.2f}, last {last:.2f}"
    finally:
        prom.stop()
        discovery.stop()
    assert_owned_objects_go(cluster, namespace, name)


def test_a_colocated_job_resumes_after_its_trainer_is_killed_and_its_head_is_deleted(
        cluster, namespace, rollout_image, node_memory):
    """One trainer pod carries the trainer rank, the engine and the router. The trainer process
    killed: the attempt fails and the next resumes from the newest checkpoint. The head pod deleted
    with a grace period: preStop and SIGTERM reach the driver, which saves before it exits, and
    the next attempt starts right after that save. No rollout is lost or trained twice."""
    name, num_rollout, interval = "colocated", 100, 5
    job = tiny_job(name, placement="colocated", num_rollout=num_rollout, interval=interval)
    job["spec"]["resources"]["trainer"]["image"] = rollout_image
    apply(cluster, namespace, job)
    watch = Watch(cluster, namespace, name)
    watch.until(lambda r: r["PHASE"] == "Running" and rollouts_done(r) >= interval + 2, 300,
                "Running past the first checkpoint")
    trainer = running_pod(cluster, namespace, name, "trainer")
    assert kill_in_pod(cluster, namespace, trainer["metadata"]["name"], "TrainerWorker"), "no trainer process found"
    watch.until(lambda r: r["RESTARTS"] == "1" and r["PHASE"] == "Running", 300, "a second attempt Running")
    resumed = rollouts_done(watch.poll())
    watch.until(lambda r: rollouts_done(r) >= resumed + 3, 240, "rollouts in the second attempt")

    head = running_pod(cluster, namespace, name, "head")
    cluster.kubectl("-n", namespace, "delete", "pod", head["metadata"]["name"], "--wait=false")
    deleted = time.monotonic()
    at_restart = rollouts_done(watch.until(lambda r: r["RESTARTS"] == "2", 300, "a third attempt"))
    next_attempt = time.monotonic() - deleted
    watch.until(lambda r: rollouts_done(r) > at_restart, 300, "the third attempt training")
    training_again = time.monotonic() - deleted
    row = watch.until(lambda r: r["PHASE"] == "Succeeded", 600, "Succeeded")
    assert row["PROGRESS"] == f"{num_rollout}/{num_rollout}"

    status = rljob(cluster, namespace, name)["status"]
    assert status["restarts"]["job"] == 2 and status["restarts"]["preemptions"] == 1, status["restarts"]
    preempted = status["lastPreemption"]
    assert preempted["attempt"] == 1 and preempted["rollout"] is not None, preempted
    events = cluster.get_json("events", "-n", namespace, "--field-selector",
                              f"involvedObject.kind=RLJob,involvedObject.name={name}")["items"]
    [preemption_event] = [e for e in events if e["reason"] == "Preempted"]
    assert preemption_event["type"] == "Normal", preemption_event
    assert "not counted against faultTolerance.backoffLimit" in preemption_event["message"], preemption_event
    out = on_claim(cluster, namespace, f"{MOUNT}/{name}")
    trained = Trained.read(out)
    assert_every_group_trained_once(trained, num_rollout)
    order = trained_order(out)
    runs = attempts(order)
    # The killed attempt: the next redoes only what came after its newest checkpoint, from that
    # checkpoint on. A kill just after a save leaves nothing to redo, and the two attempts' rollouts
    # then form one run (seen in CI).
    assert len(runs) in (1, 2), runs
    if len(runs) == 2:
        assert runs[1][0] % interval == 0 and runs[0][-1] - interval < runs[1][0] <= runs[0][-1], runs
    # The preempted attempt saved every rollout it trained: the third attempt went on right after
    # it, so its rollouts continue the second's run with nothing redone and nothing skipped.
    last = runs[-1]
    assert last[0] <= preempted["rollout"] < num_rollout - 1, (runs, preempted)
    assert last == list(range(last[0], num_rollout)), runs
    after_preemption = [k for k in order if k > preempted["rollout"]]
    chaos.record_figures("head pod deleted on a real node -> preStop, SIGTERM -> preemption -> next attempt", {
        "preempted_at_rollout": preempted["rollout"],
        "rollouts_redone": len(after_preemption) - len(set(after_preemption)),
        "rollouts_missing": len(set(range(num_rollout)) - set(order)),
        "next_attempt_created_s": round(next_attempt, 2),
        "next_attempt_training_s": round(training_again, 2),
        "failures_counted": status["restarts"]["job"] - status["restarts"]["preemptions"],  # the killed trainer
    })
    assert_owned_objects_go(cluster, namespace, name)
