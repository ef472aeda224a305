"""The RLJob CustomResourceDefinition, generated from the typed models.

`crd_manifest()` is a pure function returning the CRD as a dict; `render_crd_yaml()` dumps it.
`crds/rlkube.io_rljobs.yaml` is its output (`rlkube crd -o crds/rlkube.io_rljobs.yaml`), and a
unit test fails when the two differ.

Pydantic emits JSON Schema (draft 2020-12); the API server wants a *structural* OpenAPI v3
schema. The conversion inlines every `$ref`, turns `Optional[X]` (anyOf X/null) into plain X
(optional fields simply are not required), turns free dicts into
`x-kubernetes-preserve-unknown-fields`, and rewrites numeric `exclusiveMinimum` into the OpenAPI
v3.0 boolean form. Anything it cannot express structurally is an error here, not a CRD the API
server rejects later.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import yaml
from pydantic import BaseModel

from .base import API_GROUP, API_VERSION_NAME, KIND, PLURAL, SHORT_NAMES, SINGULAR
from .rljob import NAME_RULE, RLJob, RLJobSpec
from .status import RLJobStatus

CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_FILE = f"crds/{API_GROUP}_{PLURAL}.yaml"
REGENERATE_COMMAND = f"rlkube crd -o {CRD_FILE}"

# Formats the API server understands; pydantic's others (e.g. "path") are dropped.
_KNOWN_FORMATS = {"date-time", "date", "int32", "int64", "float", "double", "byte", "uri", "email", "uuid"}

# Key order of every schema node in the output, for a CRD a person can read top to bottom.
_KEY_ORDER = [
    "description", "type", "format", "enum", "default", "minimum", "exclusiveMinimum", "maximum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "properties",
    "required", "items", "additionalProperties", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-validations",
]


class CRDSchemaError(ValueError):
    """A model field has no structural OpenAPI form; the message names the field's schema."""


def crd_manifest() -> dict[str, Any]:
    """The RLJob CustomResourceDefinition (apiextensions.k8s.io/v1) as a dict (a fresh copy)."""
    return copy.deepcopy(_crd_manifest())


@functools.lru_cache(maxsize=1)
def _crd_manifest() -> dict[str, Any]:
    # Cached: the models cannot change within a process, and schema generation is the slow part.
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["rlkube"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION_NAME,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(),
                    "schema": {"openAPIV3Schema": root_schema()},
                }
            ],
        },
    }


@functools.lru_cache(maxsize=1)
def render_crd_yaml() -> str:
    """The CRD as YAML, byte-for-byte what `crds/rlkube.io_rljobs.yaml` holds."""
    header = (
        f"# Generated from runtime/rlkube_runtime/spec by `{REGENERATE_COMMAND}`; do not edit by hand.\n"
    )
    # The pure-Python emitter on purpose: its output is the same whether or not libyaml is present.
    return header + yaml.safe_dump(_crd_manifest(), sort_keys=False, default_flow_style=False, width=100)


def root_schema() -> dict[str, Any]:
    """openAPIV3Schema of the resource: the envelope, spec and status."""
    spec = openapi_schema(RLJobSpec)
    status = openapi_schema(RLJobStatus)
    # kopf keeps its own bookkeeping under status; typed fields are still validated.
    status["x-kubernetes-preserve-unknown-fields"] = True
    return _ordered({
        "description": _doc(RLJob),
        "type": "object",
        "properties": {
            "apiVersion": {"description": "APIVersion of this object: rlkube.io/v1alpha1.", "type": "string"},
            "kind": {"description": "Kind of this object: RLJob.", "type": "string"},
            # Only name/generateName may be constrained in a CRD; the API server validates the rest.
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
        "x-kubernetes-validations": [_ordered_rule(NAME_RULE)],
    })


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a model, every $ref inlined."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _convert(raw, defs, model.__name__)


def _convert(node: dict[str, Any], defs: dict[str, Any], where: str) -> dict[str, Any]:
    """One schema node, with the keys next to a $ref or anyOf (description, default) kept on top."""
    node = dict(node)
    if "$ref" in node:
        inner = defs[node.pop("$ref").rsplit("/", 1)[-1]]
    elif "allOf" in node and len(node["allOf"]) == 1:  # older pydantic wraps a described $ref
        inner = node.pop("allOf")[0]
    elif "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b != {"type": "null"}]
        if len(branches) != 1:
            raise CRDSchemaError(f"{where}: a union of {branches} has no structural form; use one type")
        inner = branches[0]
    else:
        inner = None
    out = _convert_keys(node, defs, where)
    if inner is not None:
        converted = _convert(inner, defs, where)
        # Rules of the field (e.g. immutability) join the rules of the model it refers to.
        rules = converted.get("x-kubernetes-validations", []) + out.get("x-kubernetes-validations", [])
        out = {**converted, **out}
        if rules:
            out["x-kubernetes-validations"] = rules
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise CRDSchemaError(f"{where}: schema {node} has no type")
    return _ordered(out)


def _convert_keys(node: dict[str, Any], defs: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" or (key == "default" and value is None):
            continue
        if key == "properties":
            out[key] = {name: _convert(prop, defs, f"{where}.{name}") for name, prop in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, f"{where}[]")
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out[key] = _convert(value, defs, f"{where}{{}}")
            # False (extra="forbid") is what pruning does anyway; the API server forbids it next to properties.
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound] = value
            out[key] = True
        elif key == "description":
            out[key] = " ".join(value.split())  # docstrings: one paragraph per node
        elif key == "x-kubernetes-validations":
            out[key] = [_ordered_rule(rule) for rule in value]
        elif key == "format":
            if value in _KNOWN_FORMATS:
                out[key] = value
        elif key in ("anyOf", "oneOf", "allOf", "not", "$defs"):
            raise CRDSchemaError(f"{where}: {key} has no structural form")
        else:
            out[key] = value
    return out


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    rank = {key: i for i, key in enumerate(_KEY_ORDER)}
    return dict(sorted(node.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


def _ordered_rule(rule: dict[str, Any]) -> dict[str, Any]:
    order = ["rule", "message", "messageExpression", "fieldPath", "reason"]
    return dict(sorted(rule.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)))


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Where the job is in its life."},
        {"name": "Progress", "type": "string", "jsonPath": ".status.progressText", "description": "Rollouts done / numRollout."},
        {"name": "Reward", "type": "number", "jsonPath": ".status.metrics.rewardMean", "description": "Mean reward of the latest rollout."},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts.job", "description": "Training attempts restarted."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "RayJob", "type": "string", "jsonPath": ".status.rayJobName", "priority": 1, "description": "Current attempt's RayJob."},
        {"name": "Checkpoint", "type": "string", "jsonPath": ".status.lastCheckpoint.path", "priority": 1, "description": "Latest complete checkpoint."},
    ]
