"""The hostile corpus (corpus.py): each spec refused by `rlkube validate` and by the API server
(`kubectl apply` through the chart's admission policy, the CRD's rules or strict field validation),
the refusal naming the field. Then what only the API server can know: whether the RLJob's author may
read the Secrets, ConfigMaps and claims the job names; and what an admin's allowance admits."""

from __future__ import annotations

import json

import pytest
import yaml
from corpus import ALLOWED_IMAGE, CORPUS_NAMESPACE, HOSTILE, Hostile, base_rljob
from secured_cluster import VALUES
from rlkube_runtime.cli import main as rlkube

CASES = [pytest.param(case, id=case.id) for case in HOSTILE]


def test_the_corpus_holds_at_least_twenty_hostile_specs_each_naming_another_way_in():
    assert len(HOSTILE) >= 20
    assert len({case.id for case in HOSTILE}) == len(HOSTILE)


def validate(tmp_path, doc: dict, capsys) -> tuple[int, str]:
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = rlkube(["validate", str(path), "--policy", str(VALUES)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_rlkube_validate_accepts_the_base_spec(tmp_path, capsys):
    code, output = validate(tmp_path, base_rljob("base"), capsys)
    assert code == 0, output


@pytest.mark.parametrize("case", CASES)
def test_rlkube_validate_refuses_each_hostile_spec_naming_the_field(case: Hostile, tmp_path, capsys):
    code, output = validate(tmp_path, case.rljob(), capsys)
    assert code == 1, output
    line = next((line for line in output.splitlines() if f": {case.field}: " in line), None)
    assert line is not None, f"no error names {case.field}:\n{output}"
    assert case.message in line, line


# --- through the API server --------------------------------------------------------------------------


def server_refusal(cp, doc: dict, *user: str) -> str | None:
    """What the API server answers `kubectl create --dry-run=server` (strict field validation, as
    `kubectl apply` validates by default) of `doc`: None when it accepts it, else its message."""
    args = ["create", "--dry-run=server", "--validate=strict", "-f", "-", *(f"--as={u}" for u in user)]
    proc = cp.kubectl(*args, input=json.dumps(doc), check=False)
    return None if proc.returncode == 0 else proc.stderr.strip()


@pytest.fixture(scope="module")
def corpus_namespace(secured):
    secured.create_namespace(CORPUS_NAMESPACE)
    yield secured
    secured.kubectl("delete", "namespace", CORPUS_NAMESPACE, "--wait=false", check=False)


@pytest.mark.controlplane
@pytest.mark.slow
def test_the_api_server_accepts_the_base_spec(corpus_namespace):
    assert server_refusal(corpus_namespace, base_rljob("base")) is None


@pytest.mark.controlplane
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_api_server_refuses_each_hostile_spec_naming_the_field(case: Hostile, corpus_namespace):
    refusal = server_refusal(corpus_namespace, case.rljob())
    assert refusal is not None, f"{case.id} was accepted"
    assert case.field in refusal, refusal
    assert (case.server_message or case.message) in refusal, refusal


# --- the author's own access ---------------------------------------------------------------------

AUTHOR = "alice"
READABLE = {"secrets": "alice-wandb", "configmaps": "alice-config", "persistentvolumeclaims": "alice-data"}


@pytest.fixture(scope="module")
def author(corpus_namespace):
    """User alice may create RLJobs in the corpus namespace and get only the objects of READABLE."""
    cp = corpus_namespace
    rules = [{"apiGroups": ["rlkube.io"], "resources": ["rljobs"], "verbs": ["get", "list", "create", "update", "patch"]}]
    rules += [{"apiGroups": [""], "resources": [kind], "resourceNames": [name], "verbs": ["get"]}
              for kind, name in READABLE.items()]
    cp.apply_yaml(yaml.safe_dump_all([
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "rljob-author", "namespace": CORPUS_NAMESPACE}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "rljob-author", "namespace": CORPUS_NAMESPACE},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "rljob-author"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": AUTHOR}]},
    ]))
    # RBAC is read from an informer: wait until the grant shows.
    cp.wait_for(lambda: cp.kubectl("auth", "can-i", "create", "rljobs.rlkube.io", "-n", CORPUS_NAMESPACE,
                                   f"--as={AUTHOR}", check=False).returncode == 0, 30, "alice's grant")
    return cp


def with_resources(name: str, **resources) -> dict:
    doc = base_rljob(name)
    doc["spec"]["resources"].update(resources)
    return doc


