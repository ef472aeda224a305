"""`rlkube validate FILE...`: check RLJob YAML files without a cluster.

Prints one line per document, `FILE: doc N (name): ok`, or one line per error,
`FILE: doc N (name): spec.rollout.batchSz: unknown field (did you mean 'batchSize'?)`.

What the job's pods may reach is checked against the default pod policy, or the cluster's
(`--policy FILE`: the chart's values, or the operator's policy file), in each document's
namespace (`--namespace` for documents that name none). When spec.model.hfCheckpoint is a local
directory, the parallel sizes are checked against its config.json too (spec/model_fit.py).
"""

from __future__ import annotations

import sys
from typing import Iterable, TextIO

from .load import SpecError, document_name, load_documents, parse_rljob
from .model_fit import model_fit_violations, read_model_config
from .pod_policy import DEFAULT_POLICY, PodPolicy


def validate_files(paths: Iterable[str], out: TextIO | None = None, err: TextIO | None = None, *,
                   policy: PodPolicy = DEFAULT_POLICY, namespace: str | None = None) -> int:
    """Validate every document of every file; 0 when all are valid RLJobs, 1 otherwise."""
    out = out or sys.stdout
    err = err or sys.stderr
    failed = False
    for path in paths:
        try:
            docs = load_documents(path)
        except SpecError as exc:
            _print_errors(err, path, exc)
            failed = True
            continue
        if not docs:
            print(f"{path}: no YAML documents", file=err)
            failed = True
        for index, doc in docs:
            label = f"{path}: doc {index} ({document_name(doc) or 'unnamed'})"
            meta = doc.get("metadata") if isinstance(doc, dict) else None
            doc_namespace = (meta.get("namespace") if isinstance(meta, dict) else None) or namespace
            try:
                job = parse_rljob(doc, pod_policy=policy.allowance(doc_namespace))
                _check_model_fit(job.spec)
            except SpecError as exc:
                _print_errors(err, label, exc)
                failed = True
            else:
                print(f"{label}: ok", file=out)
    return 1 if failed else 0


def _check_model_fit(spec) -> None:
    """The parallel sizes against the model, when spec.model.hfCheckpoint is a local directory."""
    config = read_model_config(spec.model.hf_checkpoint) if spec.model.hf_checkpoint else None
    violations = model_fit_violations(spec, config) if config is not None else []
    if violations:
        raise SpecError([(f"spec.{path}", message) for path, message in violations])


def _print_errors(stream: TextIO, label: str, exc: SpecError) -> None:
    for field, message in exc.errors:
        print(f"{label}: {field}: {message}" if field else f"{label}: {message}", file=stream)
