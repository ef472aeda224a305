"""The RayJob the operator renders, run the way its head pod would run it (issue 11, part 3).

The real operator turns a small CPU RLJob into its RayJob, ConfigMap, ServiceAccount, Role and
RoleBinding on the real control plane (tests/integration/test_operator.py's fixtures). The test then
reads from that RayJob what the head pod would get: the entrypoint, the head container's environment
and the ConfigMap volume's mount path. It writes the ConfigMap's files where the entrypoint will find
them (a temp dir standing for the mount), gives the process the pod's identity (a token of the
rendered ServiceAccount as its KUBECONFIG: the runtime's reporter tries in-cluster config first, then
KUBECONFIG) and runs the entrypoint as a local subprocess with a private Ray (no RAY_ADDRESS).

What the test stands in for, and nothing else:
- the kubelet: the entrypoint runs here rather than in the head pod kwok "runs", and KubeRay's
  submitter pod (`ray job submit`, which follows the Ray job until it ends) is kept Running by a
  kwok Stage of this test's namespace; kwok's stock stage completes Job pods at once, and KubeRay
  fails a RayJob whose submitter finished 30 s before the Ray job did.
- Ray's job server: the test reports the Ray job RUNNING while the entrypoint runs, FAILED after it
  killed the first attempt, SUCCEEDED after the second one exited 0 (as in test_operator.py).

Everything the RLJob's status shows while the runtime runs (`kubectl get rljobs`: PROGRESS, REWARD,
CHECKPOINT) is written by the runtime itself through the narrow Role, and the second attempt (the
operator's restart) resumes from the checkpoint the first one left.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from harness import ControlPlane, ControlPlaneError
from local_runs import LocalRun
from operator_fixtures import apply_file, free_port, get_or_none, kubectl_json, token_kubeconfig
from test_operator import (  # noqa: F401 - crd_installed, ns and operator are fixtures used here
    cluster_running,
    crd_installed,
    deployment_status,
    ns,
    operator,
    rljob_events,
    rljob_yaml,
    stand_in_ray_job_status,
    table,
    wait_phase,
    wait_rayjob,
    wait_rljob,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

NAME = "aspod"
# About 0.2 s a rollout on the 2-core machine: 60 of them give the test several seconds to watch
# `kubectl get rljobs` move and to kill the first attempt after its first checkpoint (rollout 3),
# well before the end. (12 rollouts of the tiny task train in about a second, too fast to watch.)
NUM_ROLLOUT = 60
CHECKPOINT_INTERVAL = 3
RUN_START_TIMEOUT = 300  # Ray's start, the tiny model and the first checkpoint, on a loaded 2-core machine
RUN_FINISH_TIMEOUT = 420
RESUMING = "resuming from checkpoint "


def cpu_rljob(save: Path) -> str:
    """test_operator's small colocated RLJob, made runnable on a CPU: the built-in engine (SGLang
    needs a GPU) on one device, one-token answers, a rollout batch like local-tiny's, and
    model.save/load in a directory the 'pod' (this machine) can write."""
    return rljob_yaml(
        NAME,
        model={"preset": "tiny", "dtype": "float32", "save": str(save), "load": str(save)},
        rollout={"engine": "builtin", "gpusPerEngine": 1, "batchSize": 16, "nSamplesPerPrompt": 8, "maxResponseLen": 1},
        training={"numRollout": NUM_ROLLOUT, "globalBatchSize": 128},
        checkpoint={"interval": CHECKPOINT_INTERVAL},
    )


# --- the kubelet's part: KubeRay's submitter follows the Ray job -------------------------------------


@pytest.fixture
def submitters_follow_their_ray_job(crd_installed: ControlPlane, ns: str):
    """A kwok Stage that keeps this namespace's Job pods (KubeRay's submitters) Running, as
    `ray job submit` would until its Ray job ends (an hour here). It outweighs kwok's pod-complete
    stage (weight 0) for these pods only; other namespaces keep the stock behaviour."""
    cp = crd_installed
    stage = f"rlkube-test-submitter-follows-job-{ns}"
    complete = kubectl_json(cp, "get", "stage.kwok.x-k8s.io", "pod-complete")  # kwok's stock stage
    cp.apply_yaml(yaml.safe_dump({
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": stage},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": [
                {"key": ".metadata.namespace", "operator": "In", "values": [ns]},
                *complete["spec"]["selector"]["matchExpressions"],  # not deleting, Running, owned by a Job
            ]},
            "weight": 1,
            "delay": {"durationMilliseconds": 3_600_000},
            "next": complete["spec"]["next"],  # then it completes, as the stock stage does at once
        },
    }))
    yield
    cp.kubectl("delete", "stage.kwok.x-k8s.io", stage, "--wait=false", check=False)


def submitter_pod(cp: ControlPlane, ns: str, rayjob: str) -> dict | None:
    pods = kubectl_json(cp, "-n", ns, "get", "pods", "-l", f"batch.kubernetes.io/job-name={rayjob}")["items"]
    return pods[0] if pods else None


def assert_still_running(cp: ControlPlane, ns: str, rayjob: str) -> None:
    """Nothing but the stand-ins has ended the attempt: its submitter pod still runs, and KubeRay
    still has the RayJob Running with the Ray job state the stand-in reported."""
    pod = submitter_pod(cp, ns, rayjob)
    assert pod is not None and pod["status"].get("phase") == "Running", pod and pod["status"]
    status = get_or_none(cp, ns, "rayjob", rayjob)["status"]
    assert (status.get("jobDeploymentStatus"), status.get("jobStatus")) == ("Running", "RUNNING"), status


# --- the head pod, as the RayJob describes it --------------------------------------------------------


class HeadPod:
    """What the head pod of `rayjob` would run: its entrypoint (the ConfigMap's mount path replaced by
    a local copy of the ConfigMap), its environment (literal values), its ServiceAccount."""

    def __init__(self, cp: ControlPlane, ns: str, rayjob: dict, root: Path):
        self.rayjob = rayjob
        spec = rayjob["spec"]
        self.entrypoint = spec["entrypoint"]
        pod = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        [self.container] = [c for c in pod["containers"] if c["name"] == "ray-head"]
        self.service_account = pod["serviceAccountName"]

        # Literal env values; valueFrom ones (secretKeyRef, fieldRef, ...) need the kubelet and are
        # listed instead (this job renders only the API key's).
        self.env = {e["name"]: e["value"] for e in self.container.get("env", []) if "value" in e}
        self.env_from_refs = [e["name"] for e in self.container.get("env", []) if "value" not in e]

        # ConfigMap volumes, written out as the kubelet projects them (one file per key).
        configmaps = {v["name"]: v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
        self.mounts: dict[str, Path] = {}  # mount path -> local directory standing for it
        self.configmaps: dict[str, dict] = {}
        for i, mount in enumerate(m for m in self.container.get("volumeMounts", []) if m["name"] in configmaps):
            configmap = get_or_none(cp, ns, "configmap", configmaps[mount["name"]])
            assert configmap is not None, f"ConfigMap {configmaps[mount['name']]} mounted by the head is missing"
            local = root / f"mount{i}"
            local.mkdir(parents=True)
            for key, text in configmap.get("data", {}).items():
                (local / key).write_text(text)
            self.mounts[mount["mountPath"].rstrip("/")] = local
            self.configmaps[mount["mountPath"].rstrip("/")] = configmap

    def argv(self) -> list[str]:
        """The entrypoint's argv with `rlkube` as this interpreter's `python -m rlkube_runtime.cli`
        and every path under a ConfigMap mount pointed at the local copy."""
        words = shlex.split(self.entrypoint)
        assert words[0] == "rlkube", self.entrypoint
        out = [sys.executable, "-m", "rlkube_runtime.cli"]
        for word in words[1:]:
            for mount, local in self.mounts.items():
                if word == mount or word.startswith(mount + "/"):
                    word = str(local) + word[len(mount):]
                    break
            out.append(word)
        return out

    def process_env(self, kubeconfig: Path, metrics_port: int) -> dict[str, str]:
        """This machine's environment (the image's, so to speak) without anything that would point
        the run elsewhere, plus the head container's variables and the pod's credentials."""
        dropped = ("RAY_ADDRESS", "KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
        env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("RLKUBE_")}
        env.update(self.env)
        # The pod has its own network namespace; this machine's is shared with other tests, so the
        # rendered port (checked against the container's port) is swapped for a free one.
        env["RLKUBE_METRICS_PORT"] = str(metrics_port)
        env["KUBECONFIG"] = str(kubeconfig)
        env["PYTHONUNBUFFERED"] = "1"
        return env


class EntrypointRun(LocalRun):
    """The entrypoint as a subprocess in its own session (so SIGKILL reaches all of it), output to a
    file; LocalRun's bounded waits and stall diagnostics. No --output-dir: the pod's command has
    none, so the run's directory is spec.model.save (`out`)."""

    def __init__(self, argv: list[str], env: dict[str, str], out: Path, log_path: Path, cwd: Path):
        self.out = out
        self.log_path = log_path
        self.argv = argv
        self.metrics_port = int(env["RLKUBE_METRICS_PORT"])
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env, cwd=cwd)


