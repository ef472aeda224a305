"""Every example RLJob renders into pods, through the operator's own rendering."""

from __future__ import annotations

from pathlib import Path

import pytest
from rlkube_operator.preview import main, preview
from rlkube_runtime.spec.load import load_documents

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "manifests" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_renders_its_configmap_rbac_and_rayjob(path):
    for _, doc in load_documents(path):
        kinds = [o["kind"] for o in preview(doc)]
        assert kinds == ["ConfigMap", "ServiceAccount", "Role", "RoleBinding", "RayJob"]


def test_the_preview_command_prints_yaml_and_reports_bad_files(tmp_path, capsys):
    assert EXAMPLES, "no example manifests found"
    assert main([str(EXAMPLES[0])]) == 0
    assert "kind: RayJob" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: rlkube.io/v1alpha1\nkind: RLJob\nmetadata: {name: x}\nspec: {}\n")
    assert main([str(bad)]) == 1
    assert "spec.model" in capsys.readouterr().err
