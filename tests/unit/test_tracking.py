"""W&B and MLflow receive each rollout's metrics under the JSONL's names, and every start of one job
continues one tracker run. W&B runs offline (its run file read back record by record), MLflow on a
local file store (read back with its client)."""

from __future__ import annotations

import io
import json
import struct
import time
from pathlib import Path

import pytest
import yaml

from rlkube_runtime.metrics import MetricsLogger
from rlkube_runtime.spec import parse_rljob
from rlkube_runtime.tracking import (
    RUN_ID_TAG,
    TrackingError,
    check_trackers_available,
    open_trackers,
    run_identity,
)

REPO = Path(__file__).resolve().parents[2]
ROLLOUTS = [
    (-1, {"eval/reward": 0.125, "eval/successor/pass_at_2": 0.25, "progress/num_rollout": 3}),
    (0, {"rollout/raw_reward": 0.25, "train/loss": -0.5, "perf/step_time": 1.5, "note": "not a number"}),
    (1, {"rollout/raw_reward": 0.75, "train/loss": -0.25, "perf/step_time": 1.0}),
]


def _job(observability: dict):
    doc = yaml.safe_load((REPO / "manifests" / "examples" / "local-tiny.yaml").read_text())
    doc["spec"]["observability"] = observability
    return parse_rljob(doc)


def _log_rollouts(job, out: Path, identity, rollouts=ROLLOUTS) -> list[dict]:
    """Log through MetricsLogger as the driver does; returns the JSONL records."""
    logger = MetricsLogger(job.metadata.name, out, tensorboard=False, trackers=open_trackers(job, identity), stream=io.StringIO())
    for rollout_id, metrics in rollouts:
        logger.log(rollout_id, metrics)
    logger.close()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _numbers(record: dict) -> dict[str, float]:
    """A JSONL record's metrics: its numbers, without the record's own `rollout` and `time`."""
    return {k: v for k, v in record.items() if k not in ("rollout", "time") and isinstance(v, (int, float))}


# --- W&B -------------------------------------------------------------------------------------------------


