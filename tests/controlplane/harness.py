"""A real Kubernetes control plane on 127.0.0.1 for integration tests.

Runs etcd, kube-apiserver (secure port only, RBAC, service-account tokens), kube-controller-manager
(garbage collection, namespaces, service accounts, workloads), kube-scheduler, kwok (fake nodes whose
pods it moves through their lifecycle, plus a chaos stage to fail a pod on demand) and the KubeRay
operator, all built from their Go modules by ``build.sh`` into
``~/.cache/rlkube/controlplane/<versions-key>/bin``.

    cp = ControlPlane(nodes=2, gpus_per_node=8)
    cp.start()
    try:
        cp.kubectl("get", "nodes")
    finally:
        cp.stop()

Every component logs to a file in ``cp.logs_dir``; a component that fails to come up raises
``ControlPlaneError`` quoting the tail of its log.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
VERSIONS_FILE = HERE / "versions.env"
BUILD_COMMAND = "bash tests/controlplane/build.sh"

# Binaries build.sh puts in the cache dir.
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "kuberay-operator",
    "helm",
)

# kwok's chaos stage (kustomize/stage/pod/chaos/pod-container-running-failed.yaml) fails a Running
# pod that carries this label; the annotations below it set exit code, reason and message.
CHAOS_POD_FAILED = "pod-container-running-failed.stage.kwok.x-k8s.io"
# kwok manages only nodes with this annotation (see --manage-nodes-with-annotation-selector).
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")

SERVICE_CIDR = "10.0.0.0/24"
STOP_GRACE_SECONDS = 5  # per component, before SIGKILL
# Per start-up wait. Generous: on two cores shared with other test runs, digesting KubeRay's CRDs
# alone has taken 40 s; a healthy start on an idle machine takes well under a minute in all.
START_TIMEOUT = 180
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

T = TypeVar("T")


class ControlPlaneError(RuntimeError):
    """A component did not start, died, or a wait timed out."""


class BinariesMissing(ControlPlaneError):
    """build.sh has not been run for the pinned versions."""


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse versions.env (KEY=VALUE lines, # comments), the file build.sh sources."""
    versions = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip().strip("\"'")
    return versions


def versions_key(versions: dict[str, str] | None = None) -> str:
    """The cache dir name; must match KEY in build.sh."""
    v = versions or read_versions()
    return (
        f"k8s-{v['KUBERNETES_VERSION']}_etcd-{v['ETCD_VERSION']}_kwok-{v['KWOK_VERSION']}"
        f"_kuberay-{v['KUBERAY_VERSION']}_helm-{v['HELM_VERSION']}"
    )


def cache_dir() -> Path:
    """Where build.sh put binaries and manifests for the pinned versions."""
    root = os.environ.get("RLKUBE_CONTROLPLANE_CACHE") or Path.home() / ".cache/rlkube/controlplane"
    return Path(root) / versions_key()


def missing_binaries() -> list[str]:
    bin_dir = cache_dir() / "bin"
    return [name for name in BINARIES if not os.access(bin_dir / name, os.X_OK)]


