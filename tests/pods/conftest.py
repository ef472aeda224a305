"""Fixtures for tests whose pods really run: a control plane plus a real node (tests/node/node.py).

``cluster`` (session scope) is a running ``node.Cluster``: the control plane (on this machine's
address, with KubeRay's operator) and the node ``rlkube-node`` with containerd, kubelet, kube-proxy,
CoreDNS and the default StorageClass ``rlkube-local``. It starts once per pytest session, only when
a test asks for it. Mark such tests ``@pytest.mark.pods``, ``@pytest.mark.slow`` and
``@pytest.mark.xdist_group("pods")``: under pytest-xdist every worker makes its own session
fixture, and one real node per machine means a second worker's would wait for the first's.

``operator_image`` (and ``trainer_image``, ``rollout_image``) is the image reference a pod spec
names, e.g. ``rlkube/operator:0.1.0``, after checking that images/build.sh loaded it into the
node's containerd; give pods ``imagePullPolicy: Never`` (there is no registry to pull from).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
if str(NODE_DIR) not in sys.path:
    sys.path.insert(0, str(NODE_DIR))

from node import Cluster, containerd_for_loading, cri_name, loaded_images, missing_prerequisites  # noqa: E402, I001
from harness import BUILD_COMMAND, cache_dir, missing_binaries, processes_in_groups  # noqa: E402 - node puts it on sys.path

from rlkube_runtime import __version__  # noqa: E402

IMAGES_COMMAND = "images/build.sh"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # A setup error, not a skip: CI builds everything first (make test -> controlplane, node, images).
    problems = missing_prerequisites()
    missing = missing_binaries()
    if missing:
        problems.append(f"control plane binaries missing in {cache_dir() / 'bin'}: {', '.join(missing)}; "
                        f"run `{BUILD_COMMAND}`")
    if problems:
        pytest.fail("cannot start a real node:\n  " + "\n  ".join(problems), pytrace=False)
    logs = os.environ.get("RLKUBE_CONTROLPLANE_LOGS")
    logs_dir = Path(logs) / "real-node" if logs else tmp_path_factory.mktemp("real-node-logs")
    c = Cluster(logs_dir=logs_dir)
    c.start()
    pgids = c.control_plane.pids + c.node.pids
    print(f"\nreal node cluster up: {c.timings}; node {c.node.timings}; memory {c.node.memory()}")
    try:
        yield c
    finally:
        c.stop()
    survivors = processes_in_groups(pgids)
    if survivors:
        pytest.fail(f"cluster processes survived stop(): {survivors}", pytrace=False)


def _image(name: str) -> str:
    ref = f"rlkube/{name}:{__version__}"
    with containerd_for_loading():
        present = cri_name(ref) in loaded_images()
    if not present:
        pytest.fail(f"{ref} is not in the node's containerd: run `{IMAGES_COMMAND} {name}`", pytrace=False)
    return ref


@pytest.fixture(scope="session")
def operator_image(cluster: Cluster) -> str:
    return _image("operator")


@pytest.fixture(scope="session")
def trainer_image(cluster: Cluster) -> str:
    return _image("trainer")


@pytest.fixture(scope="session")
def rollout_image(cluster: Cluster) -> str:
    return _image("rollout")
