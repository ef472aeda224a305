"""Print what the operator would create for RLJob files, without a cluster.

    python -m rlkube_operator.preview manifests/examples/qwen3-4b-grpo-separate.yaml [--attempt N]

The objects are rendered exactly as the operator renders them (owner UID and namespace are
placeholders); useful to review pods, GPUs and Ray resources before `kubectl apply`.
"""

from __future__ import annotations

import argparse
import sys

import yaml
from rlkube_runtime.spec.load import SpecError, load_documents, parse_rljob

from . import render
from .settings import OperatorSettings


def preview(doc: dict, attempt: int = 0, settings: OperatorSettings | None = None) -> list[dict]:
    """ConfigMap, ServiceAccount, Role, RoleBinding and the RayJob of `attempt` for one RLJob document."""
    settings = settings or OperatorSettings.from_env()
    job = parse_rljob(doc)
    meta = doc.get("metadata") or {}
    ref = render.JobRef(name=job.metadata.name, namespace=meta.get("namespace") or "default", uid="<rljob-uid>")
    return [
        render.render_configmap(ref, doc["spec"]),
        render.render_service_account(ref),
        render.render_role(ref),
        render.render_role_binding(ref),
        render.render_rayjob(ref, job.spec, attempt=attempt, settings=settings,
                             active_deadline_seconds=job.spec.active_deadline_seconds),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlkube_operator.preview", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--attempt", type=int, default=0, help="attempt number of the RayJob (default 0)")
    args = parser.parse_args(argv)
    objects = []
    try:
        for path in args.files:
            for _, doc in load_documents(path):
                objects += preview(doc, args.attempt)
    except (SpecError, render.RenderError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(objects, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