def whoami(cp: ControlPlane, kubeconfig: Path) -> str:
    proc = subprocess.run([str(cp.bin("kubectl")), f"--kubeconfig={kubeconfig}", "auth", "whoami", "-o", "json"],
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(proc.stdout)["status"]["userInfo"]["username"]


def kubectl_as(cp: ControlPlane, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cp.bin("kubectl")), f"--kubeconfig={kubeconfig}", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def progress_of(row: dict[str, str]) -> tuple[int, int] | None:
    if not row.get("PROGRESS"):
        return None
    done, total = row["PROGRESS"].split("/")
    return int(done), int(total)


def state_report(cp: ControlPlane, ns: str, runs: list[EntrypointRun], history: list[dict]) -> str:
    """The RLJob's status, the objects of the namespace, the table rows seen and each run's output tail."""
    parts = []
    try:
        rljob = get_or_none(cp, ns, "rljob", NAME) or {}
        parts.append("--- RLJob status ---\n" + yaml.safe_dump(rljob.get("status"), sort_keys=False))
        parts.append(cp.kubectl("-n", ns, "get", "rljobs,rayjobs,rayclusters,jobs,pods", "-o", "wide",
                                check=False).stdout)
    except Exception as exc:  # noqa: BLE001 - a report must not hide the failure it explains
        parts.append(f"(could not read the RLJob: {exc})")
    if history:
        parts.append("--- kubectl get rljobs -o wide, rows seen ---\n" + "\n".join(
            " | ".join(f"{k}={v}" for k, v in row.items() if k != "AGE") for row in history[-30:]))
    for i, run in enumerate(runs):
        parts.append(f"--- attempt {i} output (last lines, exit {run.proc.poll()}) ---\n{run.output[-4000:]}")
    return "\n".join(parts)


def watch_table(cp: ControlPlane, ns: str, run: EntrypointRun, history: list[dict], done, what: str,
                timeout_s: float) -> None:
    """Poll `kubectl get rljobs -o wide` into `history` (changed rows only) until `done(history)`;
    fails if the run ends first or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        [row] = table(cp, ns, "-o", "wide")
        row.pop("AGE", None)
        if not history or history[-1] != row:
            history.append(row)
        if done(history):
            return
        if not run.running():
            raise AssertionError(f"the run ended (exit {run.proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            run._fail_stalled(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.1)


# --- the test --------------------------------------------------------------------------------------


def test_the_rendered_entrypoint_run_as_its_pod_reports_progress_and_resumes_after_a_kill(
    operator, ns, tmp_path, submitters_follow_their_ray_job
):
    cp = operator.cp
    save = tmp_path / "pod-volume" / NAME  # model.save/load: the job's persistent volume, so to speak
    assert apply_file(cp, tmp_path / "job.yaml", cpu_rljob(save), ns).returncode == 0
    runs: list[EntrypointRun] = []
    history: list[dict] = []
    try:
        _attempts(cp, ns, tmp_path, save, runs, history)
    except (AssertionError, ControlPlaneError) as exc:
        raise AssertionError(f"{exc}\n{state_report(cp, ns, runs, history)}") from exc
    finally:
        for run in runs:
            run.kill()


def _start_attempt(cp: ControlPlane, ns: str, tmp_path: Path, save: Path, attempt: int) -> EntrypointRun:
    """Attempt `attempt`'s RayJob, its cluster up (kwok) and its deployment Running (KubeRay); then
    its entrypoint started here with the pod's files, environment and identity."""
    rayjob_name = f"{NAME}-{attempt}"
    rayjob = wait_rayjob(cp, ns, rayjob_name)
    cluster_running(cp, ns, NAME, attempt, groups=1)
    wait_rayjob(cp, ns, rayjob_name, lambda rj: deployment_status(rj) == "Running", "deployment Running")
    submitter = cp.wait_for(lambda: submitter_pod(cp, ns, rayjob_name), 60, f"the submitter pod of {rayjob_name}")
    assert submitter["status"].get("phase") in ("Pending", "Running"), submitter["status"]

    root = tmp_path / f"attempt{attempt}"
    pod = HeadPod(cp, ns, rayjob, root)

    # What the operator rendered for the head.
    assert pod.entrypoint == "rlkube run /etc/rlkube/rljob.yaml"
    assert "--output-dir" not in pod.entrypoint  # the run's directory is spec.model.save
    assert list(pod.mounts) == ["/etc/rlkube"]
    assert set(pod.configmaps["/etc/rlkube"]["data"]) == {"rljob.yaml"}
    assert pod.env["RLKUBE_RLJOB_NAME"] == NAME
    assert pod.env["RLKUBE_RLJOB_NAMESPACE"] == ns
    assert pod.env["RLKUBE_ATTEMPT"] == str(attempt)
    assert pod.env["RLKUBE_ROLE"] == "head"
    ports = {p["name"]: p["containerPort"] for p in pod.container.get("ports", [])}
    assert pod.env["RLKUBE_METRICS_PORT"] == str(ports["rlkube-metrics"])
    assert pod.env_from_refs == ["RLKUBE_API_KEY"]  # the job's API key, from its Secret; nothing else
    assert pod.service_account == f"{NAME}-runtime"
    spec_file = yaml.safe_load((pod.mounts["/etc/rlkube"] / "rljob.yaml").read_text())
    assert (spec_file["metadata"]["name"], spec_file["metadata"]["namespace"]) == (NAME, ns)
    assert spec_file["spec"]["model"]["save"] == str(save)

    # The pod's identity: a token of the rendered ServiceAccount, nothing else.
    cp.wait_for(lambda: get_or_none(cp, ns, "rolebinding", f"{NAME}-runtime"), 30, f"RoleBinding {NAME}-runtime")
    kubeconfig = token_kubeconfig(cp, ns, pod.service_account, root / "sa.kubeconfig")
    assert whoami(cp, kubeconfig) == f"system:serviceaccount:{ns}:{pod.service_account}"
    denied = kubectl_as(cp, kubeconfig, "-n", ns, "get", "rayjobs")
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied

    metrics_port = free_port()
    argv = pod.argv()
    assert argv[3:] == ["run", str(pod.mounts["/etc/rlkube"] / "rljob.yaml")], argv
    run = EntrypointRun(argv, pod.process_env(kubeconfig, metrics_port), out=save,
                        log_path=tmp_path / f"attempt{attempt}.log", cwd=root)
    # Stand-in for Ray's job server: the driver runs.
    stand_in_ray_job_status(cp, ns, rayjob_name, "RUNNING")
    return run


def _attempts(cp: ControlPlane, ns: str, tmp_path: Path, save: Path, runs: list[EntrypointRun],
              history: list[dict]) -> None:
    rljob = wait_rljob(cp, ns, NAME, "attempt 0 created", lambda o: (o.get("status") or {}).get("rayJobName"))
    for kind in ("configmap", "serviceaccount", "role", "rolebinding"):
        suffix = "spec" if kind == "configmap" else "runtime"
        cp.wait_for(lambda: get_or_none(cp, ns, kind, f"{NAME}-{suffix}"), 30, f"{kind} {NAME}-{suffix}")
    assert rljob["status"]["rayJobName"] == f"{NAME}-0"

    # --- attempt 0: watch it move, then kill it after its first checkpoint -----------------------
    run = _start_attempt(cp, ns, tmp_path, save, 0)
    runs.append(run)
    wait_phase(cp, ns, NAME, "Running", timeout=60)

    def moved(rows: list[dict]) -> bool:
        seen = {p for p in map(progress_of, rows) if p}
        return len(seen) >= 2 and bool(rows[-1]["REWARD"]) and bool(rows[-1]["CHECKPOINT"])

    watch_table(cp, ns, run, history, moved, "PROGRESS moving, a REWARD and a CHECKPOINT in `kubectl get rljobs`",
                RUN_START_TIMEOUT)
    # The run serves the rlkube_* series on the port the pod's variable names.
    with urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10) as resp:
        scraped = resp.read().decode()
    run.kill()  # SIGKILL to the whole process group, mid-run, as a node loss would
    assert run.proc.returncode == -9, run.proc.returncode
    assert_still_running(cp, ns, f"{NAME}-0")
    assert f'rlkube_reward_mean{{rljob="{NAME}"}}' in scraped

    progress = [p for p in map(progress_of, history) if p]
    assert all(total == NUM_ROLLOUT for _, total in progress), progress
    assert [done for done, _ in progress] == sorted(done for done, _ in progress), progress  # never backwards
    last = history[-1]
    assert float(last["REWARD"]) >= 0
    assert (last["PHASE"], last["RAYJOB"], last["RESTARTS"]) == ("Running", f"{NAME}-0", "0")
    # Every one of those fields came from the runtime, through the rendered ServiceAccount's Role.
    status = get_or_none(cp, ns, "rljob", NAME)["status"]
    first_checkpoint = status["lastCheckpoint"]
    assert Path(first_checkpoint["path"]).parent == save / "checkpoints", first_checkpoint
    assert Path(first_checkpoint["path"]).is_dir()
    assert (first_checkpoint["rollout"] + 1) % CHECKPOINT_INTERVAL == 0, first_checkpoint
    assert status["progress"]["rollout"] < NUM_ROLLOUT, "attempt 0 was to be killed mid-run"

    # Stand-in for Ray's job server: the Ray job failed (its driver is gone). The operator restarts.
    stand_in_ray_job_status(cp, ns, f"{NAME}-0", "FAILED", "Failed", reason="AppFailed",
                            message="the driver was killed (SIGKILL)")
    wait_rljob(cp, ns, NAME, "attempt 1", lambda o: (o.get("status") or {}).get("restarts", {}).get("job") == 1
               and o["status"].get("rayJobName") == f"{NAME}-1", timeout=90)
    [restarting] = [e for e in rljob_events(cp, ns, NAME) if e["reason"] == "Restarting"]
    assert f"RayJob {NAME}-0 failed: AppFailed; the driver was killed (SIGKILL)" in restarting["message"], restarting

    # --- attempt 1: the operator's new RayJob, run the same way; it resumes and finishes ----------
    run = _start_attempt(cp, ns, tmp_path, save, 1)
    runs.append(run)
    wait_phase(cp, ns, NAME, "Running", timeout=60)
    code = run.wait(timeout_s=RUN_FINISH_TIMEOUT)
    output = run.output
    assert code == 0, f"attempt 1 exited {code}"
    assert "Traceback" not in output
    [resumed] = [line for line in output.splitlines() if line.startswith(RESUMING)]
    path, rollout = resumed.removeprefix(RESUMING).rsplit(" (rollout ", 1)
    resumed_rollout = int(rollout.rstrip(")"))
    assert Path(path).parent == save / "checkpoints", resumed
    # The checkpoint the status named, or one saved after it in the instant before the kill.
    assert resumed_rollout >= first_checkpoint["rollout"], (resumed, first_checkpoint)
    lines = [line for line in output.splitlines() if line.startswith("rollout ")]
    assert lines[0].startswith(f"rollout {resumed_rollout + 2}/{NUM_ROLLOUT} "), lines[:3]  # nothing redone
    assert lines[-1].startswith(f"rollout {NUM_ROLLOUT}/{NUM_ROLLOUT} "), lines[-3:]

    status = get_or_none(cp, ns, "rljob", NAME)["status"]
    assert status["progress"] == {"rollout": NUM_ROLLOUT, "numRollout": NUM_ROLLOUT}
    assert status["lastCheckpoint"]["rollout"] == NUM_ROLLOUT - 1
    assert Path(status["lastCheckpoint"]["path"]).parent == save / "checkpoints"
    assert status["restarts"]["job"] == 1
    final = cp.wait_for(lambda: next((r for r in table(cp, ns, "-o", "wide")
                                      if r["PROGRESS"] == f"{NUM_ROLLOUT}/{NUM_ROLLOUT}"), None),
                        30, f"PROGRESS {NUM_ROLLOUT}/{NUM_ROLLOUT}")
    history.append(final)
    assert final["CHECKPOINT"] == status["lastCheckpoint"]["path"] and final["REWARD"], final
    assert (final["RAYJOB"], final["RESTARTS"]) == (f"{NAME}-1", "1")
    assert_still_running(cp, ns, f"{NAME}-1")

    # Stand-in for Ray's job server: the Ray job succeeded.
    stand_in_ray_job_status(cp, ns, f"{NAME}-1", "SUCCEEDED", "Complete")
    rljob = wait_phase(cp, ns, NAME, "Succeeded", timeout=60)
    assert rljob["status"]["progress"] == {"rollout": NUM_ROLLOUT, "numRollout": NUM_ROLLOUT}
