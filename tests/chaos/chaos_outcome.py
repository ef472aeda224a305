"""What a run trained, read from its output directory, and the figures comparing it to the
uninterrupted reference run of the same job.

A rollout that was trained and recorded but not yet covered by a checkpoint when the run died is
trained again after the resume (its record is written again): only the last record of each
rollout went into the final weights. "Trained twice" counts prompt groups and samples that the
final weights took twice, i.e. that appear in more than one rollout's last record; "redone"
counts rollouts whose work was repeated after a crash (lost time, not lost or doubled data).

The comparison tolerates nothing: the per-rollout sample ids, the engines' weight versions and
the final model's tensors (byte for byte) must equal the reference's. That holds because a run of
the tiny job on a CPU is deterministic: seeded model, seeded data order, sampling seeded per
request id (so a request retried on a replacement engine samples the same tokens), one trainer
thread.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / ".results"
FIGURES_FILE = RESULTS_DIR / "figures.json"


@dataclass(frozen=True)
class Outcome:
    """The audit trail of one output directory."""

    records: dict[int, dict[str, Any]]  # rollout -> its last samples.jsonl record
    recorded_times: Counter  # rollout -> how many times it was recorded
    weights_sha256: str | None  # of the newest complete checkpoint's model tensors
    last_checkpoint: int | None


def read_outcome(out: Path) -> Outcome:
    records: dict[int, dict[str, Any]] = {}
    times: Counter = Counter()
    path = out / "samples.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        records[record["rollout"]] = record
        times[record["rollout"]] += 1
    checkpoint, digest = final_weights(out / "checkpoints")
    return Outcome(records, times, digest, checkpoint)


def final_weights(root: Path) -> tuple[int | None, str | None]:
    """(rollout, sha256 of the model tensors) of the newest checkpoint that verifies."""
    import warnings

    import torch

    from rlkube_runtime.trainer.torch_backend import STATE_FILE as TRAINER_STATE_FILE
    from rlkube_runtime.trainer.checkpoint import load_latest_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = load_latest_checkpoint(root)
    if found is None:
        return None, None
    state = torch.load(found.path / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)
    return found.rollout_id, tensors_sha256(state["model"])


def tensors_sha256(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(tensor.dtype).encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


def compare(reference: Outcome, run: Outcome) -> dict[str, Any]:
    """The figures of `run` against `reference` (see the module docstring)."""
    ref_groups = Counter(g for r in reference.records.values() for g in r["group_indices"])
    run_groups = Counter(g for r in run.records.values() for g in r["group_indices"])
    ref_samples = Counter(i for r in reference.records.values() for i in r["sample_indices"])
    run_samples = Counter(i for r in run.records.values() for i in r["sample_indices"])
    same_rollouts = sorted(run.records) == sorted(reference.records)
    return {
        "groups_lost": sum((ref_groups - run_groups).values()),
        "groups_trained_twice": sum(n - 1 for n in run_groups.values() if n > 1),
        "samples_lost": sum((ref_samples - run_samples).values()),
        "samples_trained_twice": sum(n - 1 for n in run_samples.values() if n > 1),
        "samples_as_reference": same_rollouts and all(
            run.records[k]["sample_indices"] == reference.records[k]["sample_indices"] for k in reference.records
        ),
        "weight_versions_as_reference": same_rollouts and all(
            run.records[k]["weight_versions"] == reference.records[k]["weight_versions"] for k in reference.records
        ),
        "weights_as_reference": run.weights_sha256 is not None and run.weights_sha256 == reference.weights_sha256,
        "rollouts_redone": sum(n - 1 for n in run.recorded_times.values() if n > 1),
    }


def record_figures(scenario: str, figures: dict[str, Any]) -> None:
    """Merge one scenario's figures into tests/chaos/.results/figures.json (the README's table is
    rendered from it by tests/chaos/render_table.py)."""
    RESULTS_DIR.mkdir(exist_ok=True)
    data = json.loads(FIGURES_FILE.read_text()) if FIGURES_FILE.exists() else {"scenarios": {}}
    data["scenarios"][scenario] = {**figures, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    FIGURES_FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
