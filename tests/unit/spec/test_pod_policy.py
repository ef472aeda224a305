"""What a job's pods may reach (spec/pod_policy.py) and the spec's honesty rules (spec/resources.py):
the cases the hostile corpus (tests/security/corpus.py) does not cover one by one."""

from __future__ import annotations

import pytest
from rlkube_runtime.spec.load import SpecError, parse_rljob
from rlkube_runtime.spec.pod_policy import (
    DEFAULT_POLICY,
    MAX_NAMED_OBJECTS,
    PodAllowance,
    PodPolicy,
    load_pod_policy,
    named_objects,
)


def job(**resources) -> dict:
    return {
        "apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "j", "namespace": "team-a"},
        "spec": {"model": {"preset": "tiny"}, "data": {"promptData": "builtin:digit-successor"},
                 "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2}, "reward": {"type": "exact"},
                 "training": {"numRollout": 3}, "resources": {"placement": "colocated", **resources}},
    }


def errors(doc: dict, allowance: PodAllowance | None = DEFAULT_POLICY.default) -> list[tuple[str, str]]:
    try:
        parse_rljob(doc, pod_policy=allowance)
    except SpecError as exc:
        return exc.errors
    return []


def test_the_safe_volume_types_need_no_allowance():
    volumes = [{"name": "a", "configMap": {"name": "c"}}, {"name": "b", "emptyDir": {}},
               {"name": "c", "persistentVolumeClaim": {"claimName": "p"}}, {"name": "d", "downwardAPI": {"items": []}},
               {"name": "e", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]
    assert errors(job(volumes=volumes)) == []


def test_an_allowance_admits_a_type_and_named_secrets_and_secret_admits_any_secret():
    nfs = job(volumes=[{"name": "n", "nfs": {"server": "s", "path": "/"}}])
    assert errors(nfs)[0][0] == "spec.resources.volumes[0].nfs"
    assert errors(nfs, PodAllowance(volume_types=["nfs"])) == []
    secret = job(volumes=[{"name": "s", "secret": {"secretName": "shared"}}],
                 env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": "shared", "key": "k"}}}])
    assert [path for path, _ in errors(secret)] == ["spec.resources.volumes[0].secret.secretName",
                                                    "spec.resources.env[0].valueFrom.secretKeyRef.name"]
    assert errors(secret, PodAllowance(secret_names=["shared"])) == []
    assert errors(job(volumes=[{"name": "s", "secret": {"secretName": "any"}}]), PodAllowance(volume_types=["secret"])) == []


def test_the_runtime_applies_no_pod_policy():
    # `rlkube run` makes no pods: a job an admin allowed hostPath must not be refused at its start.
    assert errors(job(volumes=[{"name": "h", "hostPath": {"path": "/data"}}]), allowance=None) == []


def test_a_namespace_entry_replaces_the_defaults_value_of_each_field_it_sets():
    policy = PodPolicy.model_validate({"default": {"volumeTypes": ["nfs"], "imageRegistries": ["reg/"]},
                                       "namespaces": {"team-a": {"imageRegistries": []}}})
    assert policy.allowance("team-a") == PodAllowance(volume_types=["nfs"], image_registries=[])
    assert policy.allowance("team-b") == PodAllowance(volume_types=["nfs"], image_registries=["reg/"])


def test_a_bad_policy_file_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text("podPolicy:\n  namespaces:\n    team-a: {volumeTypess: [nfs]}\n")
    with pytest.raises(ValueError, match=r"values.yaml: not a pod policy: volumeTypess"):
        load_pod_policy(path)


def test_variables_set_twice_are_refused_naming_the_second():
    doc = job(env=[{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
              secretEnv=[{"name": "A", "secretName": "s", "key": "k"}])
    assert errors(doc, None) == [("spec.resources.secretEnv[0].name", "'A' is already set by env[0]; keep one")]


def test_a_resource_requirement_rlkube_does_not_render_is_refused():
    doc = job(trainer={"resources": {"limits": {"cpu": "1"}, "claims": [{"name": "gpu"}]}})
    [(path, message)] = errors(doc, None)
    assert path == "spec.resources.trainer.resources.claims" and "only requests and limits" in message


def test_the_head_takes_requests_and_limits_but_no_gpu():
    assert errors(job(head={"resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}}), None) == []
    [(path, message)] = errors(job(head={"resources": {"requests": {"cpu": "1"}, "claims": [{"name": "x"}]}}), None)
    assert path == "spec.resources.head.resources.claims" and "only requests and limits" in message
    [(path, message)] = errors(job(head={"resources": {"limits": {"nvidia.com/gpu": "1"}}}), None)
    assert path == "spec.resources.head.resources.limits" and "runs no GPU work" in message


def test_credential_names_with_literal_values_are_refused_and_others_are_not():
    for name in ("WANDB_API_KEY", "HF_TOKEN", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "TOKEN"):
        [(path, message)] = errors(job(env=[{"name": name, "value": "x"}]), None)
        assert path == "spec.resources.env[0].value" and "holds a credential" in message, name
    for name in ("TOKENIZERS_PARALLELISM", "AWS_ACCESS_KEY_ID", "NCCL_DEBUG", "KEYRING_DIR"):
        assert errors(job(env=[{"name": name, "value": "x"}]), None) == [], name


def test_a_job_names_at_most_six_of_each_kind_its_author_must_be_able_to_read():
    env = [{"name": f"S{i}", "secretName": f"s{i}", "key": "k"} for i in range(MAX_NAMED_OBJECTS + 1)]
    [(path, message)] = errors(job(secretEnv=env))
    assert path == "spec.resources" and "names 7 Secrets; at most 6" in message
    # Names are counted once, however often they are named.
    env = [{"name": f"S{i}", "secretName": "same", "key": f"k{i}"} for i in range(MAX_NAMED_OBJECTS + 1)]
    assert errors(job(secretEnv=env)) == []
    doc = job(volumes=[{"name": "c", "configMap": {"name": "cfg"}}],
              env=[{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cfg2", "key": "x"}}}],
              imagePullSecrets=[{"name": "pull"}])
    assert named_objects(parse_rljob(doc).spec) == {"Secrets": ["pull"], "ConfigMaps": ["cfg", "cfg2"],
                                                    "PersistentVolumeClaims": []}
