"""A hostPath volume provisioner for the real node's StorageClass (stdlib only).

    python3 tests/node/provisioner.py --kubeconfig K --root /var/lib/rlkube/volumes \
        --node rlkube-node --provisioner rlkube.local/hostpath

What rancher's local-path-provisioner does, for one node and without helper pods: a claim of a
StorageClass whose provisioner is ``--provisioner`` gets a directory ``<root>/<pv-name>`` (mode 0777,
so that pods of any UID can write) and a hostPath PersistentVolume pinned to the node, bound to the
claim; a released volume with reclaim policy Delete loses its directory and its PersistentVolume.
With volumeBindingMode WaitForFirstConsumer the claim is provisioned once the scheduler has chosen
the node (annotation volume.kubernetes.io/selected-node).

It polls the API server every half second (lists of claims and volumes): on a test cluster's handful
of objects that is cheaper to get right than watches, and no slower than a pod's start.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import ssl
import sys
import time
import urllib.parse
from pathlib import Path

SELECTED_NODE = "volume.kubernetes.io/selected-node"
STORAGE_PROVISIONER = "volume.kubernetes.io/storage-provisioner"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
POLL_SECONDS = 0.5


class Api:
    """GET/POST/DELETE against the API server with the kubeconfig's client certificate."""

    def __init__(self, kubeconfig: Path) -> None:
        config = json.loads(kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
        user = config["users"][0]["user"]
        url = urllib.parse.urlparse(cluster["server"])
        self.host, self.port = url.hostname, url.port or 443
        self.context = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.context.load_cert_chain(user["client-certificate"], user["client-key"])
        self._conn: http.client.HTTPSConnection | None = None

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        for attempt in range(2):  # one reconnect: the kept-alive connection may have been closed
            if self._conn is None:
                self._conn = http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=10)
            try:
                data = json.dumps(body).encode() if body is not None else None
                headers = {"Content-Type": "application/json", "Accept": "application/json"}
                self._conn.request(method, path, body=data, headers=headers)
                resp = self._conn.getresponse()
                payload = resp.read()
                return resp.status, json.loads(payload) if payload else {}
            except (OSError, http.client.HTTPException):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def provision(api: Api, claim: dict, storage_class: dict, root: Path, node: str, provisioner: str) -> None:
    meta = claim["metadata"]
    name = f"pvc-{meta['uid']}"
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)  # not umask-limited; pods run as any non-root UID
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "annotations": {PROVISIONED_BY: provisioner}},
        "spec": {
            "capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
            "accessModes": claim["spec"].get("accessModes") or ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": storage_class.get("reclaimPolicy", "Delete"),
            "storageClassName": storage_class["metadata"]["name"],
            "volumeMode": claim["spec"].get("volumeMode", "Filesystem"),
            "hostPath": {"path": str(path), "type": "Directory"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}},
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                         "name": meta["name"], "uid": meta["uid"], "resourceVersion": meta["resourceVersion"]},
        },
    }
    status, body = api.request("POST", "/api/v1/persistentvolumes", volume)
    if status not in (201, 409):  # 409: made on an earlier pass
        log(f"creating {name} for {meta['namespace']}/{meta['name']} failed ({status}): {body.get('message')}")
    elif status == 201:
        log(f"provisioned {name} at {path} for {meta['namespace']}/{meta['name']}")


def delete(api: Api, volume: dict, root: Path) -> None:
    name = volume["metadata"]["name"]
    path = Path(volume["spec"].get("hostPath", {}).get("path", ""))
    if path.parent == root and path.name == name:  # never outside the root
        shutil.rmtree(path, ignore_errors=True)
    status, body = api.request("DELETE", f"/api/v1/persistentvolumes/{name}")
    if status in (200, 202, 404):
        log(f"deleted {name}")
    else:
        log(f"deleting {name} failed ({status}): {body.get('message')}")


def reconcile(api: Api, root: Path, node: str, provisioner: str) -> None:
    status, classes = api.request("GET", "/apis/storage.k8s.io/v1/storageclasses")
    ours = {c["metadata"]["name"]: c for c in classes.get("items", []) if c.get("provisioner") == provisioner}
    default = next((n for n, c in ours.items()
                    if c["metadata"].get("annotations", {}).get("storageclass.kubernetes.io/is-default-class") == "true"),
                   None)
    status, claims = api.request("GET", "/api/v1/persistentvolumeclaims")
    status, volumes = api.request("GET", "/api/v1/persistentvolumes")
    existing = {v["metadata"]["name"] for v in volumes.get("items", [])}
    for claim in claims.get("items", []):
        spec, meta = claim["spec"], claim["metadata"]
        class_name = spec.get("storageClassName") or default
        annotations = meta.get("annotations", {})
        if class_name not in ours or spec.get("volumeName") or claim.get("status", {}).get("phase") != "Pending":
            continue
        if annotations.get(STORAGE_PROVISIONER, provisioner) != provisioner:
            continue
        binding = ours[class_name].get("volumeBindingMode", "Immediate")
        if binding == "WaitForFirstConsumer" and annotations.get(SELECTED_NODE) != node:
            continue  # not scheduled yet, or onto another (fake) node
        if meta.get("deletionTimestamp") or f"pvc-{meta['uid']}" in existing:
            continue
        provision(api, claim, ours[class_name], root, node, provisioner)
    for volume in volumes.get("items", []):
        meta, spec = volume["metadata"], volume["spec"]
        if meta.get("annotations", {}).get(PROVISIONED_BY) != provisioner:
            continue
        if volume.get("status", {}).get("phase") in ("Released", "Failed") and \
                spec.get("persistentVolumeReclaimPolicy") == "Delete" and not meta.get("deletionTimestamp"):
            delete(api, volume, root)


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True, help="directory that holds the volumes")
    parser.add_argument("--node", required=True, help="the node the volumes live on")
    parser.add_argument("--provisioner", required=True, help="the StorageClass provisioner name to serve")
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    api = Api(args.kubeconfig)
    log(f"serving {args.provisioner} on node {args.node}, volumes under {args.root}")
    while True:
        try:
            reconcile(api, args.root, args.node, args.provisioner)
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            log(f"pass failed, retrying: {exc!r}")
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