def _wandb_records(path: Path):
    """The protobuf records of an offline `.wandb` run file (W&B's LevelDB-style log: a 7-byte file
    header, then 32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, header, pos, pending = 32768, 7, 7, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if kind == 0:
            pos += left
            continue
        body, pos = data[pos + header : pos + header + length], pos + header + length
        pending = body if kind in (1, 2) else pending + body  # full, first / middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _finished_records(run_file: Path, timeout_s: float = 30) -> list:
    """The file's records once its `exit` record is in: W&B's service process writes the file
    after `finish()` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_wandb_records(run_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _wandb_run(out: Path) -> tuple[str, list[dict], dict]:
    """(run id, history rows, config) of the offline runs under out/wandb, in the order written."""
    run_id, rows, config = None, [], {}
    run_files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert run_files, sorted(out.rglob("*"))
    for run_file in run_files:
        for record in _finished_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = run_id or record.run.run_id
                assert record.run.run_id == run_id, "a second start opened another run"
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return run_id, rows, config


def test_wandb_offline_gets_the_jsonl_metrics_under_the_same_names_at_their_rollout(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    job = _job({"wandb": {"project": "rlkube-test", "mode": "offline"}})
    records = _log_rollouts(job, tmp_path, run_identity(job, tmp_path, env={}))

    run_id, rows, config = _wandb_run(tmp_path)
    assert run_id == run_identity(job, tmp_path, env={}).run_id
    assert len(rows) == len(records) == 3
    for row, record in zip(rows, records):
        assert row["rollout"] == record["rollout"]
        assert {k: v for k, v in row.items() if not k.startswith("_") and k != "rollout"} == _numbers(record)
    assert config["rlkube_attempt"] == "local" and config["spec"]["training"]["numRollout"] == 60


def test_wandb_restarts_of_one_rljob_continue_one_run_and_record_each_attempt(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    job = _job({"wandb": {"project": "rlkube-test", "mode": "offline"}})
    cluster = {"RLKUBE_RLJOB_NAME": "local-tiny", "RLKUBE_RLJOB_NAMESPACE": "team-a"}
    _log_rollouts(job, tmp_path, run_identity(job, tmp_path, env={**cluster, "RLKUBE_ATTEMPT": "1"}), ROLLOUTS[:2])
    _log_rollouts(job, tmp_path, run_identity(job, tmp_path, env={**cluster, "RLKUBE_ATTEMPT": "2"}), ROLLOUTS[2:])

    run_id, rows, config = _wandb_run(tmp_path)
    assert run_id == "team-a-local-tiny"
    assert [row["rollout"] for row in rows] == [-1, 0, 1]
    assert config["rlkube_attempt"] == "2"


# --- MLflow ----------------------------------------------------------------------------------------------


def test_mlflow_gets_the_jsonl_metrics_and_a_resumed_job_continues_its_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch

    uri = f"file:{tmp_path / 'mlruns'}"
    job = _job({"mlflow": {"trackingUri": uri, "experiment": "rlkube-test"}})
    cluster = {"RLKUBE_RLJOB_NAME": "local-tiny", "RLKUBE_RLJOB_NAMESPACE": "team-a"}
    first = _log_rollouts(job, tmp_path / "a", run_identity(job, tmp_path, env={**cluster, "RLKUBE_ATTEMPT": "1"}), ROLLOUTS[:2])
    second = _log_rollouts(job, tmp_path / "b", run_identity(job, tmp_path, env={**cluster, "RLKUBE_ATTEMPT": "2"}), ROLLOUTS[2:])

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("rlkube-test")
    [run] = client.search_runs([experiment.experiment_id])  # one run for both starts
    assert run.data.tags[RUN_ID_TAG] == "team-a-local-tiny" and run.data.tags["rlkube.attempt"] == "2"
    assert run.info.run_name == "local-tiny" and run.info.status == "FINISHED"
    for record in first + second:
        for key, value in _numbers(record).items():
            history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            assert history[record["rollout"]] == pytest.approx(value), key
    assert set(run.data.metrics) == {k for r in first + second for k in _numbers(r)}


# --- identity, checks, failures --------------------------------------------------------------------------


def test_a_local_run_is_identified_by_its_job_and_output_directory(tmp_path):
    job = _job({})
    one, again, other = (run_identity(job, p, env={}) for p in (tmp_path / "a", tmp_path / "a", tmp_path / "b"))
    assert one.run_id == again.run_id != other.run_id and one.run_id.startswith("local-tiny-")
    assert one.attempt == "local"


def test_an_online_wandb_run_in_a_pod_without_its_api_key_is_refused_naming_the_fields():
    job = _job({"wandb": {"project": "p"}})
    with pytest.raises(TrackingError, match=r"spec\.observability\.wandb: mode online needs WANDB_API_KEY.*spec\.resources\.secretEnv"):
        check_trackers_available(job.spec.observability, env={"RLKUBE_RLJOB_NAME": "x"})
    check_trackers_available(job.spec.observability, env={"RLKUBE_RLJOB_NAME": "x", "WANDB_API_KEY": "k"})
    check_trackers_available(job.spec.observability, env={})  # locally `wandb login` may hold the key


def test_no_tracker_runs_unless_configured(tmp_path):
    job = _job({})
    assert open_trackers(job, run_identity(job, tmp_path, env={})) == []


def test_a_tracker_that_fails_to_log_does_not_stop_the_other_sinks(tmp_path):
    class Down:
        closed = False

        def log(self, rollout_id, metrics):
            raise ConnectionError("tracking server unreachable")

        def close(self):
            Down.closed = True

    logger = MetricsLogger("demo", tmp_path, tensorboard=False, trackers=[Down()], stream=io.StringIO())
    logger.log(0, {"rollout/raw_reward": 0.5})
    logger.log(1, {"rollout/raw_reward": 0.75})
    logger.close()
    assert [json.loads(line)["rollout/raw_reward"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0.5, 0.75]
    assert Down.closed


def test_the_trackers_record_the_spec_with_environment_variables_by_name_only():
    from rlkube_runtime.spec import RLJob
    from rlkube_runtime.tracking import tracker_config

    job = _job({})
    spec = job.model_dump(mode="json", by_alias=True)["spec"]
    spec["resources"]["env"] = [{"name": "SEARCH_URL", "value": "http://retriever:8000"}]
    config = tracker_config(RLJob.model_validate({**job.model_dump(mode="json", by_alias=True), "spec": spec}))
    assert config["resources"]["env"] == [{"name": "SEARCH_URL"}]
    assert config["training"] == {k: v for k, v in spec["training"].items() if v is not None}  # unset: left out
