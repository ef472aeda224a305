"""Every RLJob the project ships validates, through the library and through `rlkube validate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkube_runtime.cli import main as rlkube
from rlkube_runtime.spec.load import SpecError, load_documents, load_rljob, load_rljobs

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
EXPECTED = {"local-tiny.yaml", "cluster-tiny.yaml", "qwen3-4b-grpo-colocated.yaml", "qwen3-4b-grpo-separate.yaml", "async-grpo.yaml", "multi-turn.yaml"}


def test_the_documented_examples_exist():
    assert EXPECTED <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_validates(path):
    assert load_rljobs(path)


def test_rlkube_validate_accepts_every_example(capsys):
    assert rlkube(["validate", *map(str, EXAMPLES)]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok\n") == len(EXAMPLES)


def test_every_rljob_anywhere_in_manifests_validates():
    for path in sorted((REPO / "manifests").rglob("*.y*ml")):
        for _, doc in load_documents(path):
            if isinstance(doc, dict) and doc.get("kind") == "RLJob":
                assert load_rljobs(path), path


def test_load_rljob_wants_exactly_one(tmp_path):
    two = tmp_path / "two.yaml"
    text = (REPO / "manifests" / "examples" / "local-tiny.yaml").read_text()
    two.write_text(text + "---\n" + text.replace("name: local-tiny", "name: other"))
    with pytest.raises(SpecError, match=r"expected exactly one RLJob, found 2 \(local-tiny, other\)"):
        load_rljob(two)


def test_local_tiny_is_the_embedded_default():
    job = load_rljob(REPO / "manifests" / "examples" / "local-tiny.yaml")
    spec = job.spec
    assert (spec.model.preset, spec.data.prompt_data) == ("tiny", "builtin:digit-successor")
    assert (spec.rollout.engine, spec.reward.type, spec.resources.placement) == ("builtin", "exact", "colocated")
    assert (spec.rollout.batch_size, spec.rollout.n_samples_per_prompt, spec.rollout.max_response_len) == (16, 8, 1)
    assert (spec.training.num_rollout, spec.global_batch_size, spec.training.optimizer.lr) == (60, 128, 5e-3)
    assert spec.checkpoint.interval == 10
