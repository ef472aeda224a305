"""The operator <-> runtime contract: the fixed fields come from the spec's own transition rules,
and both sides use the contract's names."""

from rlkube_operator import reconcile, render
from rlkube_runtime.spec import contract


def test_fixed_fields_are_read_from_the_specs_transition_rules():
    assert set(contract.fixed_fields()) == {
        "model", "data", "parallelism", "resources.placement", "rollout.batchSize", "rollout.nSamplesPerPrompt",
        "training.globalBatchSize", "training.numStepsPerRollout", "training.mode", "training.backend", "training.lora",
    }
    assert reconcile.IMMUTABLE_FIELDS == contract.fixed_fields()


def test_the_rendered_entrypoint_mount_and_environment_are_what_the_runtime_reads():
    from pathlib import Path

    import yaml

    from rlkube_operator.settings import OperatorSettings
    from rlkube_runtime.spec.load import parse_rljob

    doc = yaml.safe_load((Path(__file__).resolve().parents[3] / "manifests/examples/local-tiny.yaml").read_text())
    doc["metadata"].update(namespace="a", uid="u")
    job = parse_rljob(doc)
    rayjob = render.render_rayjob(render.JobRef.from_body(doc), job.spec, attempt=0, settings=OperatorSettings())
    assert rayjob["spec"]["entrypoint"] == f"rlkube run {contract.SPEC_MOUNT_DIR}/{contract.SPEC_FILE}"
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert env[contract.ENV_RLJOB_NAME] == "local-tiny" and env[contract.ENV_RLJOB_NAMESPACE] == "a"
    assert env[contract.ENV_METRICS_PORT] == str(contract.METRICS_PORT)
    assert {"name": contract.METRICS_PORT_NAME, "containerPort": contract.METRICS_PORT} in head["ports"]
    assert any(m["mountPath"] == contract.SPEC_MOUNT_DIR for m in head["volumeMounts"])
