"""What `make run` and `make test` need on a fresh machine, checked before they install anything.

    python3 scripts/check_prereqs.py run     # Python >= 3.10 with venv (python3-venv)
    python3 scripts/check_prereqs.py test    # Python >= 3.11 with venv; Go >= 1.24 unless the test
                                             # control plane and node are already built; prometheus
                                             # and promtool, or apt-get to install them; root and
                                             # apt-get for the real node (the pods tier); iproute2
                                             # (network namespaces of the multi-node test)
    python3 scripts/check_prereqs.py cluster # what `make cluster` needs: the same minus prometheus

Each missing piece is named with the command that provides it; the exit code is 1 when any is
missing. The Go minimum is read from the control plane's go.mod files, so it cannot drift from
them. Written for old interpreters too (no f-strings): its job is to say the Python is too old.
"""

from __future__ import print_function

import glob
import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTROLPLANE = os.path.join(REPO, "tests", "controlplane")
NODE = os.path.join(REPO, "tests", "node")

# What tests/node/build.sh and images/build.sh install with apt-get when missing: Debian package ->
# a file it provides.
NODE_PACKAGES = {
    "containerd": "/usr/bin/containerd",
    "runc": "/usr/sbin/runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    "iptables": "/usr/sbin/iptables",
    "conntrack": "/usr/sbin/conntrack",
    "socat": "/usr/bin/socat",
    "buildah": "/usr/bin/buildah",
    "mmdebstrap": "/usr/bin/mmdebstrap",
    "gcc": "/usr/bin/gcc",
    "libc6-dev": "/usr/include/stdlib.h",
}

RUN_PYTHON = (3, 10)  # pyproject.toml's requires-python
TEST_PYTHON = (3, 11)  # the tests read pyproject.toml with tomllib (3.11+)


def go_minimum():
    """The highest `go` directive of the control plane's wrapper modules, as (major, minor)."""
    versions = []
    for path in glob.glob(os.path.join(CONTROLPLANE, "*", "go.mod")) + glob.glob(os.path.join(NODE, "*", "go.mod")):
        with open(path) as f:
            match = re.search(r"^go (\d+)\.(\d+)", f.read(), re.M)
        if match:
            versions.append((int(match.group(1)), int(match.group(2))))
    return max(versions) if versions else (1, 24)


def check_python(minimum):
    problems = []
    if sys.version_info[:2] < minimum:
        problems.append(
            "Python %d.%d or newer is needed, this is %d.%d (%s); install it (e.g. apt-get install python3.11, "
            "or pyenv) and run make with PYTHON=/path/to/python3.11"
            % (minimum + sys.version_info[:2] + (sys.executable,))
        )
    if not venv_available():
        problems.append(
            "the venv module with ensurepip is missing for %s (make installs everything into the project's "
            "own .venv): apt-get install python3-venv" % sys.executable
        )
    return problems


def venv_available():
    """`python -m venv` needs both modules; Debian ships ensurepip apart, in python3-venv."""
    return all(
        subprocess.call([sys.executable, "-c", "import %s" % module], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0
        for module in ("venv", "ensurepip")
    )


def controlplane_built():
    """True when every control-plane and node binary is cached (then Go is not needed)."""
    sys.path.insert(0, CONTROLPLANE)
    try:
        import harness  # stdlib only

        if harness.missing_binaries():
            return False
        versions = harness.read_versions()
        key = "k8s-%s_coredns-%s_pause-%s" % (versions["KUBERNETES_VERSION"], versions["COREDNS_VERSION"],
                                              versions["PAUSE_VERSION"])  # tests/node/build.sh's KEY
        root = os.environ.get("RLKUBE_NODE_CACHE") or os.path.expanduser("~/.cache/rlkube/node")
        return all(os.access(os.path.join(root, key, "bin", name), os.X_OK) for name in ("kubelet", "kube-proxy", "coredns"))
    except Exception:  # an unreadable cache means a build
        return False
    finally:
        sys.path.pop(0)


def check_go():
    minimum = go_minimum()
    if controlplane_built():
        return []
    go = shutil.which("go")
    if go is None:
        return [
            "Go %d.%d or newer is needed to build the test control plane and node (tests/controlplane/build.sh, "
            "tests/node/build.sh: about 25 minutes the first time, cached after): install it from "
            "https://go.dev/dl/ and put go on PATH"
            % minimum
        ]
    output = subprocess.run([go, "version"], stdout=subprocess.PIPE, universal_newlines=True).stdout
    match = re.search(r"go(\d+)\.(\d+)", output)
    if match and (int(match.group(1)), int(match.group(2))) < minimum:
        return ["Go %d.%d or newer is needed to build the test control plane; %s is %s"
                % (minimum + (go, output.strip()))]
    return []


def check_prometheus():
    if os.environ.get("RLKUBE_SKIP_PROMETHEUS") == "1" or (shutil.which("prometheus") and shutil.which("promtool")):
        return []
    if not shutil.which("apt-get"):
        return ["prometheus and promtool (2.x) are needed by the dashboard and alert tests and there is no apt-get "
                "to install them: put both on PATH (https://prometheus.io/download/)"]
    if os.geteuid() != 0 and not shutil.which("sudo"):
        return ["prometheus and promtool are needed and installing them needs root: sudo apt-get install -y prometheus"]
    return []  # tests/controlplane/build.sh installs them with apt-get


def check_netns():
    """The multi-node test gives each Ray node a network namespace of its own (`ip netns`, as root)."""
    why = "the multi-node test (tests/integration/test_multi_node.py) puts each Ray node in a network namespace"
    problems = []
    if os.geteuid() != 0:
        problems.append(why + ", which needs root: run make test as root (CI does)")
    if not shutil.which("ip"):
        problems.append(why + " with iproute2's ip: apt-get install iproute2")
    return problems


def check_node():
    """The real node (tests/node: the pods tier, make cluster) runs containerd, kubelet and iptables,
    and its build installs Debian packages: root, Linux, and apt-get unless they are all there."""
    problems = []
    if not sys.platform.startswith("linux"):
        return ["a real node (the pods tier, make cluster) needs Linux"]
    if os.geteuid() != 0:
        problems.append("a real node (the pods tier of make test, make cluster) runs containerd, kubelet and "
                        "iptables, which need root: run make as root (deselect the tier with "
                        "pytest -m 'not pods')")
    missing = sorted(package for package, path in NODE_PACKAGES.items() if not os.path.exists(path))
    if missing and not shutil.which("apt-get"):
        problems.append("%s missing and there is no apt-get to install them (Debian/Ubuntu packages)"
                        % ", ".join(missing))
    return problems


def main(argv):
    if len(argv) != 2 or argv[1] not in ("run", "test", "cluster"):
        print("usage: %s run|test|cluster" % argv[0], file=sys.stderr)
        return 2
    target = argv[1]
    if target == "run":
        problems = check_python(RUN_PYTHON)
    else:
        problems = check_python(TEST_PYTHON) + check_go() + check_node()
        if target == "test":
            problems += check_prometheus() + check_netns()
        if not shutil.which("flock"):
            problems.append("flock is missing (tests/controlplane/build.sh locks its cache with it): apt-get install util-linux")
    for problem in problems:
        print("make %s: missing prerequisite: %s" % (target, problem), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
