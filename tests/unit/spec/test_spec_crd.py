"""The CRD in crds/ is generated from the models, is structural, carries every cross-field rule as
CEL, and its CEL rules refuse exactly the specs the Python validators refuse."""

from __future__ import annotations

import copy
import re
from enum import Enum
from pathlib import Path
from typing import Any

import celpy  # cel-python evaluates the CRD's CEL rules (a dev dependency: these tests never skip)
import pytest
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rlkube_runtime.spec import RLJobSpec, RLJobStatus
from rlkube_runtime.spec.crd import CRD_FILE, REGENERATE_COMMAND, crd_manifest, render_crd_yaml
from rlkube_runtime.spec.load import SpecError, _unwrap, load_rljobs, parse_rljob
from rlkube_runtime.spec.backend_rules import BACKEND_RULES
from rlkube_runtime.spec.rljob import (
    ASYNC_PLACEMENT_RULE,
    BATCH_DIVISIBLE_RULE,
    BATCH_EQUATION_RULE,
    ENGINE_GPUS_RULE,
    FP8_RULES,
    MULTI_NODE_PLACEMENT_RULE,
    REF_UPDATE_RULE,
    STALENESS_BUFFER_RULE,
)

REPO = Path(__file__).resolve().parents[3]


def _version() -> dict[str, Any]:
    [version] = crd_manifest()["spec"]["versions"]
    return version


def _root() -> dict[str, Any]:
    return _version()["schema"]["openAPIV3Schema"]


def test_crd_file_is_up_to_date():
    committed = (REPO / CRD_FILE).read_text(encoding="utf-8")
    assert committed == render_crd_yaml(), f"{CRD_FILE} is stale: regenerate it with `{REGENERATE_COMMAND}`"


def test_crd_yaml_parses_back_to_the_manifest():
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    assert yaml.load(render_crd_yaml(), Loader=loader) == crd_manifest()


