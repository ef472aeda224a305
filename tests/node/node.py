"""A real one-node Kubernetes cluster on this machine: pods run in containers.

The test control plane (tests/controlplane/harness.py) plus a node: containerd with runc and the CNI
bridge, kubelet, kube-proxy (iptables), CoreDNS and a hostPath StorageClass with its provisioner
(tests/node/provisioner.py), all built or installed by ``tests/node/build.sh``.

    cluster = Cluster()          # ControlPlane(node_address=this machine) + RealNode
    cluster.start()
    try:
        cluster.kubectl("get", "nodes")
    finally:
        cluster.stop()

Needs root and Linux. containerd 1.6 and kubelet keep some state at fixed paths (/var/lib/kubelet,
/var/log/pods), so there is one node per machine at a time: ``start()`` takes a file lock, waits for a
node another process runs (up to ``lock_timeout``), and clears what a crashed run left behind.
Images live in containerd's store under /var/lib/rlkube/containerd and outlive the node, so an image
loaded once (``load_image``, ``images/build.sh``) is there for every later node.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONTROLPLANE_DIR = HERE.parent / "controlplane"
if str(CONTROLPLANE_DIR) not in sys.path:
    sys.path.insert(0, str(CONTROLPLANE_DIR))
# rlkube_runtime.proc (stdlib only) starts the components: importable from the source tree too, for
# the system python3 that images/build.sh and `make cluster-down` call this with.
RUNTIME_DIR = HERE.parents[1] / "runtime"
if str(RUNTIME_DIR) not in sys.path:
    sys.path.append(str(RUNTIME_DIR))

from harness import (  # noqa: E402 - needs the sys.path entry above
    SERVICE_CIDR,
    START_TIMEOUT,
    STOP_GRACE_SECONDS,
    Component,
    ControlPlane,
    ControlPlaneError,
    _clean_env,
    _free_ports,
    _http_ok,
    _signal_group,
    read_versions,
)

BUILD_COMMAND = "bash tests/node/build.sh"

# Fixed paths (one node per machine). STATE is removed on stop; ROOT keeps containerd's images.
STATE = Path("/run/rlkube")
ROOT = Path("/var/lib/rlkube")
CONTAINERD_ROOT = ROOT / "containerd"
CONTAINERD_STATE = STATE / "containerd"
CONTAINERD_SOCKET = CONTAINERD_STATE / "containerd.sock"
VOLUMES = ROOT / "volumes"  # the provisioner's PersistentVolumes, one directory each
LOCK_FILE = Path("/run/rlkube-node.lock")  # outside STATE, which stop() removes
KUBELET_DIR = Path("/var/lib/kubelet")  # kubelet's default; its device-plugin path is fixed below it
POD_LOG_DIRS = (Path("/var/log/pods"), Path("/var/log/containers"))  # fixed in kubelet
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
K8S_NAMESPACE = "k8s.io"  # containerd namespace of the CRI plugin

NODE_NAME = "rlkube-node"
NODE_LABELS = {"type": "real"}  # kwok's nodes carry type=kwok
BRIDGE = "rlkube0"
CNI_NETWORK = "rlkube"
POD_SUBNET = "10.244.0.0/24"
CLUSTER_DOMAIN = "cluster.local"
CLUSTER_DNS = str(ipaddress.ip_network(SERVICE_CIDR)[10])  # 10.0.0.10, as kubeadm picks it
STORAGE_CLASS = "rlkube-local"
PROVISIONER = "rlkube.local/hostpath"

# buildah pushes here on its way into containerd (load_buildah_image): an OCI layout whose layer
# blobs are sparse placeholders, named by their uncompressed digests, of what containerd holds.
OCI_LAYOUT = ROOT / "oci-layout"
OCI_REF_NAME = "org.opencontainers.image.ref.name"

# Label on an image loaded from buildah: the buildah image id it was loaded from, so that loading
# the same image again can be skipped.
IMAGE_ID_LABEL = "rlkube.dev/buildah-image-id"


class NodeError(ControlPlaneError):
    """The node could not start, a component died, or a wait timed out."""


def node_cache_dir() -> Path:
    """Where build.sh put kubelet, kube-proxy, coredns and the pause image archive."""
    v = read_versions()
    key = f"k8s-{v['KUBERNETES_VERSION']}_coredns-{v['COREDNS_VERSION']}_pause-{v['PAUSE_VERSION']}"
    root = os.environ.get("RLKUBE_NODE_CACHE") or Path.home() / ".cache/rlkube/node"
    return Path(root) / key


def pause_image() -> str:
    return f"localhost/rlkube/pause:{read_versions()['PAUSE_VERSION']}"


def missing_prerequisites() -> list[str]:
    """What start() needs and does not have, each with what to do about it."""
    problems = []
    if not sys.platform.startswith("linux"):
        return ["a real node needs Linux"]
    if os.geteuid() != 0:
        problems.append("a real node needs root (containerd, kubelet, iptables, mounts)")
    cache = node_cache_dir()
    for name in ("bin/kubelet", "bin/kube-proxy", "bin/coredns", "pause.docker.tar"):
        if not (cache / name).exists():
            problems.append(f"{cache / name} is missing: run `{BUILD_COMMAND}`")
    for cmd in ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "iptables-save", "ip",
                "conntrack"):
        if shutil.which(cmd) is None:
            problems.append(f"{cmd} is not on PATH: run `{BUILD_COMMAND}` (it installs it with apt-get)")
    for plugin in ("bridge", "host-local", "portmap", "loopback"):
        if not (CNI_BIN_DIR / plugin).exists():
            problems.append(f"CNI plugin {CNI_BIN_DIR / plugin} is missing: apt-get install containernetworking-plugins")
    return problems


def node_ip() -> str:
    """This machine's address on its default route (RLKUBE_NODE_IP overrides): where pods reach the
    API server and CoreDNS, and the node's InternalIP."""
    if os.environ.get("RLKUBE_NODE_IP"):
        return os.environ["RLKUBE_NODE_IP"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2; no packet is sent, the kernel picks the source
        except OSError as exc:
            raise NodeError(f"no default route to pick the node's address from ({exc}); set RLKUBE_NODE_IP") from exc
        address = s.getsockname()[0]
    if ipaddress.ip_address(address).is_loopback:
        raise NodeError(f"the default route's source {address} is a loopback address; set RLKUBE_NODE_IP")
    return address


# ---------------------------------------------------------------------------------------- containerd


def containerd_config(pause: str) -> str:
    # restrict_oom_score_adj: runc cannot lower oom_score_adj below containerd's own on a VM without
    # CAP_SYS_RESOURCE, and kubelet asks for -997 for Guaranteed pods; this caps it instead of failing.
    # netns under the state dir: stop() finds every namespace there, even after a crash.
    return f"""\
version = 2
root = "{CONTAINERD_ROOT}"
state = "{CONTAINERD_STATE}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{STATE / 'runc'}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{STATE / 'cni' / 'net.d'}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{ROOT / 'opt'}"
"""


def ctr(*args: str, input: bytes | None = None, check: bool = True, timeout: float | None = 600,
        stdin=None) -> subprocess.CompletedProcess[bytes]:
    """containerd's own client on the node's socket, in the CRI namespace."""
    proc = subprocess.run(
        ["ctr", f"--address={CONTAINERD_SOCKET}", f"--namespace={K8S_NAMESPACE}", *args],
        input=input, stdin=stdin, capture_output=True, timeout=timeout, check=False,
    )
    if check and proc.returncode != 0:
        raise NodeError(f"ctr {' '.join(args)} exited {proc.returncode}: {proc.stderr.decode(errors='replace').strip()}")
    return proc


def cri_name(ref: str) -> str:
    """What containerd's CRI plugin resolves an image reference to (docker.io for bare names)."""
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return ref
    return f"docker.io/{ref}" if rest else f"docker.io/library/{ref}"


def buildah_name(ref: str) -> str:
    """What buildah names an image tagged ``ref`` (localhost/ for bare names)."""
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return ref
    return f"localhost/{ref}"


def containerd_serving() -> bool:
    if not CONTAINERD_SOCKET.exists():
        return False
    return ctr("version", check=False, timeout=10).returncode == 0


def loaded_images() -> dict[str, dict[str, str]]:
    """containerd's images in the CRI namespace: name -> labels."""
    return {name: labels for name, (_, _, labels) in _image_records().items()}


def _image_records() -> dict[str, tuple[str, str, dict[str, str]]]:
    """name -> (media type, digest, labels) of each image in the CRI namespace."""
    out = ctr("images", "ls").stdout.decode()
    images = {}
    for line in out.splitlines()[1:]:
        # REF TYPE DIGEST SIZE(two words) PLATFORMS LABELS
        fields = line.split()
        if len(fields) < 3:
            continue
        labels = {}
        if fields[-1] != "-" and "=" in fields[-1]:
            for item in fields[-1].split(","):
                k, _, v = item.partition("=")
                labels[k] = v
        images[fields[0]] = (fields[1], fields[2], labels)
    return images


def import_image_archive(archive: Path) -> None:
    ctr("images", "import", str(archive))


def load_buildah_image(source: str, name: str) -> int | None:
    """Copy a buildah image into containerd's CRI namespace as ``name`` (e.g.
    ``docker.io/rlkube/operator:0.1.0``, what CRI makes of ``rlkube/operator:0.1.0``), unless
    containerd already holds this very image (same buildah image id). containerd must be serving.
    Returns the bytes of layers sent, None when the image was there already.

    Only the layers containerd lacks travel, and buildah reads only those. It pushes into an OCI
    layout (OCI_LAYOUT) and skips every layer for which a file named by the layer's uncompressed
    digest is there; the layout holds such a file, sparse (no disk), for every layer containerd
    has. Those layers come out of the push under their uncompressed digests, and the manifest is
    rewritten to name them as containerd holds them (compressed); the layers buildah did write
    (compressed: an OCI layout always gets compressed layers) stream into ``ctr images import`` as
    an OCI archive that carries only them, and become placeholders in turn. After a code change
    only each image's last layers are read, compressed, sent and unpacked."""
    image_id = subprocess.run(
        ["buildah", "inspect", "--type=image", "--format={{.FromImageID}}", source],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    if loaded_images().get(name, {}).get(IMAGE_ID_LABEL) == image_id and _complete(name):
        return None
    OCI_LAYOUT.mkdir(parents=True, exist_ok=True)
    with open(OCI_LAYOUT / ".lock", "w") as lock:  # one load at a time uses the layout
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            sent = _load_through_layout(source, name, image_id)
            problem = None if _complete(name) else "containerd lacks some of its blobs after the import"
        except NodeError as exc:
            problem = str(exc)
        if problem:
            # containerd's garbage collector can take a blob between our look at its content and
            # the import (an image removed just before): once more, sending every layer.
            print(f"loading {name} again with every layer ({problem})", file=sys.stderr)
            sent = _load_through_layout(source, name, image_id, trust_content=False)
    return sent


def _complete(name: str) -> bool:
    """Whether containerd holds every blob of image ``name`` (`ctr images check`)."""
    out = ctr("images", "check", f"name=={name}", check=False).stdout.decode().splitlines()
    return len(out) == 2 and " complete (" in out[1]


def _held_layers(in_containerd: set[str]) -> dict[str, dict]:
    """uncompressed digest (diff id) -> the descriptor of the blob containerd holds that layer as,
    over the layers of every image containerd has."""
    held = {}
    for media_type, digest, _ in _image_records().values():
        if not media_type.endswith(("manifest.v1+json", "manifest.v2+json")):
            continue  # an index: not what buildah makes
        manifest = json.loads(ctr("content", "get", digest).stdout)
        if manifest["config"]["digest"] not in in_containerd:
            continue
        config = json.loads(ctr("content", "get", manifest["config"]["digest"]).stdout)
        for diff_id, layer in zip(config["rootfs"]["diff_ids"], manifest["layers"]):
            if layer["digest"] in in_containerd:
                held[diff_id] = {key: layer[key] for key in ("mediaType", "digest", "size")}
    return held


def _load_through_layout(source: str, name: str, image_id: str, trust_content: bool = True) -> int:
    in_containerd = set(ctr("content", "ls", "--quiet").stdout.decode().split()) if trust_content else set()
    held = _held_layers(in_containerd)
    blobs = OCI_LAYOUT / "blobs" / "sha256"
    # The layout holds exactly a placeholder per layer containerd has, named by its diff id.
    shutil.rmtree(blobs, ignore_errors=True)
    blobs.mkdir(parents=True)
    for diff_id, layer in held.items():
        _placeholder(blobs / diff_id.split(":")[1], layer["size"])
    # An OCI layout always gets compressed layers (buildah 1.28 ignores --disable-compression for
    # it); zstd costs about a third less CPU than gzip here, and containerd 1.6 unpacks it.
    subprocess.run(["buildah", "push", "--quiet", "--compression-format=zstd", source, f"oci:{OCI_LAYOUT}:{name}"],
                   capture_output=True, text=True, check=True)
    index = json.loads((OCI_LAYOUT / "index.json").read_text())
    [pushed] = [m for m in index["manifests"] if m.get("annotations", {}).get(OCI_REF_NAME) == name]
    (OCI_LAYOUT / "index.json").unlink()  # the next push starts a fresh index
    manifest = json.loads((blobs / pushed["digest"].split(":")[1]).read_bytes())
    config = json.loads((blobs / manifest["config"]["digest"].split(":")[1]).read_bytes())
    layers, written = [], []
    for diff_id, layer in zip(config["rootfs"]["diff_ids"], manifest["layers"]):
        if layer["digest"] == diff_id and diff_id in held:  # skipped: named as containerd has it
            layers.append(held[diff_id])
        else:
            layers.append(layer)
            written.append((diff_id, layer))
    manifest["layers"] = layers
    manifest_bytes = json.dumps(manifest).encode()
    digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    # Imported under a name of its own, then renamed: while the import unpacks, the image it replaces
    # still holds the snapshots of the layers the two share (containerd's garbage collector would
    # otherwise take them the moment the name moves, under the unpacking import).
    loading = f"{name}-loading"
    entry = {"mediaType": pushed["mediaType"], "digest": digest, "size": len(manifest_bytes),
             "annotations": {OCI_REF_NAME: loading, "io.containerd.image.name": loading}}
    sent = 0
    with tempfile.TemporaryFile() as output:
        importer = subprocess.Popen(
            ["ctr", f"--address={CONTAINERD_SOCKET}", f"--namespace={K8S_NAMESPACE}", "images", "import", "-"],
            stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT,
        )
        assert importer.stdin is not None
        try:
            with tarfile.open(fileobj=importer.stdin, mode="w|", copybufsize=4 << 20) as tar:
                _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
                _add_bytes(tar, "index.json", json.dumps({"schemaVersion": 2, "manifests": [entry]}).encode())
                _add_bytes(tar, f"blobs/sha256/{digest.split(':')[1]}", manifest_bytes)
                if manifest["config"]["digest"] not in in_containerd:
                    path = blobs / manifest["config"]["digest"].split(":")[1]
                    tar.add(path, arcname=f"blobs/sha256/{path.name}")
                for diff_id, layer in written:
                    path = blobs / layer["digest"].split(":")[1]
                    if layer["digest"] not in in_containerd:
                        tar.add(path, arcname=f"blobs/sha256/{path.name}")
                        sent += layer["size"]
                    path.unlink()
                    _placeholder(blobs / diff_id.split(":")[1], layer["size"])
        except BrokenPipeError:
            pass  # ctr stopped reading: its exit code and output below say why
        finally:
            with contextlib.suppress(BrokenPipeError):
                importer.stdin.close()
            # No time limit: a first load of an 8 GB image takes minutes, more when the cores are busy.
            code = importer.wait()
        output.seek(0)
        if code != 0:
            raise NodeError(f"ctr images import of {name} exited {code}: {output.read().decode(errors='replace').strip()}")
    ctr("images", "tag", "--force", loading, name)
    ctr("images", "rm", loading)
    ctr("images", "label", name, f"{IMAGE_ID_LABEL}={image_id}")
    _remove_orphaned_id_references()
    return sent


def _remove_orphaned_id_references() -> None:
    """containerd's CRI plugin gives every image it sees a second name, its id (sha256:<config>),
    and keeps it when the first name moves to a newer image; with kubelet's image GC off nothing
    removes it, so every replaced image would stay on disk. Such an id no name points at goes."""
    records = _image_records()
    named = {digest for name, (_, digest, _) in records.items() if not name.startswith("sha256:")}
    for name, (_, digest, _) in records.items():
        if name.startswith("sha256:") and digest not in named:
            ctr("images", "rm", name, check=False)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _placeholder(path: Path, size: int) -> None:
    """A sparse file of ``size`` bytes: buildah takes it for a blob it need not write."""
    with open(path, "wb") as f:
        f.truncate(size)


# -------------------------------------------------------------------------------------------- lock


class NodeLock:
    """The machine-wide lock of the one real node (flock on LOCK_FILE; the kernel drops it when the
    holder dies, so a crash never leaves it held). The file names the holder, for the error."""

    def __init__(self) -> None:
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float, what: str) -> None:
        if self._fd is not None:
            return
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
                    os.close(fd)
                    raise NodeError(
                        f"another real node runs on this machine ({holder or 'holder unknown'}); waited "
                        f"{timeout:g} s for {LOCK_FILE}. Stop it (`make cluster-down` if it is the "
                        f"user cluster) or wait for its test run to finish"
                    ) from None
                time.sleep(1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {what}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


@contextlib.contextmanager
def containerd_for_loading(logs_dir: Path | None = None) -> Iterator[None]:
    """containerd serving on the node's socket for the duration: the running node's, or one started
    for this and stopped after (under the node lock, so no node starts meanwhile)."""
    if containerd_serving():
        yield
        return
    lock = NodeLock()
    lock.acquire(timeout=600, what="loading images into containerd")
    process = None
    try:
        if containerd_serving():  # a node came up while we waited for the lock
            yield
            return
        log_dir = logs_dir or Path(tempfile.gettempdir())
        process = _start_containerd(log_dir / "containerd-load.log")
        yield
    finally:
        if process is not None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_SECONDS * 2)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        lock.release()


def _start_process(args: list[str], log, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """A node component in its own process group, killed if this process dies (rlkube_runtime.proc)."""
    from rlkube_runtime import proc  # here: importing this module must stay stdlib-only (check_prereqs)

    return proc.start(args, stdout=log, env=env or _clean_env(), cwd=cwd)


def _start_containerd(log_path: Path) -> subprocess.Popen:
    CONTAINERD_STATE.mkdir(parents=True, exist_ok=True)
    CONTAINERD_ROOT.mkdir(parents=True, exist_ok=True)
    config = STATE / "containerd.toml"
    config.write_text(containerd_config(pause_image()))
    with open(log_path, "ab") as log:
        process = _start_process(["containerd", f"--config={config}"], log)
    deadline = time.monotonic() + 60
    while not containerd_serving():
        if process.poll() is not None or time.monotonic() > deadline:
            _signal_group(process, signal.SIGKILL)
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise NodeError(f"containerd did not come up (exit {process.poll()}); last lines of {log_path}:\n{tail}")
        time.sleep(0.1)
    return process


# -------------------------------------------------------------------------------------------- node


class RealNode:
    """A kubelet node named ``rlkube-node`` on this machine, joined to ``control_plane``, which must
    have been started with ``node_address`` (this machine's address; see ``node_ip()``).

    ``start()`` runs containerd, kubelet (cgroupfs driver), kube-proxy (iptables), CoreDNS (a process
    on the host behind the ``kube-dns`` Service at 10.0.0.10, the clusterDNS kubelet hands pods) and
    the hostPath provisioner behind the default StorageClass ``rlkube-local``; ``stop()`` removes
    every pod, container, network namespace, iptables chain, mount and directory they made. Each
    component logs to ``logs_dir/<name>.log``.
    """

    def __init__(self, control_plane: ControlPlane, logs_dir: str | os.PathLike | None = None,
                 lock_timeout: float = 900) -> None:
        if not control_plane.node_address:
            raise NodeError("the control plane must be started with node_address=node_ip() for a real node")
        self.cp = control_plane
        self.address = control_plane.node_address
        self.cache = node_cache_dir()
        self.bin_dir = self.cache / "bin"
        self.lock = NodeLock()
        self.lock_timeout = lock_timeout
        self._logs_dir_arg = Path(logs_dir) if logs_dir is not None else None
        self._components: list[Component] = []
        self.started_pids: list[int] = []
        self._stopped = True
        self.kubelet_port = self.kubelet_healthz_port = 0
        self.proxy_healthz_port = self.proxy_metrics_port = 0
        self.dns_port = self.dns_health_port = self.dns_ready_port = 0
        self.timings: dict[str, float] = {}

    @property
    def name(self) -> str:
        return NODE_NAME

    @property
    def logs_dir(self) -> Path:
        return self._logs_dir_arg or self.cp.logs_dir

    @property
    def pids(self) -> list[int]:
        return [c.process.pid for c in self._components]

    def start(self) -> RealNode:
        problems = missing_prerequisites()
        if problems:
            raise NodeError("cannot start a real node:\n  " + "\n  ".join(problems))
        self.lock.acquire(self.lock_timeout, f"real node for the control plane at {self.cp.server}")
        self._stopped = False
        try:
            t0 = time.monotonic()

            def mark(phase: str) -> None:
                self.timings[phase] = round(time.monotonic() - t0, 2)

            self.logs_dir.mkdir(parents=True, exist_ok=True)
            clean_host()  # whatever a crashed run left behind
            mark("clean")
            for d in (STATE / "cni" / "net.d", STATE / "kubelet", VOLUMES, KUBELET_DIR, *POD_LOG_DIRS):
                d.mkdir(parents=True, exist_ok=True)
            _set_sysctls()
            self._write_cni_config()
            process = _start_containerd(self.logs_dir / "containerd.log")
            self._adopt("containerd", process, self.logs_dir / "containerd.log")
            if pause_image() not in loaded_images():
                import_image_archive(self.cache / "pause.docker.tar")
            mark("containerd")
            (self.kubelet_port, self.kubelet_healthz_port, self.proxy_healthz_port, self.proxy_metrics_port,
             self.dns_health_port, self.dns_ready_port) = _free_ports(6)
            self.dns_port = _free_udp_tcp_port(self.address)
            self._grant_rbac()
            self._start_kubelet()
            self._start_kube_proxy()
            self._start_coredns()
            self._start_provisioner()
            self._wait_component("kubelet", self._node_ready, f"node {NODE_NAME} Ready")
            mark("kubelet")
            self._wait_component("kube-proxy", lambda: _http_ok(f"http://127.0.0.1:{self.proxy_healthz_port}/healthz"),
                                 "kube-proxy /healthz")
            self._wait_component("coredns", lambda: _http_ok(f"http://127.0.0.1:{self.dns_ready_port}/ready"),
                                 "CoreDNS /ready")
            mark("ready")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Delete every pod (kubelet tears down their sandboxes and networks), stop the components,
        then remove what is left on the host (see clean_host) and release the node lock."""
        if self._stopped:
            self.lock.release()  # Cluster takes it before the control plane starts
            return
        self._stopped = True
        t0 = time.monotonic()
        try:
            by_name = {c.name: c for c in self._components}
            kubelet = by_name.get("kubelet")
            if kubelet is not None and kubelet.process.poll() is None:
                with contextlib.suppress(Exception):
                    self._drain()
            for component in reversed(self._components):
                _signal_group(component.process, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    component.process.wait(timeout=STOP_GRACE_SECONDS)
                _signal_group(component.process, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    component.process.wait(timeout=5)
                if component.name == "containerd":
                    continue
                if component.name == "kubelet" and containerd_serving():
                    _remove_containers()  # while containerd runs: it unmounts and reaps the shims
            self._components.clear()
            clean_host()
        finally:
            self.lock.release()
            self.timings["stop"] = round(time.monotonic() - t0, 2)

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def memory(self) -> dict[str, int]:
        """Resident memory in bytes of each node component, containerd's shims and the pods' containers
        (everything in the kubepods cgroups) included under "shims" and "pods"."""
        usage = {c.name: _rss(c.process.pid) for c in self._components}
        usage["shims"] = sum(_rss(pid) for pid in _shim_pids())
        usage["pods"] = _kubepods_memory()
        return usage

    # ------------------------------------------------------------------------------ components

    def _adopt(self, name: str, process: subprocess.Popen, log_path: Path) -> None:
        self._components.append(Component(name, process, log_path))
        self.started_pids.append(process.pid)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log_path = self.logs_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the child keeps it
        try:
            process = _start_process(args, log, env=env, cwd=STATE)
        finally:
            log.close()
        self._adopt(name, process, log_path)

    def _write_cni_config(self) -> None:
        conflist = {
            "cniVersion": "1.0.0",
            "name": CNI_NETWORK,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,  # a pod reaching itself through its Service
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(STATE / "cni" / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (STATE / "cni" / "net.d" / "10-rlkube.conflist").write_text(json.dumps(conflist, indent=1))

    def _grant_rbac(self) -> None:
        """Identities of the node's components, as kubeadm sets them up: the API server's client
        certificate may call kubelets; CoreDNS reads Services and EndpointSlices; the provisioner
        manages PersistentVolumes."""
        self.cp.apply_yaml(RBAC_YAML)

    def _start_kubelet(self) -> None:
        kubeconfig = self.cp.issue_kubeconfig("kubelet", f"system:node:{NODE_NAME}", ["system:nodes"])
        cert, key = self.cp.issue_cert(
            "kubelet-serving", f"system:node:{NODE_NAME}", ["system:nodes"],
            sans=[self.address, NODE_NAME, socket.gethostname()], server=True,
        )
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.address,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.kubelet_healthz_port,
            "tlsCertFile": str(cert),
            "tlsPrivateKeyFile": str(key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.cp.ca_file)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
            # cgroup v1 (hybrid) without systemd as init: the cgroupfs driver, and kubelet 1.34 must be
            # told that cgroup v1 is wanted.
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "clusterDNS": [CLUSTER_DNS],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": "/etc/resolv.conf",
            # The disk is shared with other work and images are loaded by hand: kubelet must neither
            # delete images nor evict pods because the disk is fuller than a dedicated node's would be.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "failSwapOn": False,
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "volumePluginDir": str(STATE / "kubelet" / "volume-plugins"),
            "maxPods": 110,
            "serializeImagePulls": False,
        }
        path = STATE / "kubelet" / "config.json"
        path.write_text(json.dumps(config, indent=1))
        self._spawn("kubelet", [
            str(self.bin_dir / "kubelet"),
            f"--config={path}",
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={self.address}",
            f"--node-labels={','.join(f'{k}={v}' for k, v in NODE_LABELS.items())}",
            f"--root-dir={KUBELET_DIR}",
            f"--cert-dir={STATE / 'kubelet' / 'pki'}",
        ])

    def _start_kube_proxy(self) -> None:
        kubeconfig = self.cp.issue_kubeconfig("kube-proxy", "system:kube-proxy")
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "hostnameOverride": NODE_NAME,
            "clusterCIDR": POD_SUBNET,
            "healthzBindAddress": f"127.0.0.1:{self.proxy_healthz_port}",
            "metricsBindAddress": f"127.0.0.1:{self.proxy_metrics_port}",
            # Leave the machine's conntrack table sizes and timeouts alone (a VM may refuse them),
            # and route_localnet off: NodePorts are reached on the node's address, not 127.0.0.1.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            "iptables": {"localhostNodePorts": False, "syncPeriod": "30s", "minSyncPeriod": "0s"},
            "nodePortAddresses": [f"{self.address}/32"],
        }
        path = STATE / "kube-proxy.json"
        path.write_text(json.dumps(config, indent=1))
        self._spawn("kube-proxy", [str(self.bin_dir / "kube-proxy"), f"--config={path}"])

    def _start_coredns(self) -> None:
        """CoreDNS as a process on the host, serving the cluster domain from the API server and
        forwarding the rest to the host's resolvers. Pods reach it as they would on any cluster:
        the kube-dns Service (10.0.0.10, kubelet's clusterDNS) and kube-proxy's DNAT to the
        EndpointSlice this writes, which names this machine's address and CoreDNS's port."""
        kubeconfig = self.cp.issue_kubeconfig("coredns", "system:coredns")
        corefile = STATE / "Corefile"
        corefile.write_text(f"""\
.:{self.dns_port} {{
    bind {self.address}
    errors
    health 127.0.0.1:{self.dns_health_port}
    ready 127.0.0.1:{self.dns_ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} rlkube-test
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    forward . /etc/resolv.conf
    cache 30
    loop
    loadbalance
}}
""")
        self._spawn("coredns", [str(self.bin_dir / "coredns"), "-conf", str(corefile)])
        self.cp.apply_yaml(_kube_dns_yaml(self.address, self.dns_port))

    def _start_provisioner(self) -> None:
        kubeconfig = self.cp.issue_kubeconfig("provisioner", "system:rlkube-provisioner")
        self.cp.apply_yaml(STORAGE_CLASS_YAML)
        self._spawn("provisioner", [
            sys.executable, str(HERE / "provisioner.py"),
            f"--kubeconfig={kubeconfig}",
            f"--root={VOLUMES}",
            f"--node={NODE_NAME}",
            f"--provisioner={PROVISIONER}",
        ])

    # ------------------------------------------------------------------------------ waits

    def _node_ready(self) -> bool:
        node = json.loads(self.cp.kubectl("get", "node", NODE_NAME, "-o", "json", check=False).stdout or "{}")
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _wait_component(self, name: str, check, what: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for component in self._components:
                code = component.process.poll()
                if code is not None:
                    raise NodeError(
                        f"{component.name} exited with code {code} while waiting for {what}; "
                        f"last lines of {component.log_path}:\n{component.log_tail()}"
                    )
            try:
                if check():
                    return
            except (OSError, ControlPlaneError, ValueError, KeyError):
                pass
            if time.monotonic() >= deadline:
                [component] = [c for c in self._components if c.name == name]
                raise NodeError(f"timed out after {timeout:g} s waiting for {what}; last lines of "
                                f"{component.log_path}:\n{component.log_tail()}")
            time.sleep(0.2)

    def _drain(self, timeout: float = 30) -> None:
        """Cordon the node and delete every pod; kubelet stops their containers and sandboxes (CNI
        DEL releases the addresses and iptables rules). Pods of controllers the control plane still
        runs may come back: whatever is left after ``timeout`` goes in clean_host()."""
        self.cp.kubectl("cordon", NODE_NAME, check=False)
        self.cp.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=1", "--wait=false",
                        check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = self.cp.get_json("pods", "--all-namespaces", f"--field-selector=spec.nodeName={NODE_NAME}")
            if not pods["items"]:
                return
            time.sleep(0.3)


# -------------------------------------------------------------------------------------------- cluster


class Cluster:
    """The control plane on this machine's address plus the real node: a one-node cluster.

    ``kuberay`` starts KubeRay's operator (a process on the host, as in the kwok tests);
    ``fake_nodes`` adds that many kwok nodes (their pods never run). Attributes: ``control_plane``,
    ``node``; ``kubeconfig``, ``kubectl``, ``apply_yaml``, ``get_json``, ``wait_for``,
    ``create_namespace`` and ``helm`` are the control plane's.
    """

    def __init__(self, logs_dir: str | os.PathLike | None = None, kuberay: bool = True, fake_nodes: int = 0,
                 lock_timeout: float = 900) -> None:
        # KubeRay's operator runs on this machine, outside the cluster network: it cannot resolve the
        # head Service's cluster DNS name it reaches the Ray dashboard by (job submission and status),
        # so it goes through the API server's service proxy instead, as KubeRay does when run
        # outside a cluster (without it a RayJob stays Running with no job status).
        cp = ControlPlane(nodes=fake_nodes, start_kuberay=kuberay, logs_dir=logs_dir, node_address=node_ip(),
                          extra_args={"kuberay-operator": ["--use-kubernetes-proxy"]})
        self.control_plane = cp
        self.node = RealNode(cp, logs_dir=logs_dir, lock_timeout=lock_timeout)
        self.timings: dict[str, float] = {}
        self.kubectl, self.apply_yaml, self.get_json = cp.kubectl, cp.apply_yaml, cp.get_json
        self.wait_for, self.create_namespace, self.helm = cp.wait_for, cp.create_namespace, cp.helm

    def start(self) -> Cluster:
        t0 = time.monotonic()
        problems = missing_prerequisites()
        if problems:
            raise NodeError("cannot start a real node:\n  " + "\n  ".join(problems))
        # First the lock: a node already running here must not cost a control plane start.
        self.node.lock.acquire(self.node.lock_timeout, "a one-node cluster (tests/node/node.py Cluster)")
        self.timings["lock"] = round(time.monotonic() - t0, 2)
        try:
            self.control_plane.start()
            self.timings["control plane"] = round(time.monotonic() - t0, 2)
            self.node.start()
            self.timings["node"] = round(time.monotonic() - t0, 2)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.node.stop()
        self.control_plane.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (files in the control plane's temp dir; valid while it runs)."""
        return self.control_plane.kubeconfig

    def load_image(self, ref: str) -> int | None:
        """Copy the buildah image tagged ``ref`` (e.g. ``rlkube/operator:0.1.0``) into the node's
        containerd under the name pods resolve ``ref`` to; the bytes sent, None when it was there."""
        return load_buildah_image(buildah_name(ref), cri_name(ref))


# -------------------------------------------------------------------------------------------- manifests

RBAC_YAML = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: rlkube:kube-apiserver-kubelet-client
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:kubelet-api-admin"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: kube-apiserver-kubelet-client}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: system:coredns
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: system:coredns
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: system:rlkube-provisioner
rules:
- {apiGroups: [""], resources: [persistentvolumes], verbs: [get, list, watch, create, delete]}
- {apiGroups: [""], resources: [persistentvolumeclaims], verbs: [get, list, watch]}
- {apiGroups: [storage.k8s.io], resources: [storageclasses], verbs: [get, list, watch]}
- {apiGroups: [""], resources: [events], verbs: [create, patch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: system:rlkube-provisioner
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:rlkube-provisioner"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:rlkube-provisioner"}
"""

# WaitForFirstConsumer, as kind's and k3s' local-path classes: a claim binds when a pod that uses it
# is scheduled (the scheduler names the node in the claim's volume.kubernetes.io/selected-node).
STORAGE_CLASS_YAML = f"""\
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: {STORAGE_CLASS}
  annotations:
    storageclass.kubernetes.io/is-default-class: "true"
provisioner: {PROVISIONER}
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
"""


def _kube_dns_yaml(address: str, port: int) -> str:
    return f"""\
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {{k8s-app: kube-dns, kubernetes.io/name: CoreDNS}}
spec:
  clusterIP: {CLUSTER_DNS}
  ports:
  - {{name: dns, port: 53, protocol: UDP, targetPort: {port}}}
  - {{name: dns-tcp, port: 53, protocol: TCP, targetPort: {port}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-host
  namespace: kube-system
  labels:
    kubernetes.io/service-name: kube-dns
    endpointslice.kubernetes.io/managed-by: rlkube-real-node
addressType: IPv4
endpoints:
- addresses: ["{address}"]
  conditions: {{ready: true}}
  nodeName: {NODE_NAME}
ports:
- {{name: dns, port: {port}, protocol: UDP}}
- {{name: dns-tcp, port: {port}, protocol: TCP}}
"""


# -------------------------------------------------------------------------------------------- host


def _set_sysctls() -> None:
    # Forwarding for the pods' traffic; bridge-nf-call-iptables so that a pod reaching a Service
    # whose endpoint sits on the same bridge goes through kube-proxy's DNAT both ways. Both are
    # machine-wide and stay set after stop(): other users of the machine may rely on them too.
    for key, value in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
        path = Path("/proc/sys") / key
        if path.exists() and path.read_text().strip() != value:
            path.write_text(value)


def _free_udp_tcp_port(address: str) -> int:
    """A port free for both UDP and TCP on ``address`` (DNS serves both on one port)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind((address, 0))
            port = udp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind((address, port))
                except OSError:
                    continue
        return port
    raise NodeError(f"no port free for both UDP and TCP on {address}")


def _remove_containers() -> None:
    """Kill and delete every container in the CRI namespace (sandboxes included) through containerd,
    which unmounts their root filesystems and reaps their shims."""
    tasks = ctr("tasks", "ls", "-q", check=False).stdout.decode().split()
    for task in tasks:
        ctr("tasks", "kill", "--signal=SIGKILL", task, check=False, timeout=30)
    for task in tasks:
        ctr("tasks", "delete", "--force", task, check=False, timeout=30)
    containers = ctr("containers", "ls", "-q", check=False).stdout.decode().split()
    if containers:
        ctr("containers", "delete", *containers, check=False, timeout=60)


def clean_host() -> None:
    """Remove what the node leaves on the machine: processes in the kubepods cgroups and containerd
    shims of the node's socket, mounts under /var/lib/kubelet and /run/rlkube, pod network
    namespaces, the bridge, kube-proxy's and the CNI plugins' iptables chains, the kubepods cgroups,
    pod logs, kubelet's and the node's state directories and the provisioned volumes. containerd's
    image store (/var/lib/rlkube/containerd) stays. Idempotent; run under the node lock only."""
    for pid in _kubepods_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in _shim_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for root in (KUBELET_DIR, STATE):
        _unmount_below(root)
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
    _remove_iptables_chains()
    _remove_kubepods_cgroups()
    for path in (KUBELET_DIR, *POD_LOG_DIRS, STATE, VOLUMES):
        if path.exists():
            subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def _unmount_below(root: Path) -> None:
    prefix = str(root).rstrip("/") + "/"
    for _ in range(5):
        mounts = [m for m in _mount_points() if m.startswith(prefix) or m == str(root)]
        if not mounts:
            return
        for mount in sorted(mounts, key=len, reverse=True):  # deepest first
            subprocess.run(["umount", "--lazy", mount], capture_output=True, check=False)


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # "id parent major:minor root mount-point options ..."; octal escapes for spaces etc.
        point = line.split()[4]
        points.append(point.encode().decode("unicode_escape"))
    return points


def _remove_iptables_chains() -> None:
    """Every KUBE-* chain (kube-proxy's Services, kubelet's canaries) in both address families, and
    the CNI chains that rules naming this node's network jump to (the bridge plugin's per-pod
    masquerade chains, portmap's per-pod DNAT chains); portmap's shared CNI-HOSTPORT-* chains stay."""
    shared = {"CNI-HOSTPORT-DNAT", "CNI-HOSTPORT-MASQ", "CNI-HOSTPORT-SETMARK"}
    marker = f'name: \\"{CNI_NETWORK}\\"'  # iptables-save writes the comment's quotes escaped
    for save, iptables in (("iptables-save", "iptables"), ("ip6tables-save", "ip6tables")):
        if shutil.which(save) is None:
            continue
        for table in ("nat", "filter", "mangle"):
            dump = subprocess.run([save, "-t", table], capture_output=True, text=True, check=False).stdout
            rules = [shlex.split(line)[1:] for line in dump.splitlines() if line.startswith("-A ")]
            ours = {line[1:].split()[0] for line in dump.splitlines()
                    if line.startswith(":") and line[1:].startswith("KUBE-")}
            for line in dump.splitlines():
                if line.startswith("-A ") and marker in line:
                    target = _jump_target(shlex.split(line)[1:])
                    if target and target.startswith("CNI-") and target not in shared:
                        ours.add(target)
            if not ours:
                continue
            for rule in rules:  # jumps into our chains from chains that stay
                if rule[0] not in ours and _jump_target(rule) in ours:
                    subprocess.run([iptables, "-t", table, "-D", *rule], capture_output=True, check=False)
            for flag in ("-F", "-X"):
                for chain in sorted(ours):
                    subprocess.run([iptables, "-t", table, flag, chain], capture_output=True, check=False)


def _jump_target(rule: list[str]) -> str | None:
    for flag in ("-j", "-g"):
        if flag in rule:
            return rule[rule.index(flag) + 1]
    return None


def _cgroup_roots() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    roots = [base / "kubepods"]  # cgroup v2
    if base.exists():
        roots += [d / "kubepods" for d in base.iterdir() if d.is_dir()]
    return [r for r in roots if r.is_dir()]


def _kubepods_pids() -> list[int]:
    pids: set[int] = set()
    for root in _cgroup_roots():
        for procs in root.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in procs.read_text().split())
    return sorted(pids)


def _kubepods_memory() -> int:
    path = Path("/sys/fs/cgroup/memory/kubepods/memory.usage_in_bytes")
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text())
    return 0


def _remove_kubepods_cgroups() -> None:
    for root in _cgroup_roots():
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            root.rmdir()


def _shim_pids() -> list[int]:
    """containerd shims started by the node's containerd (their command line names its socket)."""
    needle = str(CONTAINERD_SOCKET).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if b"containerd-shim" in cmdline.split(b"\0")[0] and needle in cmdline:
                pids.append(int(entry.name))
    return pids


def _rss(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