@pytest.mark.controlplane
@pytest.mark.slow
def test_the_author_may_name_only_secrets_configmaps_and_claims_they_may_read(author):
    cp = author
    readable = with_resources(
        "readable",
        secretEnv=[{"name": "WANDB_API_KEY", "secretName": READABLE["secrets"], "key": "api-key"}],
        volumes=[{"name": "cfg", "configMap": {"name": READABLE["configmaps"]}},
                 {"name": "data", "persistentVolumeClaim": {"claimName": READABLE["persistentvolumeclaims"]}}],
        volumeMounts=[{"name": "cfg", "mountPath": "/cfg"}, {"name": "data", "mountPath": "/data"}],
    )
    assert server_refusal(cp, readable, AUTHOR) is None
    refused = [
        (with_resources("s", secretEnv=[{"name": "A", "secretName": READABLE["secrets"], "key": "k"},
                                        {"name": "B", "secretName": "team-b-db", "key": "k"}]),
         "spec.resources.secretEnv[1].secretName: you may not get secrets 'team-b-db'"),
        (with_resources("p", imagePullSecrets=[{"name": "registry-admin"}]),
         "spec.resources.imagePullSecrets[0].name: you may not get secrets 'registry-admin'"),
        (with_resources("c", volumes=[{"name": "cfg", "configMap": {"name": "team-b-config"}}]),
         "spec.resources.volumes[0].configMap.name: you may not get configmaps 'team-b-config'"),
        (with_resources("e", env=[{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "team-b-config", "key": "x"}}}]),
         "spec.resources.env[0].valueFrom.configMapKeyRef.name: you may not get configmaps 'team-b-config'"),
        (with_resources("v", volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "team-b-checkpoints"}}]),
         "spec.resources.volumes[0].persistentVolumeClaim.claimName: you may not get persistentvolumeclaims "
         "'team-b-checkpoints'"),
    ]
    for doc, message in refused:
        refusal = server_refusal(cp, doc, AUTHOR)
        assert refusal is not None and message in refusal, (message, refusal)
    # The cluster admin may read anything, so the same specs pass for them.
    assert server_refusal(cp, refused[0][0]) is None


@pytest.mark.controlplane
@pytest.mark.slow
def test_changing_the_spec_is_checked_as_creating_it_and_a_label_change_is_not(author):
    cp = author
    doc = base_rljob("changed")
    cp.kubectl("create", "-f", "-", input=json.dumps(doc))
    try:
        doc["spec"]["resources"]["secretEnv"] = [{"name": "B", "secretName": "team-b-db", "key": "k"}]
        proc = cp.kubectl("apply", "-f", "-", f"--as={AUTHOR}", input=json.dumps(doc), check=False)
        assert proc.returncode != 0 and "spec.resources.secretEnv[0].secretName: you may not get secrets" in proc.stderr
        labelled = cp.kubectl("-n", CORPUS_NAMESPACE, "label", "rljob", "changed", "team=rl", f"--as={AUTHOR}",
                              check=False)
        assert labelled.returncode == 0, labelled.stderr
    finally:
        cp.kubectl("-n", CORPUS_NAMESPACE, "delete", "rljob", "changed", "--wait=false", check=False)


@pytest.mark.controlplane
@pytest.mark.slow
def test_what_an_admin_allows_in_a_namespace_both_checks_admit(secured, tmp_path, capsys):
    cp = secured
    namespace = "rlkube-sec-nfs"
    cp.create_namespace(namespace)
    try:
        doc = base_rljob("nas", namespace)
        doc["spec"]["resources"]["volumes"] = [{"name": "nas", "nfs": {"server": "nas", "path": "/rl"}}]
        doc["spec"]["resources"]["trainer"]["image"] = "docker.io/any/image:1"  # no registry list here
        assert server_refusal(cp, doc) is None
        code, output = validate(tmp_path, doc, capsys)
        assert code == 0, output
        # The shared Secret the corpus namespace allows passes there, as secretKeyRef and as volume.
        allowed = base_rljob("shared")
        allowed["spec"]["resources"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "shared-hf-token", "key": "token"}}}]
        cp.create_namespace(CORPUS_NAMESPACE)
        assert server_refusal(cp, allowed) is None
        assert validate(tmp_path, allowed, capsys)[0] == 0
        assert ALLOWED_IMAGE.startswith("registry.example.com/rl/")
    finally:
        cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
