"""A real one-node cluster for people without one at hand (`make cluster`, `make cluster-down`).

    python tests/node/cluster.py up       # starts it in the background; prints the kubeconfig
    python tests/node/cluster.py status
    python tests/node/cluster.py down
    python tests/node/cluster.py load rlkube/operator:0.1.0 ...   # buildah images -> containerd

`up` runs `serve` as a background process that owns the control plane and the node (node.Cluster)
until `down` sends it SIGTERM; its components die with it. Files in ~/.cache/rlkube/cluster
(RLKUBE_CLUSTER_DIR overrides): kubeconfig (self-contained, admin), serve.pid, logs/.
Needs root and the venv's Python (the certificates are made with `cryptography`).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import node  # noqa: E402 - needs the sys.path entry above
from harness import cache_dir  # noqa: E402 - node puts tests/controlplane on sys.path

CLUSTER_DIR = Path(os.environ.get("RLKUBE_CLUSTER_DIR") or Path.home() / ".cache/rlkube/cluster")
KUBECONFIG = CLUSTER_DIR / "kubeconfig"
PID_FILE = CLUSTER_DIR / "serve.pid"
READY_FILE = CLUSTER_DIR / "ready"
LOGS = CLUSTER_DIR / "logs"
UP_TIMEOUT = 600


def running_pid() -> int | None:
    try:
        pid = int(PID_FILE.read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def self_contained_kubeconfig(cluster: node.Cluster) -> dict:
    """The admin kubeconfig with the certificates inlined: it stays valid wherever it is copied."""
    pki = cluster.kubeconfig.parent / "pki"

    def data(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "rlkube", "cluster": {"server": cluster.control_plane.server,
                                                   "certificate-authority-data": data(pki / "ca.crt")}}],
        "users": [{"name": "rlkube-admin", "user": {"client-certificate-data": data(pki / "admin.crt"),
                                                     "client-key-data": data(pki / "admin.key")}}],
        "contexts": [{"name": "rlkube", "context": {"cluster": "rlkube", "user": "rlkube-admin",
                                                    "namespace": "default"}}],
        "current-context": "rlkube",
    }


def serve() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    PID_FILE.write_text(str(os.getpid()))
    cluster = node.Cluster(logs_dir=LOGS, lock_timeout=5)
    try:
        cluster.start()
        KUBECONFIG.touch(mode=0o600)
        KUBECONFIG.write_text(json.dumps(self_contained_kubeconfig(cluster), indent=1))
        READY_FILE.write_text(json.dumps({"timings": cluster.timings, "server": cluster.control_plane.server}))
        print(f"cluster up: {cluster.timings}", flush=True)
        while not stop.wait(5):
            pass
    finally:
        print("stopping", flush=True)
        cluster.stop()
        for path in (READY_FILE, KUBECONFIG, PID_FILE):
            path.unlink(missing_ok=True)
        print("stopped", flush=True)
    return 0


def up() -> int:
    pid = running_pid()
    if pid:
        print(f"a cluster is already running (pid {pid}); KUBECONFIG={KUBECONFIG}")
        return 0
    problems = node.missing_prerequisites()
    if problems:
        print("cannot start the cluster:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    LOGS.mkdir(parents=True, exist_ok=True)
    READY_FILE.unlink(missing_ok=True)
    log = open(LOGS / "serve.log", "ab")  # noqa: SIM115 - the child keeps it
    process = subprocess.Popen([sys.executable, __file__, "serve"], stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    t0 = time.monotonic()
    while not READY_FILE.exists():
        if process.poll() is not None or time.monotonic() - t0 > UP_TIMEOUT:
            tail = "\n".join((LOGS / "serve.log").read_text(errors="replace").splitlines()[-30:])
            print(f"the cluster did not come up; last lines of {LOGS / 'serve.log'}:\n{tail}", file=sys.stderr)
            if process.poll() is None:
                process.terminate()
            return 1
        time.sleep(0.5)
    print(f"""\
One-node cluster up in {time.monotonic() - t0:.0f} s (node {node.NODE_NAME}, API server {json.loads(READY_FILE.read_text())['server']}).

    export KUBECONFIG={KUBECONFIG}
    export PATH={cache_dir() / 'bin'}:$PATH   # kubectl and helm of the control plane
    kubectl get nodes
    helm install rlkube charts/rlkube  # the operator (make cluster loaded rlkube/operator and rlkube/rollout)
    kubectl apply -f manifests/cluster/checkpoints-pvc.yaml -f manifests/examples/cluster-tiny.yaml
    kubectl get rljobs -w              # Pending -> Running -> Succeeded

StorageClass {node.STORAGE_CLASS} (default) gives PVCs a directory under {node.VOLUMES}; the KubeRay operator runs.
Logs: {LOGS}. Stop it with `make cluster-down`.""")
    return 0


def down() -> int:
    pid = running_pid()
    if pid is None:
        print("no cluster is running")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while running_pid() == pid and time.monotonic() < deadline:
        time.sleep(0.5)
    if running_pid() == pid:
        print(f"the cluster (pid {pid}) did not stop within 120 s; see {LOGS / 'serve.log'}", file=sys.stderr)
        return 1
    print("cluster stopped")
    return 0


def status() -> int:
    pid = running_pid()
    if pid and READY_FILE.exists():
        print(f"running (pid {pid}); KUBECONFIG={KUBECONFIG}")
        return 0
    print("starting" if pid else "not running")
    return 0 if pid else 3


def load(refs: list[str]) -> int:
    with node.containerd_for_loading():
        for ref in refs:
            t0 = time.monotonic()
            sent = node.load_buildah_image(node.buildah_name(ref), node.cri_name(ref))
            took = time.monotonic() - t0
            if sent is None:
                print(f"[images] already in containerd: {node.cri_name(ref)} ({took:.1f} s)")
            else:
                print(f"[images] loaded {node.cri_name(ref)}: {sent / 1e6:.0f} MB of new layers in {took:.1f} s")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="A real one-node cluster on this machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "status", "serve"):
        sub.add_parser(name)
    load_parser = sub.add_parser("load", help="copy buildah images into the node's containerd")
    load_parser.add_argument("refs", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "load":
        return load(args.refs)
    return {"up": up, "down": down, "status": status, "serve": serve}[args.command]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
