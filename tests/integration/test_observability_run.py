"""A real local run with W&B (offline) and MLflow (a file store) configured in its spec: both get
every rollout's metrics as the JSONL has them, and eval's pass@k arrives with the rest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from local_runs import read_jsonl, start_run, write_local_tiny

# The readers of W&B's offline run files live with the unit tests of the trackers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

pytestmark = [pytest.mark.slow]


def test_a_run_logs_its_jsonl_metrics_to_wandb_and_mlflow(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from test_tracking import _numbers, _wandb_run

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = f"file:{tmp_path / 'mlruns'}"
    job = write_local_tiny(
        tmp_path,
        "tracked",
        **{
            "spec.training.numRollout": 3,
            "spec.observability": {"wandb": {"project": "rlkube-test", "mode": "offline"},
                                   "mlflow": {"trackingUri": uri, "experiment": "tracked"}},
            "spec.eval": {"interval": 3, "datasets": [
                {"name": "successor", "path": "builtin:digit-successor", "nSamples": 4, "passK": [1, 4]}]},
        },
    )
    out = tmp_path / "out"
    run = start_run(job, out, env={"WANDB_SILENT": "true"})
    try:
        assert run.wait(timeout_s=300) == 0, run.output[-4000:]
    finally:
        run.kill()
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["rollout"] for r in records] == [-1, 0, 1, 2]
    assert 0 <= records[-1]["eval/successor/pass_at_1"] <= records[-1]["eval/successor/pass_at_4"] <= 1

    _run_id, rows, _config = _wandb_run(out)
    assert [row["rollout"] for row in rows] == [-1, 0, 1, 2]
    for row, record in zip(rows, records):
        assert {k: v for k, v in row.items() if not k.startswith("_") and k != "rollout"} == _numbers(record)

    client = MlflowClient(tracking_uri=uri)
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    for record in records:
        for key, value in _numbers(record).items():
            history = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, key)}
            assert history[record["rollout"]] == pytest.approx(value), key
