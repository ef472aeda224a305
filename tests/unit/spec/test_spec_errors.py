"""Broken RLJobs: each is refused with the field path in the user's camelCase names and a message
that says the value and what is allowed."""

from __future__ import annotations

from typing import Any

import pytest

from rlkube_runtime.cli import main as rlkube
from rlkube_runtime.spec.load import SpecError, load_rljobs, parse_rljob


def _set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _delete(doc: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = doc
    for key in parents:
        node = node[key]
    del node[leaf]


BATCH_MESSAGE = "rollout.batchSize(32) x nSamplesPerPrompt(8) = 256 but globalBatchSize(128) x numStepsPerRollout(1) = 128"

# (case id, changes {dotted path: value, or None to delete}, expected error path, expected message fragment)
BROKEN = [
    ("batch-equation", {"spec.rollout.batchSize": 32}, "spec.training.globalBatchSize", BATCH_MESSAGE),
    (
        "batch-not-divisible",
        {"spec.training.globalBatchSize": None, "spec.training.numStepsPerRollout": 3},
        "spec.training.numStepsPerRollout",
        "rollout.batchSize(16) x nSamplesPerPrompt(8) = 128 samples cannot be split into numStepsPerRollout(3)",
    ),
    ("unknown-field", {"spec.rollout.batchSz": 16}, "spec.rollout.batchSz", "unknown field (did you mean 'batchSize'?)"),
    ("snake-case-key", {"spec.rollout.max_turns": 2}, "spec.rollout.max_turns", "unknown field (did you mean 'maxTurns'?)"),
    (
        "eps-clip-high-below-eps-clip",
        {"spec.algorithm": {"epsClip": 0.2, "epsClipHigh": 0.1}},
        "spec.algorithm.epsClipHigh",
        "epsClipHigh(0.1) must be >= epsClip(0.2)",
    ),
    (
        "kl-coef-with-grpo",
        {"spec.algorithm": {"klCoef": 0.05}},
        "spec.algorithm.klCoef",
        "klCoef folds a KL penalty into the rewards, which only reinforce_plus_plus, reinforce_plus_plus_baseline, ppo "
        "use; with grpo use useKlLoss and klLossCoef",
    ),
    (
        "over-sampling-not-above-batch",
        {"spec.rollout.overSamplingBatchSize": 16},
        "spec.rollout.overSamplingBatchSize",
        "overSamplingBatchSize(16) must be greater than batchSize(16)",
    ),
    ("async-colocated", {"spec.training.mode": "async"}, "spec.training.mode", "set resources.placement: separate"),
    (
        "bad-enum",
        {"spec.algorithm": {"advantageEstimator": "ppo2"}},
        "spec.algorithm.advantageEstimator",
        "invalid value 'ppo2'; allowed values: 'grpo', 'gspo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline' or 'ppo'",
    ),
    ("negative-lr", {"spec.training.optimizer.lr": -1e-3}, "spec.training.optimizer.lr", "must be greater than 0, got -0.001"),
    ("custom-reward-without-path", {"spec.reward": {"type": "custom"}}, "spec.reward.customPath", "needs customPath"),
    ("remote-reward-without-url", {"spec.reward": {"type": "remote"}}, "spec.reward.url", "needs url"),
    ("no-starting-weights", {"spec.model": {}}, "spec.model", "set at least one of hfCheckpoint, preset or load"),
    ("string-for-integer", {"spec.rollout.nSamplesPerPrompt": "8"}, "spec.rollout.nSamplesPerPrompt", "must be a valid integer, got '8'"),
    (
        "malformed-callable-path",
        {"spec.rollout.customGenerateFunction": "my_pkg.generate"},
        "spec.rollout.customGenerateFunction",
        "must name a Python callable as 'package.module:function'",
    ),
    ("bad-data-path", {"spec.data.promptData": "prompts.csv"}, "spec.data.promptData", "got 'prompts.csv'"),
    ("top-k-zero", {"spec.rollout.topK": 0}, "spec.rollout.topK", "topK must be -1 (disabled) or at least 1"),
    ("top-p-zero", {"spec.rollout.topP": 0.0}, "spec.rollout.topP", "must be greater than 0"),
    ("tis-clip-low-above-clip", {"spec.algorithm": {"tis": {"clip": 1.5, "clipLow": 2.0}}}, "spec.algorithm.tis.clipLow", "clipLow(2.0) must be <= clip(1.5)"),
    (
        "duplicate-eval-dataset",
        {"spec.eval": {"datasets": [{"name": "a", "path": "a.jsonl"}, {"name": "a", "path": "b.jsonl"}]}},
        "spec.eval.datasets[1].name",
        "duplicate dataset name 'a'",
    ),
    ("missing-required", {"spec.training.numRollout": None}, "spec.training.numRollout", "required field is missing"),
    ("missing-name", {"metadata.name": None}, "metadata.name", "required field is missing"),
    ("invalid-name", {"metadata.name": "Local_Tiny"}, "metadata.name", "metadata.name must be at most 40 characters"),
    ("section-not-a-mapping", {"spec.resources.trainer": [1]}, "spec.resources.trainer", "must be a mapping, got a list"),
    ("free-args-nested", {"spec.rollout.sglangArgs": {"x": {"y": 1}}}, "spec.rollout.sglangArgs.x", "must be a string, number or boolean"),
    (
        "gpu-resource-without-vendor",
        {"spec.resources.trainer": {"gpuResourceName": "gpu"}},
        "spec.resources.trainer.gpuResourceName",
        "must be a Kubernetes extended resource name as '<vendor domain>/<name>' (e.g. nvidia.com/gpu, amd.com/gpu), "
        "got 'gpu'",
    ),
    (
        "pod-label-takes-rlkubes-key",
        {"spec.resources.podLabels": {"rlkube.io/role": "mine"}},
        "spec.resources.podLabels",
        "label 'rlkube.io/role' is reserved: rlkube and KubeRay find the job's pods by the labels rlkube.io/*, ray.io/*",
    ),
    (
        "group-label-takes-kuberays-key",
        {"spec.resources.rollout": {"podLabels": {"ray.io/node-type": "worker"}}},
        "spec.resources.rollout.podLabels",
        "label 'ray.io/node-type' is reserved",
    ),
    (
        "pod-label-takes-managed-by",
        {"spec.resources.trainer": {"podLabels": {"app.kubernetes.io/managed-by": "me"}}},
        "spec.resources.trainer.podLabels",
        "label 'app.kubernetes.io/managed-by' is reserved",
    ),
    (
        "pod-label-value-with-space",
        {"spec.resources.podLabels": {"team": "rl team"}},
        "spec.resources.podLabels",
        "label 'team': value 'rl team' must be empty or at most 63 letters, digits",
    ),
    (
        "pod-label-key-malformed",
        {"spec.resources.podLabels": {"Example.com/team": "rl"}},
        "spec.resources.podLabels",
        "key 'Example.com/team' must be '[prefix/]name'",
    ),
    (
        "pod-annotation-takes-rlkubes-prefix",
        {"spec.resources.podAnnotations": {"rlkube.io/failed-at": "now"}},
        "spec.resources.podAnnotations",
        "annotation 'rlkube.io/failed-at' is reserved for rlkube (rlkube.io/*)",
    ),
    (
        "priority-class-uppercase",
        {"spec.resources.priorityClassName": "High"},
        "spec.resources.priorityClassName",
        "must be a Kubernetes object name: at most 253 lowercase letters, digits, '-' and '.', starting and ending "
        "with a letter or digit, got 'High'",
    ),
    (
        "pull-secret-as-a-string",
        {"spec.resources.imagePullSecrets": ["regcred"]},
        "spec.resources.imagePullSecrets[0]",
        "must be a mapping, got 'regcred' (a string)",
    ),
    (
        "shared-memory-zero",
        {"spec.resources.sharedMemorySize": "0Gi"},
        "spec.resources.sharedMemorySize",
        "must be a positive Kubernetes quantity of bytes such as 16Gi or 512Mi, got '0Gi'",
    ),
    # What the trainer backend cannot honour, with the numbers (spec/backend_rules.py).
    (
        "torch-tensor-parallel",
        {"spec.training.backend": "torch", "spec.parallelism": {"tensor": 2}},
        "spec.parallelism.tensor",
        "tensor(2) > 1 splits the model over GPUs, which the torch backend cannot do (it trains whole-model "
        "data-parallel replicas); set spec.training.backend: megatron (or auto)",
    ),
    ("torch-pipeline", {"spec.training.backend": "torch", "spec.parallelism": {"pipeline": 4}}, "spec.parallelism.pipeline", "pipeline(4) > 1 splits"),
    (
        "torch-sequence-parallel",
        {"spec.training.backend": "torch", "spec.parallelism": {"sequenceParallel": True}},
        "spec.parallelism.sequenceParallel",
        "which the torch backend does not have; set spec.training.backend: megatron (or auto)",
    ),
    (
        "torch-selective-recompute",
        {"spec.training.backend": "torch", "spec.parallelism": {"recompute": "selective"}},
        "spec.parallelism.recompute",
        "recompute: selective (attention only) is not available in the torch backend",
    ),
    (
        "torch-megatron-args",
        {"spec.training.backend": "torch", "spec.model.megatronArgs": {"num-layers": 36, "swiglu": True}},
        "spec.model.megatronArgs",
        "holds 2 Megatron-core argument(s), which the torch backend does not read; set spec.training.backend: megatron "
        "(or auto), or remove them",
    ),
    (
        "megatron-args-from-the-hf-config",
        {"spec.training.backend": "megatron", "spec.model.megatronArgs": {"num-layers": 36}},
        "spec.model.megatronArgs.num-layers",
        "the architecture comes from the HF checkpoint's config.json; remove it",
    ),
    (
        "megatron-args-unknown-key",
        {"spec.model.megatronArgs": {"norm-epsilon": 1.0e-6}},  # auto: megatron, because megatronArgs is set
        "spec.model.megatronArgs.norm-epsilon",
        "not a field of megatron-core 0.16.1's TransformerConfig or OptimizerConfig (keys are Megatron-LM flag names "
        "without the dashes)",
    ),
    (
        "megatron-args-wrong-type",
        {"spec.model.megatronArgs": {"attention-dropout": "high"}},
        "spec.model.megatronArgs.attention-dropout",
        "'high' is not a float, the type of megatron-core's attention_dropout",
    ),
    (
        "megatron-args-mixture-of-experts",
        {"spec.model.megatronArgs": {"moe-router-topk": 2}},
        "spec.model.megatronArgs.moe-router-topk",
        "a mixture-of-experts setting; RL jobs build the router from the model's config.json (routed as its HF block); "
        "of the MoE keys only moe_aux_loss_coeff, moe_z_loss_coeff, moe_router_load_balancing_type can be set; remove it",
    ),
    (
        "megatron-args-balancing-type-unknown",
        {"spec.model.megatronArgs": {"moe-router-load-balancing-type": "sinkhorn"}},
        "spec.model.megatronArgs.moe-router-load-balancing-type",
        "'sinkhorn' is not one of ['aux_loss', 'seq_aux_loss', 'none']",
    ),
    (
        "megatron-args-aux-loss-negative",
        {"spec.model.megatronArgs": {"moe-aux-loss-coeff": -0.01}},
        "spec.model.megatronArgs.moe-aux-loss-coeff",
        "-0.01 is not a float >= 0",
    ),
    (
        "megatron-args-aux-loss-without-balancing",
        {"spec.model.megatronArgs": {"moe-aux-loss-coeff": 0.01, "moe-router-load-balancing-type": "none"}},
        "spec.model.megatronArgs.moe-aux-loss-coeff",
        "an auxiliary loss needs moe_router_load_balancing_type aux_loss or seq_aux_loss (it is none here)",
    ),
    (
        "megatron-args-aux-loss-with-pipeline-and-experts",
        {"spec.model.megatronArgs": {"moe-z-loss-coeff": 0.001}, "spec.parallelism": {"pipeline": 2, "expert": 2},
         "spec.resources.trainer": {"nodes": 1, "gpusPerNode": 4}},
        "spec.model.megatronArgs.moe-z-loss-coeff",
        "not with both spec.parallelism.pipeline (2) and spec.parallelism.expert (2) above 1: the pipeline schedule "
        "would count the load-balancing loss of the empty micro-batches that keep expert ranks in step",
    ),
    (
        "megatron-replica-larger-than-trainer",
        {"spec.training.backend": "megatron", "spec.parallelism": {"tensor": 4, "pipeline": 4}},
        "spec.parallelism",
        "tensor(4) x pipeline(4) = 16 GPUs per model replica must divide the trainer GPUs, "
        "resources.trainer.nodes(1) x gpusPerNode(8) = 8",
    ),
    (
        "megatron-replica-not-dividing",
        {"spec.parallelism": {"tensor": 2, "pipeline": 2}, "spec.resources.trainer": {"nodes": 3, "gpusPerNode": 2}},
        "spec.parallelism",
        "tensor(2) x pipeline(2) = 4 GPUs per model replica must divide the trainer GPUs, "
        "resources.trainer.nodes(3) x gpusPerNode(2) = 6",
    ),
    (
        "expert-parallelism-larger-than-trainer",
        {"spec.training.backend": "megatron", "spec.parallelism": {"tensor": 4, "expert": 4}},
        "spec.parallelism.expert",
        "expert(4) x expertTensor(4) x pipeline(1) = 16 GPUs must divide the trainer GPUs, resources.trainer.nodes(1) x "
        "gpusPerNode(8) = 8 (expert-parallel ranks are data-parallel ranks that split the experts among them; "
        "expertTensor is the tensor size unless set)",
    ),
    (
        "expert-tensor-larger-than-trainer",
        {"spec.parallelism": {"tensor": 2, "expert": 4, "expertTensor": 2, "sequenceParallel": True},
         "spec.resources.trainer": {"nodes": 1, "gpusPerNode": 4}},
        "spec.parallelism.expert",
        "expert(4) x expertTensor(2) x pipeline(1) = 8 GPUs must divide the trainer GPUs, resources.trainer.nodes(1) x "
        "gpusPerNode(4) = 4",
    ),
    (
        "torch-expert-tensor",
        {"spec.training.backend": "torch", "spec.parallelism": {"expertTensor": 2}},
        "spec.parallelism.expertTensor",
        "expertTensor(2) > 1 splits each expert over GPUs, which the torch backend cannot do",
    ),
    (
        "torch-expert-parallelism",
        {"spec.training.backend": "torch", "spec.parallelism": {"expert": 2}},
        "spec.parallelism.expert",
        "expert(2) > 1 splits the model over GPUs, which the torch backend cannot do",
    ),
    (
        "torch-routing-replay",
        {"spec.training.backend": "torch", "spec.training.routingReplay": True},
        "spec.training.routingReplay",
        "routingReplay has the trainer's routers take the engine's experts, which the torch backend",
    ),
    (
        "pipelined-routing-replay",
        {"spec.training.routingReplay": True, "spec.parallelism": {"pipeline": 2}},
        "spec.training.routingReplay",
        "routingReplay with parallelism.pipeline(2) > 1 is not built",
    ),
    (
        "lora-on-megatron",
        {"spec.training.backend": "megatron", "spec.training.lora": {"rank": 8}},
        "spec.training.lora",
        "lora is trained by the torch backend (peft); megatron-core has no LoRA layers",
    ),
    (
        "lora-with-tensor-parallelism",
        {"spec.training.lora": {"rank": 8}, "spec.parallelism": {"tensor": 2}},
        "spec.training.lora",
        "lora is trained by the torch backend (peft)",
    ),
    (
        "lora-over-distributed",
        {"spec.training.lora": {"rank": 8}, "spec.training.updateWeightsTransport": "distributed"},
        "spec.training.updateWeightsTransport",
        "with lora the weight sync sends the adapter as a directory on storage the engines share",
    ),
    (
        "lora-with-ref-update",
        {"spec.training.lora": {"rank": 8}, "spec.training.refUpdateInterval": 2, "spec.algorithm": {"useKlLoss": True}},
        "spec.training.refUpdateInterval",
        "with lora the reference model is the base model",
    ),
    (
        "lora-fp8",
        {"spec.training.lora": {"rank": 8}, "spec.model": {"preset": "tiny", "rolloutDtype": "fp8"},
         "spec.algorithm": {"tis": {"enabled": True}}},
        "spec.training.lora",
        "lora with model.rolloutDtype fp8 is not built",
    ),
    (
        "lora-rank-zero",
        {"spec.training.lora": {"rank": 0}},
        "spec.training.lora.rank",
        "greater than or equal to 1",
    ),
    (
        "lora-unknown-module",
        {"spec.training.lora": {"rank": 8, "targetModules": ["qkv"]}},
        "spec.training.lora.targetModules[0]",
        "q_proj",
    ),
    (
        "lora-module-twice",
        {"spec.training.lora": {"rank": 8, "targetModules": ["q_proj", "q_proj"]}},
        "spec.training.lora.targetModules",
        "each module at most once",
    ),
    (
        "no-context-parallelism",
        {"spec.parallelism": {"context": 2}},
        "spec.parallelism.context",
        "context(2) > 1: context parallelism is not built",
    ),
    (
        "megatron-float16",
        {"spec.parallelism": {"tensor": 2}, "spec.model": {"preset": "tiny", "dtype": "float16"}},
        "spec.model.dtype",
        "float16 needs loss scaling, which the megatron backend does not do",
    ),
    (
        "megatron-sequence-parallel-without-tensor",
        {"spec.training.backend": "megatron", "spec.parallelism": {"sequenceParallel": True}},
        "spec.parallelism.sequenceParallel",
        "sequenceParallel splits activations along the tensor-parallel ranks and needs tensor > 1, got tensor(1)",
    ),
    # fp8 rollouts: what they cannot run with.
    (
        "fp8-by-disk",
        {"spec.model.rolloutDtype": "fp8", "spec.rollout.engine": "builtin", "spec.algorithm.tis.enabled": True,
         "spec.training.updateWeightsTransport": "disk"},
        "spec.training.updateWeightsTransport",
        "training.updateWeightsTransport disk writes the HF directory unquantized",
    ),
    (
        "fp8-without-tis",
        {"spec.model.rolloutDtype": "fp8", "spec.rollout.engine": "builtin"},
        "spec.algorithm.tis.enabled",
        "set algorithm.tis.enabled: true",
    ),
    # Fields nothing implements yet.
    (
        "async-buffer-without-async-mode",
        {"spec.training.asyncBufferSize": 3},
        "spec.training.asyncBufferSize",
        "asyncBufferSize(3): only async mode (training.mode: async) generates ahead; set 1 or mode async",
    ),
    (
        "async-buffer-above-eight",
        {"spec.training.asyncBufferSize": 9, "spec.training.mode": "async", "spec.resources.placement": "separate"},
        "spec.training.asyncBufferSize",
        "less than or equal to 8",
    ),
    (
        "off-policy-mask-without-partial-rollout",
        {"spec.rollout.maskOffPolicyInPartialRollout": True},
        "spec.rollout.maskOffPolicyInPartialRollout",
        "maskOffPolicyInPartialRollout masks what partial rollout kept from an earlier rollout: set partialRollout: true",
    ),
    (
        "max-staleness-without-partial-rollout",
        {"spec.rollout.maxStaleness": 2},
        "spec.rollout.maxStaleness",
        "maxStaleness bounds how old a response partial rollout keeps may be: set partialRollout: true",
    ),
    (
        "max-staleness-below-the-async-buffer",
        {"spec.rollout.maxStaleness": 1, "spec.rollout.partialRollout": True, "spec.training.mode": "async",
         "spec.training.asyncBufferSize": 3, "spec.resources.placement": "separate"},
        "spec.rollout.maxStaleness",
        "rollout.maxStaleness(1) is below training.asyncBufferSize(3)",
    ),
    (
        "ppo-without-critic",
        {"spec.algorithm": {"advantageEstimator": "ppo"}},
        "spec.algorithm.advantageEstimator",
        "ppo needs a critic (value) model, which rlkube's trainer backends do not have; use grpo, gspo",
    ),
    (
        "shared-memory-unit-typo",
        {"spec.resources.sharedMemorySize": "16GB"},
        "spec.resources.sharedMemorySize",
        "got '16GB'",
    ),
]


@pytest.mark.parametrize(("changes", "path", "fragment"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_broken_spec_names_the_field(good_doc, spec_errors, changes, path, fragment):
    for dotted, value in changes.items():
        _delete(good_doc, dotted) if value is None else _set(good_doc, dotted, value)
    errors = spec_errors(good_doc)
    messages = {p: m for p, m in errors}
    assert path in messages, f"expected an error at {path}, got {errors}"
    assert fragment in messages[path]


def test_batch_equation_message_is_exact(good_doc):
    good_doc["spec"]["rollout"]["batchSize"] = 32
    with pytest.raises(SpecError) as info:
        parse_rljob(good_doc)
    assert str(info.value) == f"spec.training.globalBatchSize: {BATCH_MESSAGE}"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("kind", "RayJob", ("kind", "must be 'RLJob', got 'RayJob'")),
        ("apiVersion", "rlkube.io/v1", ("apiVersion", "must be 'rlkube.io/v1alpha1', got 'rlkube.io/v1'")),
        ("kind", None, ("kind", "required field is missing; must be 'RLJob'")),
    ],
)
def test_wrong_kind_or_api_version_is_the_only_error(good_doc, spec_errors, key, value, expected):
    good_doc["spec"] = {"unrelated": True}  # a different kind's spec must not add noise
    if value is None:
        del good_doc[key]
    else:
        good_doc[key] = value
    assert spec_errors(good_doc) == [expected]


def test_every_violation_is_reported_at_once(good_doc, spec_errors):
    good_doc["spec"]["rollout"]["batchSize"] = 32
    good_doc["spec"]["training"]["mode"] = "async"
    paths = [p for p, _ in spec_errors(good_doc)]
    assert paths == ["spec.training.globalBatchSize", "spec.training.mode"]


def test_malformed_yaml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: rlkube.io/v1alpha1\nkind: RLJob\nmetadata:\n  name: x\n bad: [\n")
    with pytest.raises(SpecError) as info:
        load_rljobs(bad)
    assert info.value.source == str(bad)
    assert info.value.errors[0][0] == "line 5, column 2"
    assert rlkube(["validate", str(bad)]) == 1
    assert f"{bad}: line 5, column 2: invalid YAML:" in capsys.readouterr().err


def test_duplicate_key_is_an_error_not_last_wins(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("apiVersion: rlkube.io/v1alpha1\nkind: RLJob\nmetadata:\n  name: a\n  name: b\nspec: {}\n")
    with pytest.raises(SpecError, match="line 5, column 3: invalid YAML: found duplicate key 'name'"):
        load_rljobs(dup)


def test_validate_reports_each_document(tmp_path, capsys, good_doc):
    import yaml

    broken = {**good_doc, "metadata": {"name": "broken"}}
    broken["spec"] = {**good_doc["spec"], "rollout": {**good_doc["spec"]["rollout"], "batchSz": 1}}
    path = tmp_path / "jobs.yaml"
    # An empty document between the two is skipped but keeps its number.
    path.write_text(yaml.safe_dump(good_doc) + "---\n---\n" + yaml.safe_dump(broken))
    assert rlkube(["validate", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == f"{path}: doc 1 (good): ok\n"
    assert f"{path}: doc 3 (broken): spec.rollout.batchSz: unknown field (did you mean 'batchSize'?)" in err


def test_validate_missing_file_fails(tmp_path, capsys):
    assert rlkube(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml: cannot read file" in capsys.readouterr().err


def test_load_rljobs_labels_errors_with_the_document(tmp_path, good_doc):
    import yaml

    good_doc["spec"]["rollout"]["batchSize"] = 32
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(good_doc))
    with pytest.raises(SpecError) as info:
        load_rljobs(path)
    assert info.value.errors == [("doc 1 (good): spec.training.globalBatchSize", BATCH_MESSAGE)]


def test_validate_names_the_parallelism_that_does_not_fit(tmp_path, capsys, good_doc):
    import yaml

    good_doc["spec"]["training"]["backend"] = "megatron"
    good_doc["spec"]["parallelism"] = {"tensor": 4, "pipeline": 2}
    good_doc["spec"]["resources"]["trainer"] = {"nodes": 2, "gpusPerNode": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(good_doc))
    assert rlkube(["validate", str(path)]) == 1
    assert capsys.readouterr().err == (
        f"{path}: doc 1 (good): spec.parallelism: tensor(4) x pipeline(2) = 8 GPUs per model replica "
        "must divide the trainer GPUs, resources.trainer.nodes(2) x gpusPerNode(2) = 4\n"
    )