def test_names_scope_and_subresources():
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "rljobs.rlkube.io"
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["kind"], names["plural"], names["shortNames"]) == ("rlkube.io", "RLJob", "rljobs", ["rlj"])
    version = _version()
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns():
    columns = {c["name"].upper(): c for c in _version()["additionalPrinterColumns"]}
    assert {name: c["jsonPath"] for name, c in columns.items()} == {
        "PHASE": ".status.phase",
        "PROGRESS": ".status.progressText",
        "REWARD": ".status.metrics.rewardMean",
        "RESTARTS": ".status.restarts.job",
        "AGE": ".metadata.creationTimestamp",
        "RAYJOB": ".status.rayJobName",
        "CHECKPOINT": ".status.lastCheckpoint.path",
    }
    assert {name for name, c in columns.items() if c.get("priority") == 1} == {"RAYJOB", "CHECKPOINT"}


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, prop in node.get("properties", {}).items():
        yield from _walk(prop, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in _walk(_root()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields") is True, f"{path} has no type"
        for forbidden in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "nullable", "title", "const"):
            assert forbidden not in node, f"{path} has {forbidden}"
        assert node.get("default", 0) is not None, f"{path} defaults to null"
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path
        if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
            pytest.fail(f"{path}: exclusiveMinimum must be the OpenAPI v3.0 boolean form")
    # Only name/generateName may be constrained under metadata.
    assert _root()["properties"]["metadata"] == {"type": "object"}


def test_every_spec_and_status_field_is_described():
    for top in ("spec", "status"):
        for path, node in _walk(_root()["properties"][top], top):
            if path.endswith("{}") or (path.endswith("[]") and "properties" not in node):
                continue  # map values and untyped list items: described by their map or list
            assert node.get("description"), f"{path} has no description"


def _rules_at(dotted: str) -> list[dict[str, str]]:
    node = _root()
    for part in dotted.split("."):
        node = node["properties"][part]
    return node.get("x-kubernetes-validations", [])


def test_crd_carries_every_cross_field_rule():
    assert _rules_at("spec") == [
        BATCH_EQUATION_RULE, BATCH_DIVISIBLE_RULE, ASYNC_PLACEMENT_RULE, ENGINE_GPUS_RULE, MULTI_NODE_PLACEMENT_RULE,
        REF_UPDATE_RULE, STALENESS_BUFFER_RULE, *FP8_RULES,
        *BACKEND_RULES,
    ]
    assert BATCH_EQUATION_RULE["rule"].startswith("!has(self.training.globalBatchSize) || ")
    assert "messageExpression" in BATCH_EQUATION_RULE
    rules = {where: " ".join(r["rule"] for r in _rules_at(where)) for where in
             ("spec.model", "spec.rollout", "spec.reward", "spec.algorithm", "spec.algorithm.tis", "spec.training")}
    assert "has(self.hfCheckpoint) || has(self.preset) || has(self.load)" in rules["spec.model"]
    assert "rolloutDtype" not in rules["spec.model"]  # fp8's rules span sections (FP8_RULES)
    assert "self.asyncBufferSize == 1 || (has(self.mode) && self.mode == 'async')" in rules["spec.training"]
    assert "!(self.advantageEstimator in ['ppo'])" in rules["spec.algorithm"]
    assert "self.overSamplingBatchSize > self.batchSize" in rules["spec.rollout"]
    assert "self.type != 'custom' || has(self.customPath)" in rules["spec.reward"]
    assert "self.type != 'remote' || has(self.url)" in rules["spec.reward"]
    assert "self.epsClipHigh >= self.epsClip" in rules["spec.algorithm"]
    assert "self.clipLow <= self.clip" in rules["spec.algorithm.tis"]


def test_cel_rules_live_outside_lists():
    """A rule under an unbounded list is multiplied by its possible length in the API server's
    cost estimate; keeping rules on singleton nodes keeps every rule's cost constant."""
    for path, node in _walk(_root()):
        if "x-kubernetes-validations" in node:
            assert "[]" not in path and "{}" not in path, path


def _typed_for_cel(node: dict[str, Any]) -> bool:
    """Whether the API server declares this node to CEL: a node without a type (a free value), or a
    map of such values, is left out of the object's CEL type ("undefined field")."""
    if "type" not in node:
        return False
    extra = node.get("additionalProperties")
    return not isinstance(extra, dict) or _typed_for_cel(extra)


def test_cel_rules_only_read_fields_the_api_server_declares_to_cel():
    """kube-apiserver refused the whole CRD when a rule read model.megatronArgs (a map of untyped
    scalars): cel-python here would have evaluated it happily."""
    for where, node in _walk(_root()):
        for rule in node.get("x-kubernetes-validations", []):
            text = " ".join(rule.get(k, "") for k in ("rule", "messageExpression"))
            for path in re.findall(r"\bself((?:\.[A-Za-z_]\w*)+)", text):
                target = node
                for part in path.strip(".").split("."):
                    props = target.get("properties", {})
                    if part not in props:
                        break  # a method such as .size() or .format(), not a field
                    target = props[part]
                    assert _typed_for_cel(target), f"{where}: {rule['rule']} reads {part}, which CEL cannot see"


def test_message_expressions_format_numbers_instead_of_concatenating():
    """kube-apiserver 1.34 refused the CRD when a messageExpression did `'...' + string(n)`:
    its cost estimate for that is unbounded. format() passes."""
    for _, node in _walk(_root()):
        for rule in node.get("x-kubernetes-validations", []):
            assert "string(" not in rule.get("messageExpression", ""), rule


def _check_defaults(model: type[BaseModel], schema: dict[str, Any], where: str) -> None:
    props = schema["properties"]
    for name, field in model.model_fields.items():
        alias = field.alias or name
        prop = props[alias]
        where_field = f"{where}.{alias}"
        assert (alias in schema.get("required", [])) == field.is_required(), where_field
        nested = _unwrap(field.annotation)
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            if field.default_factory is nested:
                assert prop.get("default") == {}, where_field
            _check_defaults(nested, prop, where_field)
            continue
        item = (getattr(nested, "__args__", None) or [None])[0]
        if isinstance(item, type) and issubclass(item, BaseModel):
            _check_defaults(item, prop["items"], f"{where_field}[]")
        if field.default is PydanticUndefined or field.default is None:
            assert "default" not in prop, f"{where_field}: the model has no default but the CRD does"
        else:
            expected = field.default.value if isinstance(field.default, Enum) else field.default
            assert prop.get("default") == expected, where_field


# (field path in the CRD, a value to set at spec.<path>, accepted?): the CRD's pattern (RE2 in the
# API server; these patterns use only syntax Python's re shares) and the Python check must agree.
PATTERN_CASES = [
    ("resources.trainer.gpuResourceName", "nvidia.com/gpu", True),
    ("resources.trainer.gpuResourceName", "amd.com/gpu", True),
    ("resources.rollout.gpuResourceName", "gpu.intel.com/i915", True),
    ("resources.rollout.gpuResourceName", "gpu", False),
    ("resources.rollout.gpuResourceName", "NVIDIA.com/gpu", False),
    ("resources.priorityClassName", "system-cluster-critical", True),
    ("resources.priorityClassName", "rl.high", True),
    ("resources.priorityClassName", "High", False),
    ("resources.priorityClassName", "-high", False),
    ("resources.sharedMemorySize", "16Gi", True),
    ("resources.sharedMemorySize", "512Mi", True),
    ("resources.sharedMemorySize", "1.5G", True),
    ("resources.sharedMemorySize", "0.5Gi", True),
    ("resources.sharedMemorySize", "1073741824", True),
    ("resources.sharedMemorySize", "0", False),
    ("resources.sharedMemorySize", "0.0Gi", False),
    ("resources.sharedMemorySize", "16GB", False),
    ("resources.sharedMemorySize", "-1Gi", False),
    ("data.promptData", "/data/prompts.json", True),
    ("data.promptData", "/data/prompts.jsonl", True),
    ("data.promptData", "/data/prompts.parquet", True),
    ("data.promptData", "/data/prompts.JSONL", False),
    ("data.promptData", "/data/prompts.json.gz", False),
]


@pytest.mark.parametrize(("path", "value", "accepted"), PATTERN_CASES,
                         ids=[f"{p.rsplit('.', 1)[-1]}={v}" for p, v, _ in PATTERN_CASES])
def test_crd_patterns_and_python_accept_the_same_names(good_doc, path, value, accepted):
    node = _root()["properties"]["spec"]
    for part in path.split("."):
        node = node["properties"][part]
    assert bool(re.search(node["pattern"], value)) is accepted
    *parents, leaf = path.split(".")
    if path.startswith("resources.rollout."):
        good_doc["spec"]["resources"]["placement"] = "separate"  # engines' own pods: the fields are read
    target = good_doc["spec"]
    for part in parents:
        target = target.setdefault(part, {})
    target[leaf] = value
    if accepted:
        parse_rljob(good_doc)
    else:
        with pytest.raises(SpecError) as info:
            parse_rljob(good_doc)
        assert [p for p, _ in info.value.errors] == [f"spec.{path}"]


def test_crd_defaults_match_model_defaults():
    _check_defaults(RLJobSpec, _root()["properties"]["spec"], "spec")
    _check_defaults(RLJobStatus, _root()["properties"]["status"], "status")


# --- CEL semantics: the API server's rules agree with the Python validators -----------------------

_PROGRAMS: dict[str, Any] = {}
_ENV: list[Any] = []


def _format(template: Any, args: Any) -> Any:
    """Kubernetes' `'...'.format([...])` for %d and %s, printing doubles the way Go does (2.0 -> "2")."""
    values = iter(args)

    def one(match: re.Match) -> str:
        value = next(values)
        if isinstance(value, celpy.celtypes.DoubleType):
            number = float(value)
            return str(int(number)) if number.is_integer() else repr(number)
        return str(int(value)) if isinstance(value, celpy.celtypes.IntType) else str(value)

    return celpy.celtypes.StringType(re.sub(r"%[ds]", one, str(template)))


def _cel(expr: str, value: Any) -> Any:
    if expr not in _PROGRAMS:
        if not _ENV:
            _ENV.append(celpy.Environment())  # builds the CEL parser: do it once
        env = _ENV[0]
        _PROGRAMS[expr] = env.program(env.compile(expr), functions={"format": _format})
    return _PROGRAMS[expr].evaluate({"self": celpy.json_to_cel(value)})


def _default(schema: dict[str, Any], value: Any) -> Any:
    """Apply CRD defaults as the API server does before validation."""
    if isinstance(value, dict) and "properties" in schema:
        for name, prop in schema["properties"].items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = _default(prop, value[name])
    elif isinstance(value, list) and "items" in schema:
        value = [_default(schema["items"], v) for v in value]
    return value


def _cel_failures(schema: dict[str, Any], value: Any, path: str) -> list[tuple[str, str]]:
    failures = []
    if isinstance(value, dict):
        for rule in schema.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"]:
                continue  # transition rules only run on updates (tests/integration/test_operator.py)
            if not bool(_cel(rule["rule"], value)):
                message = str(_cel(rule["messageExpression"], value)) if "messageExpression" in rule else rule["message"]
                failures.append((path + rule.get("fieldPath", ""), message))
        for name, prop in schema.get("properties", {}).items():
            if name in value:
                failures += _cel_failures(prop, value[name], f"{path}.{name}")
    return failures


def _spec_cel_failures(doc: dict[str, Any]) -> list[tuple[str, str]]:
    schema = _root()["properties"]["spec"]
    return _cel_failures(schema, _default(schema, copy.deepcopy(doc["spec"])), "spec")


MEGATRON = {"training": {"numRollout": 5, "globalBatchSize": 128, "backend": "megatron"}}
TORCH = {"training": {"numRollout": 5, "globalBatchSize": 128, "backend": "torch"}}

# (spec sections replaced, expected path, messages identical in CEL and Python: CEL prints
# doubles its own way, so only messages without floats are compared)
CROSS_FIELD_CASES = [
    ({"rollout": {"batchSize": 32, "nSamplesPerPrompt": 8}}, "spec.training.globalBatchSize", True),
    ({"training": {"numRollout": 5, "numStepsPerRollout": 3}}, "spec.training.numStepsPerRollout", True),
    ({"training": {"numRollout": 5, "globalBatchSize": 128, "mode": "async"}}, "spec.training.mode", True),
    ({"algorithm": {"epsClipHigh": 0.1}}, "spec.algorithm.epsClipHigh", True),
    ({"algorithm": {"klCoef": 0.05}}, "spec.algorithm.klCoef", True),
    ({"algorithm": {"advantageEstimator": "gspo", "klCoef": 0.05}}, "spec.algorithm.klCoef", True),
    ({"algorithm": {"tis": {"clip": 1.5, "clipLow": 2.0}}}, "spec.algorithm.tis.clipLow", False),
    ({"rollout": {"batchSize": 16, "overSamplingBatchSize": 16}}, "spec.rollout.overSamplingBatchSize", True),
    ({"rollout": {"batchSize": 16, "topK": 0}}, "spec.rollout.topK", True),
    ({"data": {"promptData": "p.json", "chatTemplateKwargs": {"enable_thinking": False}}}, "spec.data.chatTemplateKwargs", True),
    ({"data": {"promptData": "p.json", "chatTemplateKwargs": {}}}, "spec.data.chatTemplateKwargs", True),
    ({"rollout": {"batchSize": 16, "engine": "builtin", "gpusPerEngine": 2}}, "spec.rollout.gpusPerEngine", True),
    # engines over several nodes: whole GPUs per node, on rollout pods of their own
    ({"rollout": {"batchSize": 16, "gpusPerEngine": 2, "nodesPerEngine": 4},
      "resources": {"placement": "separate", "rollout": {"gpus": 8}}}, "spec.rollout.nodesPerEngine", True),
    ({"rollout": {"batchSize": 16, "gpusPerEngine": 2, "nodesPerEngine": 2}}, "spec.rollout.nodesPerEngine", True),
    ({"training": {"numRollout": 5, "refUpdateInterval": 2}}, "spec.training.refUpdateInterval", True),
    ({"training": {"numRollout": 5, "refUpdateInterval": 2}, "algorithm": {"advantageEstimator": "grpo", "klCoef": 0.0}},
     "spec.training.refUpdateInterval", True),
    ({"reward": {"type": "custom"}}, "spec.reward.customPath", True),
    ({"reward": {"type": "remote"}}, "spec.reward.url", True),
    ({"model": {"dtype": "float32"}}, "spec.model", True),
    ({"eval": {"interval": 1, "datasets": [{"name": "a", "path": "builtin:digit-successor", "nSamples": 4, "passK": [1, 8]}]}},
     "spec.eval.datasets", False),
    ({"resources": {"placement": "separate", "rollout": {"gpus": 6}}, "rollout": {"batchSize": 16, "gpusPerEngine": 4}},
     "spec.resources.rollout.gpus", True),
    ({"resources": {"placement": "separate", "rollout": {"gpus": 0}}, "rollout": {"batchSize": 16}},
     "spec.resources.rollout.gpus", True),  # SGLang (the default engine) needs GPUs
    # separate-placement pod settings that colocated engines (in the trainer's pods) would not read
    ({"resources": {"placement": "colocated", "rollout": {"gpus": 4}}}, "spec.resources.rollout.gpus", True),
    ({"resources": {"placement": "colocated", "rollout": {"gpuResourceName": "amd.com/gpu"}}},
     "spec.resources.rollout.gpuResourceName", True),
    ({"resources": {"placement": "colocated", "rollout": {"image": "r:1"}}}, "spec.resources.rollout.image", True),
    ({"resources": {"placement": "colocated", "rollout": {"nodeSelector": {"pool": "a"}}}},
     "spec.resources.rollout.nodeSelector", True),
    ({"resources": {"placement": "colocated", "rollout": {"tolerations": [{"key": "gpu"}]}}},
     "spec.resources.rollout.tolerations", True),
    # what a trainer backend cannot honour (backend_rules.py)
    ({**TORCH, "parallelism": {"tensor": 2}}, "spec.parallelism.tensor", True),
    ({**TORCH, "parallelism": {"pipeline": 2}}, "spec.parallelism.pipeline", True),
    ({**TORCH, "parallelism": {"sequenceParallel": True}}, "spec.parallelism.sequenceParallel", True),
    ({**TORCH, "parallelism": {"recompute": "selective"}}, "spec.parallelism.recompute", True),
    # context parallelism: no backend builds it; expert parallelism: megatron's, within the trainer GPUs
    ({"parallelism": {"context": 4}}, "spec.parallelism.context", True),
    ({**TORCH, "parallelism": {"context": 2}}, "spec.parallelism.context", True),
    ({**TORCH, "parallelism": {"expert": 2}}, "spec.parallelism.expert", True),
    ({**MEGATRON, "parallelism": {"tensor": 4, "expert": 4}}, "spec.parallelism.expert", True),
    ({"parallelism": {"expert": 3}}, "spec.parallelism.expert", True),
    ({**MEGATRON, "parallelism": {"tensor": 3}}, "spec.parallelism", True),
    ({**MEGATRON, "parallelism": {"pipeline": 3}}, "spec.parallelism", True),
    ({**MEGATRON, "parallelism": {"tensor": 4, "pipeline": 4}}, "spec.parallelism", True),
    ({**MEGATRON, "parallelism": {"tensor": 2}, "resources": {"trainer": {"gpusPerNode": 0}}}, "spec.parallelism", True),
    ({**MEGATRON, "parallelism": {"sequenceParallel": True}}, "spec.parallelism.sequenceParallel", True),
    ({**MEGATRON, "model": {"preset": "tiny", "dtype": "float16"}}, "spec.model.dtype", True),
    # auto (the default) chooses megatron for what only megatron does, and megatron's rules apply
    ({"parallelism": {"tensor": 3}}, "spec.parallelism", True),
    ({"parallelism": {"sequenceParallel": True}}, "spec.parallelism.sequenceParallel", True),
    ({"parallelism": {"tensor": 2}, "model": {"preset": "tiny", "dtype": "float16"}}, "spec.model.dtype", True),
    # fp8 rollouts: not by disk, with TIS
    ({"model": {"preset": "tiny", "rolloutDtype": "fp8"}, "rollout": {"batchSize": 16, "engine": "builtin"}},
     "spec.algorithm.tis.enabled", True),
    ({"model": {"preset": "tiny", "rolloutDtype": "fp8"}, "rollout": {"batchSize": 16, "engine": "builtin"},
      "algorithm": {"tis": {"enabled": True}},
      "training": {"numRollout": 5, "globalBatchSize": 128, "updateWeightsTransport": "disk"}},
     "spec.training.updateWeightsTransport", True),
    # fields nothing implements yet
    ({"training": {"numRollout": 5, "globalBatchSize": 128, "asyncBufferSize": 2}}, "spec.training.asyncBufferSize", True),
    ({"algorithm": {"advantageEstimator": "ppo"}}, "spec.algorithm.advantageEstimator", True),
    ({"rollout": {"batchSize": 16, "maskOffPolicyInPartialRollout": True}}, "spec.rollout.maskOffPolicyInPartialRollout",
     True),
    ({"rollout": {"batchSize": 16, "maxStaleness": 2}}, "spec.rollout.maxStaleness", True),
    ({"rollout": {"batchSize": 16, "partialRollout": True, "maxStaleness": 1},
      "training": {"numRollout": 5, "mode": "async", "asyncBufferSize": 2}, "resources": {"placement": "separate"}},
     "spec.rollout.maxStaleness", True),
]

# Specs both sides accept: each backend with what it can do.
ACCEPTED_CASES = [
    {"training": {"numRollout": 5, "refUpdateInterval": 2}, "algorithm": {"useKlLoss": True, "klLossCoef": 0.01}},
    {"training": {"numRollout": 5, "refUpdateInterval": 1},
     "algorithm": {"advantageEstimator": "reinforce_plus_plus", "klCoef": 0.05}},
    {"data": {"promptData": "p.json", "applyChatTemplate": True, "chatTemplateKwargs": {"enable_thinking": False}}},
    {"parallelism": {"recompute": "full", "microBatchSize": 2, "dynamicBatchSize": False}},
    {"rollout": {"batchSize": 16, "gpusPerEngine": 16, "nodesPerEngine": 2},
     "resources": {"placement": "separate", "rollout": {"gpus": 32}}},
    {"rollout": {"batchSize": 16, "partialRollout": True, "maskOffPolicyInPartialRollout": True}},
    {"rollout": {"batchSize": 16, "partialRollout": True, "maxStaleness": 0}},
    {"rollout": {"batchSize": 16, "partialRollout": True, "maxStaleness": 2},
     "training": {"numRollout": 5, "mode": "async", "asyncBufferSize": 2}, "resources": {"placement": "separate"}},
    {"training": {"numRollout": 5, "globalBatchSize": 128, "backend": "torch", "mode": "sync", "asyncBufferSize": 1}},
    {"training": {"numRollout": 5, "mode": "async", "asyncBufferSize": 4}, "resources": {"placement": "separate"},
     "algorithm": {"tis": {"enabled": True, "level": "geometric", "mode": "mask", "clipLow": 0.99, "clip": 1.01},
                   "opsm": {"enabled": True, "delta": 0.001}}},
    {**MEGATRON, "parallelism": {"tensor": 2, "pipeline": 2, "sequenceParallel": True}},
    {**MEGATRON, "parallelism": {"tensor": 2, "recompute": "selective"}},
    {**MEGATRON, "parallelism": {"tensor": 2, "expert": 4}},
    {"parallelism": {"expert": 8}},  # auto: megatron, 8 expert-parallel ranks on the 8 GPUs
    {**MEGATRON, "parallelism": {"tensor": 4}, "resources": {"placement": "colocated", "trainer": {"nodes": 3, "gpusPerNode": 4}}},
    {**MEGATRON, "resources": {"placement": "colocated", "trainer": {"gpusPerNode": 0}}},
    {**MEGATRON, "model": {"preset": "tiny", "megatronArgs": {"attention-softmax-in-fp32": True}}},
    # auto: megatron for tensor 2 (which fits the 8 GPUs), torch for float16 with nothing split
    {"parallelism": {"tensor": 2, "sequenceParallel": True}},
    {"model": {"preset": "tiny", "dtype": "float16"}},
    # fp8 rollouts into the built-in engine, with TIS, by any transport but disk, either backend
    {"model": {"preset": "tiny", "rolloutDtype": "fp8"}, "rollout": {"batchSize": 16, "engine": "builtin"}, "algorithm": {"tis": {"enabled": True}}},
    {"model": {"preset": "tiny", "rolloutDtype": "fp8"}, "rollout": {"batchSize": 16, "engine": "sglang"}, "algorithm": {"tis": {"enabled": True}}},
    {**MEGATRON, "model": {"preset": "tiny", "rolloutDtype": "fp8"}, "rollout": {"batchSize": 16, "engine": "builtin"}, "algorithm": {"tis": {"enabled": True}}},
    {"model": {"preset": "tiny", "rolloutDtype": "fp8"}, "rollout": {"batchSize": 16, "engine": "builtin"}, "algorithm": {"tis": {"enabled": True}}, "training": {"numRollout": 5, "globalBatchSize": 128, "updateWeightsTransport": "http"}},
    # a CPU job's rollout pod: the built-in engine on no GPUs
    {"rollout": {"batchSize": 16, "engine": "builtin"}, "resources": {"placement": "separate", "rollout": {"gpus": 0},
                                                                     "trainer": {"gpusPerNode": 0}}},
    # colocated with resources.rollout's defaults written out (as a dumped manifest has them)
    {"resources": {"placement": "colocated", "rollout": {"gpus": 8, "gpuResourceName": "nvidia.com/gpu",
                                                         "nodeSelector": {}, "tolerations": [], "affinity": {}}}},
]


FIXED_AFTER_CREATION = [
    "spec.model", "spec.data", "spec.parallelism", "spec.resources.placement", "spec.rollout.batchSize",
    "spec.rollout.nSamplesPerPrompt", "spec.training.globalBatchSize", "spec.training.numStepsPerRollout",
    "spec.training.mode", "spec.training.backend",
]


@pytest.mark.parametrize("path", FIXED_AFTER_CREATION)
def test_fields_a_running_job_depends_on_cannot_change(path):
    rules = _rules_at(path)
    assert {"rule": "self == oldSelf", "message": f"{path} cannot change while the RLJob exists: its checkpoints "
            "depend on it; create a new RLJob to change it"} in rules


def test_an_optional_fixed_field_cannot_be_added_or_removed_either():
    assert any(r["rule"] == "has(self.globalBatchSize) == has(oldSelf.globalBatchSize)" for r in _rules_at("spec.training"))


def test_names_are_short_dns_labels_so_the_rayjob_name_fits():
    assert any("self.metadata.name.size() <= 40" in r["rule"] for r in _root().get("x-kubernetes-validations", []))


@pytest.mark.parametrize(("changes", "path", "same_message"), CROSS_FIELD_CASES, ids=[c[1] for c in CROSS_FIELD_CASES])
def test_cel_and_python_refuse_the_same_spec(good_doc, changes, path, same_message):
    good_doc["spec"].update(changes)
    cel = _spec_cel_failures(good_doc)
    with pytest.raises(SpecError) as info:
        parse_rljob(good_doc)
    python = info.value.errors
    assert [p for p, _ in cel] == [path] and [p for p, _ in python] == [path]
    if same_message:
        assert cel == python


@pytest.mark.parametrize("changes", ACCEPTED_CASES)
def test_cel_and_python_accept_the_same_spec(good_doc, changes):
    good_doc["spec"].update(changes)
    parse_rljob(good_doc)
    assert _spec_cel_failures(good_doc) == []


def test_rollout_pod_objects_of_a_colocated_job_are_refused_by_the_spec_model_alone(good_doc):
    """CEL cannot look inside free-form Kubernetes objects, so resources.rollout.resources and
    .affinity of a colocated job pass the CRD; the spec model refuses them, and with it the
    operator, which fails such a job at once naming the field."""
    good_doc["spec"]["resources"]["rollout"] = {"resources": {"limits": {"memory": "8Gi"}},
                                                "affinity": {"nodeAffinity": {}}}
    assert _spec_cel_failures(good_doc) == []
    with pytest.raises(SpecError) as info:
        parse_rljob(good_doc)
    assert [p for p, _ in info.value.errors] == ["spec.resources.rollout.resources", "spec.resources.rollout.affinity"]


def test_cel_accepts_every_valid_spec(good_doc):
    assert _spec_cel_failures(good_doc) == []
    good_doc["spec"]["training"].pop("globalBatchSize")
    assert _spec_cel_failures(good_doc) == []
    for path in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        for job in load_rljobs(path):
            assert _spec_cel_failures(job.to_manifest()) == [], path.name