@dataclass
class Component:
    name: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok + KubeRay on 127.0.0.1.

    ``nodes`` fake kwok nodes are created, each with ``gpus_per_node`` ``nvidia.com/gpu``, the
    label ``type: kwok`` and no taints. ``logs_dir`` (default: inside the temp dir, removed on stop)
    receives one log file per component. ``extra_args`` adds flags to a component by name
    (``etcd``, ``kube-apiserver``, ``kube-controller-manager``, ``kube-scheduler``, ``kwok``,
    ``kuberay-operator``), e.g. ``{"kube-apiserver": ["--feature-gates=..."]}``.

    ``node_address`` (default None: everything on 127.0.0.1, as the kwok tests have it) is the
    address of this machine for a real node (tests/node): the API server listens and advertises
    there, so pods reach it through the ``kubernetes`` Service, and is set up for kubelets: Node
    authorization with NodeRestriction, a client certificate to call kubelets with, kubelet serving
    certificates checked against the cluster CA, InternalIP before Hostname.
    """

    def __init__(
        self,
        nodes: int = 2,
        gpus_per_node: int = 8,
        cpu_per_node: str = "32",
        memory_per_node: str = "256Gi",
        logs_dir: str | os.PathLike | None = None,
        start_kuberay: bool = True,
        extra_args: dict[str, list[str]] | None = None,
        node_address: str | None = None,
    ) -> None:
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.cpu_per_node = cpu_per_node
        self.memory_per_node = memory_per_node
        self.start_kuberay = start_kuberay
        self.extra_args = extra_args or {}  # component name -> more flags, e.g. feature gates
        self.node_address = node_address
        self.cache = cache_dir()
        self.bin_dir = self.cache / "bin"
        self._workdir: Path | None = None
        self._logs_dir_arg = Path(logs_dir) if logs_dir is not None else None
        self._components: list[Component] = []
        self.started_pids: list[int] = []  # every component ever started, kept after stop()
        self._stopped = True
        self.api_port = 0
        self.etcd_port = 0
        self.kuberay_probe_port = 0
        self._crd_install: subprocess.Popen | None = None
        self.timings: dict[str, float] = {}  # seconds from start() to each phase, for slow-start reports

    # ---------------------------------------------------------------- public API

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (client certificate in system:masters)."""
        return self._dir / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        """The cluster CA (signs the API server's serving cert and the client certs)."""
        return self._dir / "pki" / "ca.crt"

    @property
    def logs_dir(self) -> Path:
        return self._logs_dir_arg or self._dir / "logs"

    @property
    def server(self) -> str:
        return f"https://{self.node_address or '127.0.0.1'}:{self.api_port}"

    @property
    def pids(self) -> list[int]:
        """Process ids of the running components; each leads its own process group."""
        return [c.process.pid for c in self._components]

    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG, and the cached binaries first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def bin(self, name: str) -> Path:
        """Path of a built binary (kubectl, helm, ...)."""
        return self.bin_dir / name

    def start(self) -> ControlPlane:
        missing = missing_binaries()
        if missing:
            raise BinariesMissing(
                f"control plane binaries missing in {self.bin_dir}: {', '.join(missing)}. "
                f"Run `{BUILD_COMMAND}` (it builds them from the Go modules pinned in "
                f"{VERSIONS_FILE.name}; the first build takes a while)."
            )
        self._workdir = Path(tempfile.mkdtemp(prefix="rlkube-controlplane-"))
        self._stopped = False
        atexit.register(self.stop)
        try:
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()

            def mark(phase: str) -> None:
                self.timings[phase] = round(time.monotonic() - t0, 2)

            self._write_certs()
            ports = _free_ports(7)
            self.etcd_port, etcd_peer, self.api_port = ports[0], ports[1], ports[2]
            cm_port, sched_port, kuberay_metrics, self.kuberay_probe_port = ports[3:]
            self._start_etcd(etcd_peer)
            mark("etcd")
            self._start_apiserver()
            mark("kube-apiserver")
            self._write_kubeconfigs()
            if self.start_kuberay:
                self._begin_kuberay_crds()  # large; the API server digests them while the rest starts
            self._start_controller_manager(cm_port)
            self._start_scheduler(sched_port)
            self._install_kwok_stages()
            self._start_kwok()
            self._create_nodes()
            mark("kwok")
            if self.start_kuberay:
                self._install_kuberay_crds()
                self._start_kuberay(kuberay_metrics)
                mark("kuberay")
            self._wait_healthy(cm_port, sched_port)
            mark("healthy")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every component (SIGTERM to its process group, SIGKILL after a grace period)."""
        if self._stopped:
            return
        self._stopped = True
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if self._crd_install is not None and self._crd_install.poll() is None:
            _signal_group(self._crd_install, signal.SIGKILL)
            self._crd_install.wait()
        # One at a time in reverse start order: clients first, then kube-apiserver, etcd last.
        # (Terminated together, kube-apiserver sometimes hangs on its way out writing to a dying etcd.)
        for component in reversed(self._components):
            _signal_group(component.process, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                component.process.wait(timeout=STOP_GRACE_SECONDS)
            # Whatever is left of the group (the leader or a child it started) goes now.
            _signal_group(component.process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                component.process.wait(timeout=5)
        self._components.clear()
        self.timings["stop"] = round(time.monotonic() - t0, 2)
        if self._workdir is not None:  # logs_dir survives when it was given outside it
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None

    def restart_apiserver(self, sig: int = signal.SIGTERM) -> float:
        """Stop kube-apiserver (`sig` to its process group; SIGKILL after the grace period) and
        start it again on the same port, certificates and etcd; every client sees it go away and
        come back. Returns the seconds it was not serving. The other components keep running."""
        [old] = [c for c in self._components if c.name == "kube-apiserver"]
        index = self._components.index(old)
        t0 = time.monotonic()
        _signal_group(old.process, sig)
        try:
            old.process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            _signal_group(old.process, signal.SIGKILL)
            old.process.wait(timeout=10)
        self._components.remove(old)
        self._start_apiserver()
        # Back in its place: stop() takes the clients down before it and etcd after it.
        self._components.insert(index, self._components.pop())
        return time.monotonic() - t0

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this control plane; text in and out."""
        proc = subprocess.run(
            [str(self.bin("kubectl")), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,  # raised below with kubectl's stderr
        )
        if check and proc.returncode != 0:
            raise ControlPlaneError(
                f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr.strip()}"
            )
        return proc

    def get_json(self, *args: str) -> Any:
        """`kubectl get ARGS -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply_yaml(self, text: str) -> str:
        """Server-side apply of one or more YAML documents; returns kubectl's output."""
        return self.kubectl(
            "apply", "--server-side", "--force-conflicts", "--field-manager=rlkube-tests",
            "-f", "-", input=text,
        ).stdout

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bin("helm")), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True, text=True, timeout=120, env=self.env(), check=False,
        )
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def create_namespace(self, name: str, timeout: float = 60) -> None:
        """Create a namespace and wait for its default service account (pods need it)."""
        self.apply_yaml(f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n")
        self.wait_for(
            lambda: self.kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0,
            timeout,
            f"service account default in namespace {name}",
        )

    def wait_for(
        self, predicate: Callable[[], T], timeout: float = 60, what: str = "condition", interval: float = 0.25
    ) -> T:
        """Poll ``predicate`` until it returns a truthy value, and return that value.

        Exceptions from the predicate count as 'not yet' (the last one is quoted on timeout); a
        component that died meanwhile fails the wait at once with its log tail.
        """
        deadline = time.monotonic() + timeout
        last_error: BaseException | None = None
        while True:
            try:
                value = predicate()
                if value:
                    return value
            except (ControlPlaneError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                last_error = exc
            self._check_alive()
            if time.monotonic() >= deadline:
                detail = f"; last error: {last_error}" if last_error else ""
                raise ControlPlaneError(f"timed out after {timeout:g} s waiting for {what}{detail}")
            time.sleep(interval)

    def inject_pod_failure(
        self,
        namespace: str,
        pod_name: str,
        exit_code: int = 1,
        reason: str = "Error",
        message: str = "failure injected by the test",
        container: str | None = None,
    ) -> None:
        """Make kwok fail a Running pod: its container(s) terminate with ``exit_code`` and the pod
        goes to phase Failed, about one to two seconds later (the chaos stage's delay)."""
        annotations = [
            f"{CHAOS_POD_FAILED}/exit-code={exit_code}",
            f"{CHAOS_POD_FAILED}/reason={reason}",
            f"{CHAOS_POD_FAILED}/message={message}",
        ]
        if container:
            annotations.append(f"{CHAOS_POD_FAILED}/container-name={container}")
        self.kubectl("-n", namespace, "annotate", "--overwrite", "pod", pod_name, *annotations)
        self.kubectl("-n", namespace, "label", "--overwrite", "pod", pod_name, f"{CHAOS_POD_FAILED}=true")

    def kube_client(self):  # -> kubernetes.client.ApiClient
        """An API client of the `kubernetes` package for this control plane."""
        from kubernetes import config  # imported here: only tests that use it need it

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def issue_cert(
        self, name: str, common_name: str, groups: list[str] = (), sans: list[str] = (), server: bool = False
    ) -> tuple[Path, Path]:
        """A certificate signed by the cluster CA, written as ``pki/<name>.crt`` and ``.key``; returns
        both paths. Client certificates (``server=False``) authenticate as user ``common_name`` in
        ``groups``; serving certificates name their hosts in ``sans``."""
        pki = self._dir / "pki"
        ca_key, ca_cert = _load_ca(pki)
        key, cert = _make_cert(ca_key, ca_cert, common_name, list(groups), list(sans), server=server)
        _write_pem(pki / f"{name}.crt", cert)
        _write_pem(pki / f"{name}.key", key)
        return pki / f"{name}.crt", pki / f"{name}.key"

    def issue_kubeconfig(self, name: str, common_name: str, groups: list[str] = ()) -> Path:
        """A kubeconfig for user ``common_name`` in ``groups`` (a client certificate signed by the
        cluster CA), written next to the admin one; returns its path."""
        self.issue_cert(name, common_name, groups)
        path = self._dir / f"{name}.kubeconfig"
        self._write_kubeconfig(name, path)
        return path

    # ---------------------------------------------------------------- certificates

    @property
    def _dir(self) -> Path:
        if self._workdir is None:
            raise ControlPlaneError("the control plane is not running (call start() first)")
        return self._workdir

    def _write_certs(self) -> None:
        pki = self._dir / "pki"
        pki.mkdir()
        ca_key, ca_cert = _make_ca()
        _write_pem(pki / "ca.crt", ca_cert)
        _write_pem(pki / "ca.key", ca_key)
        sans = ["127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local", str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))]
        if self.node_address:
            sans.append(self.node_address)
        key, cert = _make_cert(ca_key, ca_cert, "kube-apiserver", [], sans, server=True)
        _write_pem(pki / "apiserver.crt", cert)
        _write_pem(pki / "apiserver.key", key)
        for user, name, groups in (
            ("admin", "admin", ["system:masters"]),
            ("kube-controller-manager", "system:kube-controller-manager", []),
            ("kube-scheduler", "system:kube-scheduler", []),
            # How the API server authenticates to kubelets (logs, exec, port-forward); the name
            # kubeadm uses, granted system:kubelet-api-admin by the real node (tests/node).
            ("kubelet-client", "kube-apiserver-kubelet-client", []),
        ):
            key, cert = _make_cert(ca_key, ca_cert, name, groups, [], server=False)
            _write_pem(pki / f"{user}.crt", cert)
            _write_pem(pki / f"{user}.key", key)
        sa_key = _new_key()
        _write_pem(pki / "sa.key", sa_key)
        _write_pem(pki / "sa.pub", sa_key.public_key())

    def _write_kubeconfigs(self) -> None:
        pki = self._dir / "pki"
        for user, path in (
            ("admin", self.kubeconfig),
            ("kube-controller-manager", self._dir / "controller-manager.kubeconfig"),
            ("kube-scheduler", self._dir / "scheduler.kubeconfig"),
        ):
            self._write_kubeconfig(user, path)

    def _write_kubeconfig(self, user: str, path: Path) -> None:
        """A kubeconfig for the client certificate pki/<user>.crt."""
        pki = self._dir / "pki"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "rlkube-test", "cluster": {
                        "server": self.server, "certificate-authority": str(pki / "ca.crt")}}],
                    "users": [{"name": user, "user": {
                        "client-certificate": str(pki / f"{user}.crt"),
                        "client-key": str(pki / f"{user}.key")}}],
                    "contexts": [{"name": "rlkube-test", "context": {
                        "cluster": "rlkube-test", "user": user, "namespace": "default"}}],
                    "current-context": "rlkube-test",
                },
                indent=1,
            )
        )

    # ---------------------------------------------------------------- components

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Component:
        args = [*args, *self.extra_args.get(name, [])]
        log_path = self.logs_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the child keeps it; closed below after fork
        try:
            from rlkube_runtime import proc  # here: importing this module must stay stdlib-only (check_prereqs)

            # Own process group, so stop() can signal all of it; killed if the test process dies.
            process = proc.start(args, stdout=log, cwd=self._dir, env=env or _clean_env())
        finally:
            log.close()
        component = Component(name, process, log_path)
        self._components.append(component)
        self.started_pids.append(process.pid)
        return component

    def _start_etcd(self, peer_port: int) -> None:
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        etcd = self._spawn("etcd", [
            str(self.bin("etcd")),
            "--name=default",
            f"--data-dir={self._dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync",  # test data: durability is not worth the disk latency
            "--log-level=warn",
        ])
        self._wait_component(etcd, lambda: _http_ok(f"{client}/health"), START_TIMEOUT, "etcd /health")

    def _start_apiserver(self) -> None:
        pki = self._dir / "pki"
        address = self.node_address or "127.0.0.1"
        if self.node_address:
            # For kubelets: nodes authorized as nodes, and the API server calling them back with
            # its own client certificate, checking theirs, at their InternalIP first. Listening
            # on node_address lets the default endpoint reconciler publish it for the `kubernetes`
            # Service, which is how pods reach the API server.
            for_nodes = [
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kubelet-client.key'}",
                f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
            ]
        else:
            for_nodes = [
                "--authorization-mode=RBAC",
                # The "kubernetes" Service cannot get endpoints on a loopback address; nothing here needs them.
                "--endpoint-reconciler-type=none",
            ]
        apiserver = self._spawn("kube-apiserver", [
            str(self.bin("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--bind-address={address}",
            f"--advertise-address={address}",
            f"--secure-port={self.api_port}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            *for_nodes,
        ])
        self._wait_component(apiserver, self._apiserver_ready, START_TIMEOUT, "kube-apiserver /readyz")

    def _apiserver_ready(self) -> bool:
        pki = self._dir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return _http_ok(f"{self.server}/readyz", ctx)

    def _start_controller_manager(self, port: int) -> None:
        pki = self._dir / "pki"
        kubeconfig = self._dir / "controller-manager.kubeconfig"
        self._spawn("kube-controller-manager", [
            str(self.bin("kube-controller-manager")),
            f"--kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self._dir / 'controller-manager-certs'}",
            "--controllers=*",  # all default-on ones: garbagecollector, namespace, serviceaccount, ...
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false",
        ])

    def _start_scheduler(self, port: int) -> None:
        kubeconfig = self._dir / "scheduler.kubeconfig"
        self._spawn("kube-scheduler", [
            str(self.bin("kube-scheduler")),
            f"--kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self._dir / 'scheduler-certs'}",
            "--leader-elect=false",
        ])

    def _install_kwok_stages(self) -> None:
        """kwok reads its Stages from the API server (--enable-crds=Stage), so tests can add more."""
        kwok = self.cache / "kwok"
        self.kubectl("apply", "--server-side", "-f", str(kwok / "crd"))
        self._wait_established(["stages.kwok.x-k8s.io"], START_TIMEOUT)
        stage_files = [
            kwok / "stage/node-fast/node-initialize.yaml",
            kwok / "stage/node-heartbeat/node-heartbeat.yaml",
            *sorted((kwok / "stage/pod-fast").glob("pod-*.yaml")),
            kwok / "stage/pod-chaos/pod-container-running-failed.yaml",
        ]
        args = [arg for path in stage_files for arg in ("-f", str(path))]
        self.kubectl("apply", "--server-side", *args)

    def _start_kwok(self) -> None:
        home = self._dir / "kwok-home"  # keeps kwok away from a ~/.kwok/kwok.yaml of the user
        home.mkdir()
        env = _clean_env()
        env["HOME"] = str(home)
        key, value = KWOK_NODE_ANNOTATION
        self._spawn("kwok", [
            str(self.bin("kwok")),
            f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={key}={value}",
            "--enable-crds=Stage",
            "--node-lease-duration-seconds=40",
            "--cidr=10.244.0.0/16",
            "--node-ip=10.240.0.1",
        ], env=env)

    def _create_nodes(self) -> None:
        if self.nodes == 0:  # a real node's cluster (tests/node) may want no fake ones
            return
        key, value = KWOK_NODE_ANNOTATION
        docs = []
        for i in range(self.nodes):
            name = f"kwok-node-{i}"
            resources = {
                "cpu": self.cpu_per_node,
                "memory": self.memory_per_node,
                "pods": "110",
                "nvidia.com/gpu": str(self.gpus_per_node),
            }
            docs.append({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {key: value, "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        "type": "kwok",
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "node-role.kubernetes.io/agent": "",
                    },
                },
                "spec": {},
                # kwok's node-initialize stage fills in conditions, addresses and nodeInfo.
                "status": {"capacity": resources, "allocatable": resources},
            })
        self.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))

    def _begin_kuberay_crds(self) -> None:
        # `create`, not apply: the cluster is new, and this skips both the last-applied annotation (too
        # large for these CRDs) and server-side apply's managed-fields work on 3 MB of schema.
        log_path = self.logs_dir / "kuberay-crds.log"
        with open(log_path, "ab") as log:
            self._crd_install = subprocess.Popen(
                [str(self.bin("kubectl")), f"--kubeconfig={self.kubeconfig}", "create", "--validate=false",
                 "-f", str(self.cache / "kuberay/crd")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def _install_kuberay_crds(self) -> None:
        assert self._crd_install is not None
        try:
            code = self._crd_install.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            log = (self.logs_dir / "kuberay-crds.log").read_text(errors="replace")
            raise ControlPlaneError(f"installing the KubeRay CRDs failed (exit {code}):\n{log[-3000:]}")
        self._wait_established(["rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io"], START_TIMEOUT)

    def _wait_established(self, crds: list[str], timeout: float) -> None:
        # Not `kubectl wait`: it fails at once on a CRD whose status has no conditions yet.
        def established() -> bool:
            got = self.get_json("crd", *crds)
            items = got.get("items", [got])  # one name gets the object itself, not a List
            return all(
                any(c["type"] == "Established" and c["status"] == "True" for c in crd.get("status", {}).get("conditions", []))
                for crd in items
            ) and len(items) == len(crds)

        self.wait_for(established, timeout, f"CRDs {', '.join(crds)} established")

    def _start_kuberay(self, metrics_port: int) -> None:
        env = _clean_env()
        env["KUBECONFIG"] = str(self.kubeconfig)
        self._spawn("kuberay-operator", [
            str(self.bin("kuberay-operator")),
            f"--metrics-addr=127.0.0.1:{metrics_port}",
            f"--health-probe-bind-address=127.0.0.1:{self.kuberay_probe_port}",
            "--enable-leader-election=false",
            "--log-stdout-encoder=console",
        ], env=env)

    def _wait_healthy(self, cm_port: int, sched_port: int) -> None:
        by_name = {c.name: c for c in self._components}
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # their serving certs are self-signed, made at start
        self._wait_component(by_name["kube-controller-manager"],
                             lambda: _http_ok(f"https://127.0.0.1:{cm_port}/healthz", insecure),
                             START_TIMEOUT, "kube-controller-manager /healthz")
        self._wait_component(by_name["kube-scheduler"],
                             lambda: _http_ok(f"https://127.0.0.1:{sched_port}/healthz", insecure),
                             START_TIMEOUT, "kube-scheduler /healthz")
        self._wait_component(by_name["kwok"], self._nodes_ready, START_TIMEOUT, f"{self.nodes} kwok nodes Ready")
        self._wait_component(
            by_name["kube-controller-manager"],
            lambda: self.kubectl("-n", "default", "get", "serviceaccount", "default", check=False).returncode == 0,
            START_TIMEOUT, "service account default/default (kube-controller-manager)",
        )
        if self.start_kuberay:
            self._wait_component(by_name["kuberay-operator"],
                                 lambda: _http_ok(f"http://127.0.0.1:{self.kuberay_probe_port}/readyz"),
                                 START_TIMEOUT, "kuberay-operator /readyz")

    def _nodes_ready(self) -> bool:
        items = self.get_json("nodes", "-l", "type=kwok")["items"]
        ready = [
            n for n in items
            if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
        ]
        return len(ready) == self.nodes

    def _wait_component(self, component: Component, check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = component.process.poll()
            if code is not None:
                raise ControlPlaneError(
                    f"{component.name} exited with code {code} while waiting for {what}; "
                    f"last lines of {component.log_path}:\n{component.log_tail()}"
                )
            try:
                if check():
                    return
            except (OSError, ControlPlaneError, ValueError, KeyError):
                pass
            if time.monotonic() >= deadline:
                raise ControlPlaneError(
                    f"timed out after {timeout:g} s waiting for {what}; "
                    f"last lines of {component.log_path}:\n{component.log_tail()}"
                )
            time.sleep(0.2)

    def _check_alive(self) -> None:
        for component in self._components:
            code = component.process.poll()
            if code is not None:
                raise ControlPlaneError(
                    f"{component.name} died (exit code {code}); "
                    f"last lines of {component.log_path}:\n{component.log_tail()}"
                )


# -------------------------------------------------------------------- helpers


def processes_in_groups(pgids: list[int]) -> list[tuple[int, str]]:
    """(pid, command name) of every live process whose process group is one of ``pgids``.

    Components lead their own groups, so after stop() this must be empty; zombies count as gone.
    """
    found = []
    wanted = set(pgids)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after the last ')'.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp in wanted and state != "Z":
            found.append((int(entry.name), comm))
    return found



def _free_ports(count: int) -> list[int]:
    """Ports the kernel hands out now; held open together so they are distinct."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _clean_env() -> dict[str, str]:
    # Components must not pick up a developer's cluster through KUBECONFIG.
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return env


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    from rlkube_runtime import proc

    proc.signal_group(process, sig)


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _make_ca():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlkube-test-ca")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_cert(ca_key, ca_cert, common_name: str, groups: list[str], sans: list[str], server: bool):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _new_key()
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
    )
    if sans:
        names: list[x509.GeneralName] = []
        for san in sans:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(san)))
            except ValueError:
                names.append(x509.DNSName(san))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _load_ca(pki: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    return key, x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())


def _write_pem(path: Path, obj) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if isinstance(obj, x509.Certificate):
        data = obj.public_bytes(serialization.Encoding.PEM)
    elif isinstance(obj, ec.EllipticCurvePrivateKey):
        data = obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    else:
        data = obj.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    path.write_bytes(data)
    if isinstance(obj, ec.EllipticCurvePrivateKey):
        path.chmod(0o600)
