"""Rollout dumps: what each rollout generated, as JSON lines a person can read and a run can train on.

`<output>/rollouts/rollout_<k>.jsonl` holds one sample a line: the fields of `Sample.to_dict()`
(prompt, response, tokens, reward, engine logprobs `rollout_log_probs`, loss mask, status, ...),
plus the per-token `advantages` the trainer computed (null when nothing trained, as with
`--debug-rollout-only`) and `samples_in_rollout`, so a reader can tell a sample of the rollout from
all of it. slime's --save-debug-rollout-data / --load-debug-rollout-data, in rlkube's file layout:
`rlkube run --debug-train-only --load-rollouts DIR` trains on complete dumps without engines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

from rlkube_runtime.data.sample import Sample

DUMP_DIR = "rollouts"
_FILE = re.compile(r"^rollout_(\d+)\.jsonl$")
_EXTRA_KEYS = ("advantages", "samples_in_rollout")


class RolloutDumpError(ValueError):
    """A dump that cannot be trained on; the message names the file and what to do."""


def dump_path(directory: Path, rollout_id: int) -> Path:
    return Path(directory) / f"rollout_{rollout_id}.jsonl"


def samples_to_dump(samples: Sequence[dict[str, Any]], mode: str, limit: int) -> int:
    """How many of the rollout's samples (ordered by group) a dump in `mode` writes: all, none, or
    whole groups from the first one until `limit` samples are reached (at least one group)."""
    if mode == "off":
        return 0
    if mode == "all" or len(samples) <= limit:
        return len(samples)
    count = 0
    while count < len(samples) and count < limit:
        group = samples[count]["group_index"]
        while count < len(samples) and samples[count]["group_index"] == group:
            count += 1
    return count


def write_rollout_dump(
    directory: Path,
    rollout_id: int,
    samples: Sequence[dict[str, Any]],
    advantages: Sequence[Sequence[float]] | None,
    *,
    samples_in_rollout: int,
) -> Path:
    """One line per sample (as `Sample.to_dict()`), written whole or not at all: a run stopped
    while writing leaves no truncated file that a later train-only run would refuse."""
    if advantages is not None and len(advantages) < len(samples):
        raise ValueError(f"{len(samples)} samples to dump but {len(advantages)} advantage rows")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = dump_path(directory, rollout_id)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, sample in enumerate(samples):
            record = {**sample, "advantages": list(advantages[i]) if advantages is not None else None,
                      "samples_in_rollout": samples_in_rollout}
            f.write(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def dumped_rollout_ids(directory: Path) -> list[int]:
    """The rollout ids with a dump in `directory`, in order."""
    directory = Path(directory)
    if not directory.is_dir():
        raise RolloutDumpError(f"--load-rollouts {directory}: no such directory")
    ids = sorted(int(m[1]) for p in directory.iterdir() if (m := _FILE.match(p.name)))
    if not ids:
        raise RolloutDumpError(
            f"--load-rollouts {directory}: no rollout_<k>.jsonl files; a run writes them to <output>/{DUMP_DIR}/"
        )
    return ids


def load_rollout_dump(directory: Path, rollout_id: int, *, expected_samples: int | None = None) -> list[dict[str, Any]]:
    """A complete dump's samples as `Sample.to_dict()` dicts (checked by `Sample.from_dict`), ready
    for `TrainerWorker.train`."""
    path = dump_path(directory, rollout_id)
    samples, declared = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise RolloutDumpError(f"{path}:{number}: not JSON: {err}") from None
            declared.add(record.get("samples_in_rollout"))
            sample = {k: v for k, v in record.items() if k not in _EXTRA_KEYS}
            try:
                Sample.from_dict(sample).check_lengths()
            except (TypeError, ValueError) as err:
                raise RolloutDumpError(f"{path}:{number}: {err}") from None
            samples.append(sample)
    if declared != {len(samples)}:
        raise RolloutDumpError(
            f"{path} holds {len(samples)} of the rollout's {sorted(d for d in declared if d is not None) or '?'} samples "
            "(a sample dump); training needs whole rollouts: run with spec.observability.rolloutDump: all "
            "or `rlkube run --dump-all-rollouts`"
        )
    if expected_samples is not None and len(samples) != expected_samples:
        raise RolloutDumpError(
            f"{path} holds {len(samples)} samples but this job trains on rollout.batchSize x nSamplesPerPrompt = "
            f"{expected_samples} per rollout; train it with the job file that dumped it"
        )
    return samples
